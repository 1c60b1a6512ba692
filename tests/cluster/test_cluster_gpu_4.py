"""Four GPUs: llama3-8b-2p2d.yaml (2 layers, float32) over NVSHMEM vs four colocated instances.

Run on a host with four GPUs on one NVLink domain, from the project root (after
``source .whl/gpu-env.sh``): ``python3 -m pytest -q -m multigpu tests/cluster/test_cluster_gpu_4.py``
(benchmarks/records/runbooks/FOURGPU.md gives the device command). Every prefill instance pushes into every
decode instance; the tokens must equal the colocated fleet's (float32 keeps greedy tokens off near
ties), and every page must be free at the end. Then prefill-0 is killed while it holds requests:
those migrate to prefill-1 (`disagg.cluster.routing.migration`) and finish with the colocated
tokens like the rest, and the decode pages first reserved for them come back (the router aborts
them on the death; the decode instance frees them when their lease closes).
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import CONFIGS, BackgroundStream, launch_config, wait_all_free
from hooked_actor import HookedInstanceActor
from test_cluster_gpu import workload

from disagg.cluster import Cluster
from disagg.config import Config
from disagg.sampling import SamplingParams


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(_num_gpus() < 4, reason=f"needs 4 CUDA GPUs; {_num_gpus()} visible")]

LEASE_S = 20.0  # generous for a first-seen prefill shape's compile; the kill test waits it out once
OVERRIDES = {"model.num_layers": 2, "model.dtype": "float32", "cache.num_pages": 4096,
             "scheduler.max_num_batched_tokens": 512, "router.lease_s": LEASE_S}


def launch(name: str) -> Cluster:
    config = Config.from_yaml(CONFIGS / f"{name}.yaml").override(OVERRIDES)
    return launch_config(config, HookedInstanceActor)  # drop_next in check_killed_prefill


def test_llama3_shaped_2p2d_equals_colocated_4_and_survives_a_killed_prefill(ray_local):
    prompts, params = workload()
    with launch("llama3-8b-colocated-4") as cluster:
        colocated = cluster.generate(prompts, params)
        assert all(c.error is None for c in colocated), [c.error for c in colocated if c.error][:3]
        wait_all_free(cluster)
    with launch("llama3-8b-2p2d") as cluster:
        stats = cluster.stats()
        assert (stats["device"], stats["backend"]) == ("cuda", "nvshmem")
        assert stats["paths"] == {f"{p}->{d}": "load/store" for p in (0, 1) for d in (2, 3)}
        disagg = cluster.generate(prompts, params)
        assert all(c.error is None for c in disagg), [c.error for c in disagg if c.error][:3]
        assert {c.metrics.prefill_instance for c in disagg} == {"prefill-0", "prefill-1"}
        assert {c.metrics.decode_instance for c in disagg} == {"decode-0", "decode-1"}
        wait_all_free(cluster)
        mismatched = [i for i, (a, b) in enumerate(zip(disagg, colocated)) if a.token_ids != b.token_ids]
        assert not mismatched, f"{len(mismatched)} of {len(prompts)} differ, first: {mismatched[:5]}"
        assert [len(c.token_ids) for c in disagg] == [p.max_tokens for p in params]
        check_killed_prefill(cluster, ray_local, prompts[:12], colocated[:12])


def check_killed_prefill(cluster, ray, prompts, reference) -> None:
    """prefill-0 keeps what reaches it, dies; its requests migrate, and every one finishes exactly."""
    victim = cluster.instance("prefill-0")
    ray.get(victim.actor.drop_next.remote(2))
    max_tokens = [len(c.token_ids) for c in reference]
    streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, max_tokens)]
    deadline = time.monotonic() + 60
    while not cluster.router_stats()["loads"].get("prefill-0"):  # it holds a request; others run on
        assert time.monotonic() < deadline, "no request reached prefill-0"
        time.sleep(0.01)
    ray.kill(victim.actor, no_restart=True)
    for stream, want in zip(streams, reference):
        last = stream.result(120)
        assert (last.finish_reason, last.error, stream.token_ids) == ("length", None, want.token_ids), last
    assert 1 <= cluster.router_stats()["counts"]["migrated"] < len(prompts)
    stats = wait_all_free(cluster, timeout_s=LEASE_S + 30)
    assert [i["name"] for i in stats["instances"] if not i["alive"]] == ["prefill-0"] and cluster.healthy
