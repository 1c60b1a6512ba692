"""Instances sharing a GPU (`instances.gpus_per_instance`): the schema and the device choice.

Pure logic on the CPU; the fleets themselves run on one GPU in the ``multigpu`` tests, which take
``gpus_per_instance: 0.5`` when only one GPU is visible.
"""

from __future__ import annotations

import pytest

from disagg.cluster.launch.bootstrap import resolve_device
from disagg.config import Config
from disagg.errors import ConfigError, PreflightError


def instances(**fields):
    base = {"model": {"source": "dummy:tiny"}, "instances": {"prefill": 1, "decode": 1, **fields}}
    return Config.from_dict(base).instances


@pytest.mark.parametrize("share, per_gpu, gpus", [(1.0, 1, 2), (0.5, 2, 1), (0.25, 4, 1), (1 / 3, 3, 1)])
def test_share_counts_whole_gpus(share, per_gpu, gpus):
    inst = instances(gpus_per_instance=share)
    assert (inst.ranks_per_gpu, inst.num_gpus) == (per_gpu, gpus)


@pytest.mark.parametrize("share, words", [(0.4, "1/k for a whole k"), (2.0, "instances.tensor_parallel"),
                                          (0, "greater than 0"), (-0.5, "greater than 0")])
def test_share_refused_with_the_reason(share, words):
    with pytest.raises(ConfigError, match=words):
        instances(gpus_per_instance=share)


def test_one_gpu_holds_two_instances_only_when_they_share_it():
    assert resolve_device(instances(device="auto"), num_gpus=1) == "cpu"
    assert resolve_device(instances(device="auto", gpus_per_instance=0.5), num_gpus=1) == "cuda"
    assert resolve_device(instances(device="cuda", gpus_per_instance=0.5), num_gpus=1) == "cuda"
    assert resolve_device(instances(device="auto"), num_gpus=2) == "cuda"
    assert resolve_device(instances(device="auto", gpus_per_instance=0.5), num_gpus=0) == "cpu"
    assert resolve_device(instances(device="cpu", gpus_per_instance=0.5), num_gpus=1) == "cpu"


def test_too_few_gpus_for_cuda_says_how_to_share():
    with pytest.raises(PreflightError, match=r"2 instances need 2 GPUs, the Ray cluster has 1; set "
                                             r"instances.gpus_per_instance: 0.5"):
        resolve_device(instances(device="cuda"), num_gpus=1)
    with pytest.raises(PreflightError, match=r"at 0.5 GPU each need 1 GPUs, the Ray cluster has 0; with no GPU, "
                                             r"run a CPU config \(configs/tiny-1p1d.yaml, .*--set instances.device=cpu"):
        resolve_device(instances(device="cuda", gpus_per_instance=0.5), num_gpus=0)


def test_demo_on_one_gpu_shares_it_and_compares_with_one_colocated_instance():
    from disagg.cluster.cli.demo import choose

    kind, disagg_path, colocated_path = choose(1)
    disagg, colocated = Config.from_yaml(disagg_path), Config.from_yaml(colocated_path)
    assert kind == "gpu-shared"
    assert (disagg.instances.num_gpus, disagg.instances.ranks_per_gpu, disagg.transfer.backend) == (1, 2, "nvshmem")
    assert (colocated.instances.colocated, colocated.instances.num_gpus) == (1, 1)
    assert disagg.model == colocated.model and disagg.cache == colocated.cache
    assert Config.from_yaml(disagg.bench.compare_with).instances == colocated.instances
