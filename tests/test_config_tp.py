"""disagg.config: instances.tensor_parallel (an int or a mapping per role), the rank and GPU
accessors, the refusals of the file, and the shipped TP configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from disagg.config import Config, InstancesSection
from disagg.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny-1p1d.yaml"


def load(tmp_path: Path, **instances) -> Config:
    """tiny-1p1d.yaml with its instances section replaced, read from a file as a user's would be
    (written with sorted keys: a mapping's roles come in alphabetical order)."""
    raw = yaml.safe_load(TINY.read_text())
    raw["instances"] = dict(instances, device="cpu")
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return Config.from_yaml(path)


def refused(tmp_path: Path, **instances) -> str:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, **instances)
    return str(caught.value)


@pytest.mark.parametrize("instances, prefill, decode, colocated, num_ranks", [
    ({"prefill": 1, "decode": 1}, 1, 1, 1, 2),
    ({"prefill": 1, "decode": 1, "tensor_parallel": 2}, 2, 2, 2, 4),
    ({"prefill": 3, "decode": 2, "tensor_parallel": {"prefill": 4, "decode": 4}}, 4, 4, 1, 20),
    ({"colocated": 3, "tensor_parallel": {"colocated": 2}}, 1, 1, 2, 6),
    ({"colocated": 2, "tensor_parallel": 8}, 8, 8, 8, 16),
])
def test_tensor_parallel_is_an_int_or_a_mapping_per_role(tmp_path: Path, instances: dict, prefill: int,
                                                         decode: int, colocated: int, num_ranks: int):
    inst = load(tmp_path, **instances).instances
    assert [inst.tensor_parallel_of(role) for role in ("prefill", "decode", "colocated")] == [prefill, decode,
                                                                                              colocated]
    assert inst.num_ranks == num_ranks


@pytest.mark.parametrize("instances, gpus_per_instance, num_gpus, ranks_per_gpu", [
    ({"prefill": 1, "decode": 1, "tensor_parallel": 2}, 1.0, 4, 1),
    ({"prefill": 1, "decode": 1, "tensor_parallel": 2}, 0.5, 2, 2),
    ({"prefill": 1, "decode": 1, "tensor_parallel": 2}, 0.25, 1, 4),
    ({"colocated": 1, "tensor_parallel": 2}, 1.0, 2, 1),
    ({"colocated": 3, "tensor_parallel": 1}, 0.5, 2, 2),  # three ranks at two per GPU: two GPUs
])
def test_gpus_are_counted_per_rank(tmp_path: Path, instances: dict, gpus_per_instance: float, num_gpus: int,
                                   ranks_per_gpu: int):
    inst = load(tmp_path, gpus_per_instance=gpus_per_instance, **instances).instances
    assert (inst.num_gpus, inst.ranks_per_gpu) == (num_gpus, ranks_per_gpu)


def test_the_default_is_one_rank_per_instance():
    inst = Config.from_yaml(TINY).instances
    assert inst.tensor_parallel == 1 and inst.num_ranks == inst.num_instances == 2
    assert "tensor_parallel" not in inst.model_fields_set


def test_tensor_parallel_of_an_unknown_role_raises():
    with pytest.raises(ValueError, match=r"role: expected one of prefill, decode, colocated, got 'prefil'"):
        Config.from_yaml(TINY).instances.tensor_parallel_of("prefil")


@pytest.mark.parametrize("value, expected", [
    (0, r"instances\.tensor_parallel: expected ranks per instance, an int >= 1, or a mapping of prefill, decode, "
        r"colocated to them \(got 0\)"),
    (-2, r"instances\.tensor_parallel: expected ranks per instance, an int >= 1.* \(got -2\)"),
    (True, r"instances\.tensor_parallel: expected ranks per instance, an int >= 1.* \(got True\)"),
    ("2", r"instances\.tensor_parallel: expected ranks per instance, an int >= 1.* \(got '2'\)"),
    (2.0, r"instances\.tensor_parallel: expected ranks per instance, an int >= 1.* \(got 2\.0\)"),
    ({"prefill": 0, "decode": 2}, r"instances\.tensor_parallel: prefill: expected ranks per instance, an int >= 1, "
                                  r"got 0"),
    ({"prefill": 2, "decode": "2"}, r"instances\.tensor_parallel: decode: expected ranks per instance, an int >= "
                                    r"1, got '2'"),
    ({"prefil": 2, "decode": 2}, r"instances\.tensor_parallel: unknown role 'prefil' in \{'decode': 2, 'prefil': "
                                 r"2\}; did you mean 'prefill'\?"),
    ({"experts": 2}, r"instances\.tensor_parallel: unknown role 'experts' in \{'experts': 2\}; expected one of "
                     r"colocated, decode, prefill"),
])
def test_a_bad_tensor_parallel_names_the_field_what_was_expected_and_what_was_given(tmp_path: Path, value,
                                                                                     expected: str):
    message = refused(tmp_path, prefill=1, decode=1, tensor_parallel=value)
    assert str(tmp_path / "tp.yaml") in message
    assert re.search(expected, message), message


def test_different_tensor_parallelism_on_the_two_sides_is_accepted_by_the_file(tmp_path: Path):
    """The file allows any pair; the launch's preflight checks that the model shards over each
    (tests/reliability/test_bad_config.py, tests/cluster/test_preflight_pairs.py)."""
    inst = load(tmp_path, prefill=1, decode=1, tensor_parallel={"prefill": 2, "decode": 4}).instances
    assert (inst.tensor_parallel_of("prefill"), inst.tensor_parallel_of("decode"), inst.num_ranks) == (2, 4, 6)
    inst = load(tmp_path, prefill=2, decode=1, tensor_parallel={"prefill": 2}).instances  # decode left out: 1
    assert (inst.tensor_parallel_of("prefill"), inst.tensor_parallel_of("decode"), inst.num_ranks) == (2, 1, 5)


@pytest.mark.parametrize("instances, idle", [
    ({"prefill": 1, "decode": 1, "tensor_parallel": {"colocated": 2}}, "colocated"),
    ({"colocated": 1, "tensor_parallel": {"prefill": 2, "decode": 2}}, "prefill, decode"),
])
def test_a_mapping_naming_a_role_the_fleet_lacks_is_refused(tmp_path: Path, instances: dict, idle: str):
    message = refused(tmp_path, **instances)
    assert f"instances: tensor_parallel gives {idle}, which this fleet has no instances of" in message


def test_more_than_one_gpu_per_instance_points_to_tensor_parallel(tmp_path: Path):
    message = refused(tmp_path, prefill=1, decode=1, gpus_per_instance=2.0)
    assert "instances: gpus_per_instance is per rank, at most one GPU; got 2.0" in message
    assert "instances.tensor_parallel" in message and "does not have yet" not in message


def test_override_keeps_and_replaces_tensor_parallel():
    config = Config.from_yaml(CONFIGS / "tiny-tp2-1p1d.yaml")
    wider = config.override({"instances.decode": 2})
    assert (wider.instances.tensor_parallel, wider.instances.num_ranks) == (2, 6)
    mapped = config.override({"instances.tensor_parallel": {"prefill": 1, "decode": 1}})
    assert mapped.instances.num_ranks == 2
    asymmetric = config.override({"instances.tensor_parallel": {"prefill": 1, "decode": 2}})
    assert asymmetric.instances.num_ranks == 3
    again = InstancesSection.model_validate(mapped.instances.model_dump())
    assert again == mapped.instances


@pytest.mark.parametrize("name, mode, tensor_parallel, num_ranks, num_gpus, device", [
    ("tiny-tp2-1p1d", "disaggregated", 2, 4, 4, "cpu"),
    ("llama3-8b-tp2-colocated", "colocated", 2, 2, 2, "cuda"),
    ("llama3-8b-tp2-1p1d", "disaggregated", 2, 4, 2, "cuda"),
    ("llama3-8b-tp2-1gpu-1p1d", "disaggregated", 2, 4, 1, "cuda"),
])
def test_the_tp_configs(name: str, mode: str, tensor_parallel: int, num_ranks: int, num_gpus: int, device: str):
    config = Config.from_yaml(CONFIGS / f"{name}.yaml")
    inst = config.instances
    assert (config.mode, inst.num_ranks, inst.num_gpus, inst.device) == (mode, num_ranks, num_gpus, device)
    roles = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    assert {inst.tensor_parallel_of(role) for role in roles} == {tensor_parallel}


def test_the_tp_configs_pair_with_their_tp1_twins():
    """Each TP config runs the model of the TP=1 config its tokens are compared with."""
    tiny, tiny_tp = (Config.from_yaml(CONFIGS / f"{name}.yaml") for name in ("tiny-1p1d", "tiny-tp2-1p1d"))
    assert (tiny.model, tiny.cache, tiny.scheduler) == (tiny_tp.model, tiny_tp.cache, tiny_tp.scheduler)
    assert tiny_tp.transfer.backend == "shm"
    colo, disagg = (Config.from_yaml(CONFIGS / f"llama3-8b-tp2-{name}.yaml") for name in ("colocated", "1p1d"))
    assert colo.model == disagg.model == Config.from_yaml(CONFIGS / "llama3-8b-1p1d.yaml").model
    assert colo.bench.compare_with == str((CONFIGS / "llama3-8b-tp2-1p1d.yaml").resolve())
    assert disagg.bench.compare_with == str((CONFIGS / "llama3-8b-tp2-colocated.yaml").resolve())
    one_gpu = Config.from_yaml(CONFIGS / "llama3-8b-tp2-1gpu-1p1d.yaml")
    assert one_gpu.model.source == "dummy:llama3-8b" and one_gpu.model.num_layers < 32
