"""A Llama-3-8B-shaped fleet (2 layers, float32) over NVSHMEM vs its colocated twin.

Run on a GPU host from the project root (after ``source .whl/gpu-env.sh``):
``python3 -m pytest -q -m multigpu tests/cluster/test_cluster_gpu.py``. Two GPUs on one NVLink
domain give each instance its own; one GPU is shared by both (``instances.gpus_per_instance:
0.5``), which runs the same NVSHMEM path.
float32 keeps greedy tokens off near ties, so the disaggregated and colocated fleets (same
kernels, different batches) must agree exactly. Prefill chunks of 512 tokens stretch a long
prompt's push over many forwards, so aborts right after submission land mid-push.
"""

from __future__ import annotations

import random
import time

import pytest
from cluster_helpers import CONFIGS, BackgroundStream, force_paths, launch_config, wait_all_free

from disagg.cluster import Cluster
from disagg.config import Config
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.multigpu

# Generous: a prefill forward of a shape not seen before compiles Triton kernels (1-10 s on an H200).
LEASE_S = 60.0
OVERRIDES = {"model.num_layers": 2, "model.dtype": "float32", "cache.num_pages": 4096,
             "scheduler.max_num_batched_tokens": 512, "router.lease_s": LEASE_S}


def workload(num: int = 64, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 511, 512, 513, 2000] + [rng.randint(1, 1500) for _ in range(num - 8)]
    prompts = [[rng.randrange(10, 128000) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=rng.choice([1, 2, 16, 64]), ignore_eos=True) for _ in lengths]
    return prompts, params


def launch(name: str, share, **overrides) -> Cluster:
    config = Config.from_yaml(CONFIGS / f"{name}.yaml").override({**OVERRIDES, **share.config_overrides,
                                                                   **overrides})
    return launch_config(config)


def test_llama3_shaped_1p1d_over_nvshmem_equals_colocated_and_aborts_mid_push(ray_local, gpu_share):
    """1P1D equals colocated with the decode instance answering reservations mid-forward
    (`scheduler.overlap_reservations`, the default; the placements test below runs it off), and
    aborts mid-push free every page."""
    prompts, params = workload()
    with launch("llama3-8b-1p1d", gpu_share, **{"scheduler.overlap_reservations": True}) as cluster:
        stats = cluster.stats()
        assert (stats["device"], stats["backend"], stats["paths"]) == ("cuda", "nvshmem", {"0->1": "load/store"})
        disagg = cluster.generate(prompts, params)
        assert all(c.error is None for c in disagg), [c.error for c in disagg if c.error][:3]
        decode = next(i for i in cluster.stats()["instances"] if i["role"] == "decode")
        assert decode["overlaps_reservations"], decode
        print(f"reservations answered mid-forward: {decode['num_mid_step_calls']} of {len(prompts)}")
        wait_all_free(cluster)

        long = [[(7 * i + j) % 120000 + 10 for j in range(6000)] for i in range(6)]
        streams = []
        for i, prompt in enumerate(long):
            streams.append(BackgroundStream(cluster, prompt, SamplingParams(max_tokens=32, ignore_eos=True),
                                            request_id=f"long{i}"))
            time.sleep(0.005 * i)
            cluster.abort(f"long{i}")
        ends = [s.result(120) for s in streams]
        assert all(e.finish_reason in ("abort", "length") for e in ends), ends
        assert any(not s.token_ids for s in streams), "no abort landed before the first token"
        wait_all_free(cluster, timeout_s=20.0)  # long before the lease: P answers each abort once quiesced
    with launch("llama3-8b-colocated", gpu_share) as cluster:
        colocated = cluster.generate(prompts, params)
        wait_all_free(cluster)
    mismatched = [_divergence(i, prompts[i], a.token_ids, b.token_ids)
                  for i, (a, b) in enumerate(zip(disagg, colocated)) if a.token_ids != b.token_ids]
    assert not mismatched, f"{len(mismatched)} of 64 differ: {mismatched[:5]}"
    assert [len(c.token_ids) for c in disagg] == [p.max_tokens for p in params]


def test_llama3_shaped_placements_over_nvshmem_equal_colocated(ray_local, gpu_share, monkeypatch):
    """Adaptive placement, first forced through remote / local / kept in turn (local prefill beside
    CUDA-graph decodes on D; a prefill instance decoding), then deciding on its own from the
    step times it measured: every token equals the colocated fleet's, every page comes back."""
    prompts, params = workload(48, seed=3)
    with launch("llama3-8b-1p1d", gpu_share, **{"router.placement": "adaptive",
                                                "scheduler.overlap_reservations": False}) as cluster:
        with monkeypatch.context() as patch:
            force_paths(cluster, patch, ["remote", "local", "kept"])
            forced = cluster.generate(prompts[:24], params[:24])
        decided = cluster.generate(prompts[24:], params[24:])
        stats = cluster.router_stats()
        instances = {i["name"]: i for i in cluster.stats()["instances"]}
        wait_all_free(cluster)
    # The prefill instance decodes its kept requests with CUDA graphs (adaptive placement), as D does.
    assert instances["prefill-0"]["num_graph_replays"] > 0, instances["prefill-0"]
    # Its short remote prompts (<= 512 tokens) ran as whole-forward graphs and pushed after them
    # (`transfer.push_after: graphs`); the longer ones layer by layer: both paths equal colocated.
    assert instances["prefill-0"]["num_pushes_after"] > 0, instances["prefill-0"]
    placed = stats["placements"]
    assert placed["remote"] >= 8 and placed["local"] >= 8 and placed["kept"] >= 8, placed
    models = stats["placement"]["models"]
    assert all(m["num_samples"] > 0 for m in models.values()), models
    # every instance computed first tokens (remote, kept; local): the router timed their way back
    assert all(m["relay_ms"] > 0 for m in models.values()), models
    got = forced + decided
    assert all(c.error is None for c in got), [c.error for c in got if c.error][:3]
    with launch("llama3-8b-colocated", gpu_share) as cluster:
        colocated = cluster.generate(prompts, params)
    mismatched = [_divergence(i, prompts[i], a.token_ids, b.token_ids)
                  for i, (a, b) in enumerate(zip(got, colocated)) if a.token_ids != b.token_ids]
    assert not mismatched, f"{len(mismatched)} of {len(prompts)} differ: {mismatched[:5]}; placements {placed}"


def _divergence(index: int, prompt: list[int], disagg: list[int], colocated: list[int]) -> dict:
    """Where two token lists part: the request, its prompt length, the first differing step."""
    step = next(j for j in range(max(len(disagg), len(colocated)))
                if j >= min(len(disagg), len(colocated)) or disagg[j] != colocated[j])
    return {"request": index, "prompt_len": len(prompt), "tokens": (len(disagg), len(colocated)),
            "step": step, "disagg": disagg[step:step + 3], "colocated": colocated[step:step + 3]}
