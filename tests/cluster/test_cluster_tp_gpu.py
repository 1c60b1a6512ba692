"""Tensor-parallel instances over NVSHMEM on one GPU: llama3-8b-tp2-1gpu-1p1d.yaml (two layers,
float32) against one unsharded colocated instance of the same weights.

Four ranks share GPU 0 (four PEs of one heap, NVSHMEM's limited multi-process mode) and each
instance's two ranks all-reduce over gloo (NCCL refuses two ranks on one device), so the decode
CUDA graphs are off. Prefill rank i pushes its KV head group into decode rank i's pages. Run on a
GPU host from the project root (after ``source .whl/gpu-env.sh``): ``python3 -m pytest -q -m
multigpu tests/cluster/test_cluster_tp_gpu.py``. The ranks time-slice the GPU: correctness only.
The second test runs the prefill side at TP 1 and the decode side at TP 2 (three PEs).
"""

from __future__ import annotations

import random

import pytest
from cluster_helpers import CONFIGS, every_rank_free, launch_config, wait_all_free

from disagg.config import Config
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.multigpu

OVERRIDES = {"model.num_layers": 2, "model.dtype": "float32", "cache.num_pages": 1024,
             "scheduler.max_num_batched_tokens": 512, "router.lease_s": 120.0}


def workload(num: int = 24, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 511, 513, 1500] + [rng.randint(1, 1200) for _ in range(num - 7)]
    prompts = [[rng.randrange(10, 128000) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=rng.choice([1, 2, 16, 48]), ignore_eos=True) for _ in lengths]
    return prompts, params


def equals_one_unsharded_colocated_instance(ray_local, config: Config, pes: list[list[int]], seed: int, what: str):
    """``config``'s fleet serves the workload with every page free afterwards on every rank, and
    its tokens equal one colocated TP=1 instance's of the same weights on the same GPU."""
    prompts, params = workload(seed=seed)
    with launch_config(config) as cluster:
        stats = cluster.stats()
        assert (stats["device"], stats["backend"]) == ("cuda", "nvshmem")
        assert [[r["pe"] for r in inst["ranks"]] for inst in stats["instances"]] == pes
        sharded = cluster.generate(prompts, params)
        assert all(c.error is None for c in sharded), [c.error for c in sharded if c.error][:3]
        wait_all_free(cluster)
        every_rank_free(cluster, ray_local)
    twin = config.override({"instances.prefill": 0, "instances.decode": 0, "instances.colocated": 1,
                            "instances.tensor_parallel": 1, "transfer.backend": "auto"})
    with launch_config(twin) as cluster:
        whole = cluster.generate(prompts, params)
    mismatched = [i for i, (a, b) in enumerate(zip(sharded, whole)) if a.token_ids != b.token_ids]
    assert not mismatched, f"requests {mismatched} differ between {what} and TP=1 colocated"


def test_tp2_1p1d_over_nvshmem_equals_one_unsharded_colocated_instance(ray_local):
    config = Config.from_yaml(CONFIGS / "llama3-8b-tp2-1gpu-1p1d.yaml").override(OVERRIDES)
    equals_one_unsharded_colocated_instance(ray_local, config, [[0, 1], [2, 3]], seed=0, what="TP=2 1P1D")


def test_prefill_tp1_into_decode_tp2_over_nvshmem_equals_one_unsharded_colocated_instance(ray_local):
    """Three PEs on GPU 0: the prefill instance's one rank writes head group [0, 4) of each page into
    decode rank 0's pages and [4, 8) into decode rank 1's (llama3-8b: 8 KV heads), by segment puts
    of each page's head range (`transfer.heads`); the tokens equal an unsharded colocated engine's."""
    config = Config.from_yaml(CONFIGS / "llama3-8b-tp2-1gpu-1p1d.yaml").override(
        dict(OVERRIDES, **{"instances.tensor_parallel": {"prefill": 1, "decode": 2}}))
    equals_one_unsharded_colocated_instance(ray_local, config, [[0], [1, 2]], seed=1, what="P TP1 + D TP2")
