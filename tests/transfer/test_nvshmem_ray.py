"""The same scenarios over NVSHMEM: one heap across two Ray actors (one GPU each, or both on one GPU).

Run on a GPU host (after ``source .whl/gpu-env.sh``): ``python3 -m pytest -m multigpu tests/transfer``.
With two GPUs on one NVLink domain the actors get one each; with one GPU they share it as two PEs
(NVSHMEM's limited multi-process mode), which exercises the same code paths. Both the peer-store path (fused append+push into
the peer's pages) and the forced segment-put path (``putmem_on_stream`` per run) are covered.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.multigpu

GEOMETRY = dict(num_layers=4, num_pages=1536, num_kv_heads=8, page_size=16, head_dim=128)
TIMEOUT_S = 120.0
HEAP_BYTES = 1 << 30
# Every GPU process keeps NVLink multicast off (docs/ARCHITECTURE.md §8).
GPU_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@pytest.fixture(scope="module")
def actors(gpu_share):
    """Two actors with one NVSHMEM heap between them (rank 0 sends, rank 1 receives)."""
    ray = pytest.importorskip("ray")
    import transfer_scenarios

    here = str(Path(__file__).parent)
    env = dict(GPU_ENV, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    ray.init(num_gpus=gpu_share.ray_num_gpus, include_dashboard=False, runtime_env={"env_vars": env})
    runner = ray.remote(num_gpus=gpu_share.per_actor)(transfer_scenarios.ScenarioRunner)
    pair = [runner.remote() for _ in range(2)]
    uid = ray.get(pair[0].new_uid.remote("nvshmem", HEAP_BYTES), timeout=TIMEOUT_S)
    setups = ray.get([a.run.remote("setup", dict(backend="nvshmem", uid=uid, rank=r, world_size=2,
                                                 geometry=GEOMETRY, dtype="bfloat16", size_bytes=HEAP_BYTES))
                      for r, a in enumerate(pair)], timeout=TIMEOUT_S)
    assert setups[0]["reachable"] == [True, True], "the peer-store path needs load/store peers (NVLink or one GPU)"
    yield ray, pair
    ray.get([a.run.remote("teardown", {}) for a in pair], timeout=TIMEOUT_S)
    ray.shutdown()


def step(actors, rank: int, name: str, **kwargs):
    ray, pair = actors
    return ray.get(pair[rank].run.remote(name, kwargs), timeout=TIMEOUT_S)


def send(actors, receiver_reqs: list[dict], sender_reqs: list[dict], ring: bool = True) -> None:
    got = step(actors, 1, "prepare_recv", requests=receiver_reqs)
    requests = [dict(req, pe=1, **got[req["request_id"]]) for req in sender_reqs]
    step(actors, 0, "prefill", requests=requests, ring=ring)


MODES = {"fused": {}, "caller-stream-append": {"append_on_caller_stream": True},
         "segment-puts": {"force_segment_puts": True}}


@pytest.mark.parametrize("mode", list(MODES))
def test_prefill_push_lands_bit_exact(actors, mode):
    step(actors, 0, "use_pusher", **MODES[mode])
    rid = 100 + list(MODES).index(mode)
    send(actors, [dict(request_id=rid, seq_id=rid, length=1000)],
         [dict(request_id=rid, seq_id=rid, prompt_len=1000)])
    result = step(actors, 1, "check_received", begins={rid: 0})
    assert result["equal"], result


@pytest.mark.parametrize("force_segment_puts", [False, True], ids=["peer-store", "segment-puts"])
def test_existing_kv_goes_page_to_page(actors, force_segment_puts):
    step(actors, 0, "use_segment_puts", force=force_segment_puts)
    rid = 200 + int(force_segment_puts)
    send(actors, [dict(request_id=rid, seq_id=rid, length=700 - 123)],
         [dict(request_id=rid, seq_id=rid, prompt_len=700, local_len=300, begin=123)])
    result = step(actors, 1, "check_received", begins={rid: 123})
    assert result["equal"], result


def test_doorbell_is_not_rung_before_end_forward(actors):
    step(actors, 0, "use_segment_puts", force=False)
    send(actors, [dict(request_id=300, seq_id=300, length=64)],
         [dict(request_id=300, seq_id=300, prompt_len=64)], ring=False)
    assert step(actors, 1, "is_rung", request_id=300) is False
    step(actors, 0, "finish_forward")
    result = step(actors, 1, "check_received", begins={300: 0})
    assert result["equal"], result


@pytest.mark.parametrize("mode", list(MODES))
def test_doorbell_rings_only_after_the_last_write(actors, mode):
    """The receiver spins on the doorbell (host poll of the signal word) while the sender pushes
    large pages, pausing after every layer, and the moment it sees the ring compares every layer
    of its slots on the GPU (a device-side read after the wait): all must have landed."""
    ray, pair = actors
    step(actors, 0, "use_pusher", **MODES[mode])
    for attempt in range(3):
        rid = 310 + 10 * list(MODES).index(mode) + attempt
        got = step(actors, 1, "prepare_recv", requests=[dict(request_id=rid, seq_id=rid, length=600)])
        request = dict(request_id=rid, seq_id=rid, prompt_len=600, pe=1, **got[rid])
        watch = pair[1].run.remote("ring_race", dict(role="watch", request_id=rid))
        sent = pair[0].run.remote("ring_race", dict(role="send", requests=[request], layer_delay_s=0.05))
        result, _ = ray.get([watch, sent], timeout=TIMEOUT_S)
        assert result == {"rung": True, "layers_wrong_at_ring": []}, result


def test_wait_times_out_with_request_and_pes(actors):
    step(actors, 1, "prepare_recv", requests=[dict(request_id=400, seq_id=400, length=5)])
    error = step(actors, 1, "wait_error", request_id=400, timeout_s=0.2)
    assert error["type"] == "SignalTimeout" and error["request_id"] == 400 and error["dst_pe"] == 1


def test_sender_cache_holds_exactly_its_prompts(actors):
    """Self-contained: a prompt of its own (part of it local, then page to page and pushed); the
    sender's KV then equals its set-up snapshot except at its sequences' slots, bit for bit."""
    step(actors, 0, "use_segment_puts", force=False)
    send(actors, [dict(request_id=500, seq_id=500, length=400 - 50)],
         [dict(request_id=500, seq_id=500, prompt_len=400, local_len=100, begin=50)])
    assert step(actors, 1, "check_received", begins={500: 50})["equal"]
    assert step(actors, 0, "sender_unchanged_outside") is True
