"""Decode pages come back as soon as no push can land in them, long before the lease (tiny-1p1d
on two CPU actors, router.lease_s = 60 s): a prompt the prefill engine refuses, an abort while
reserving, an abort or timeout before the prefill engine got the request, an abort after it
accepted it but computed nothing, and an abort mid-push, whose pages stay quarantined until the
prefill's pushes completed (`slow_fence_actor`: they look in flight for FENCE_S after the abort).
After every test, every page is free within FREE_S, which only an early release can do.
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import CONFIGS, BackgroundStream, launch_config, wait_all_free
from slow_fence_actor import FENCE_S, SlowFenceActor

from disagg.config import Config
from disagg.errors import RequestTimedOut
from disagg.sampling import SamplingParams

LEASE_S = 60.0
FREE_S = 3.0
PARAMS = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def cluster(ray_local):
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml").override({"router.lease_s": LEASE_S})
    cluster = launch_config(config, SlowFenceActor)
    yield cluster
    cluster.shutdown()


@pytest.fixture
def actors(cluster, ray_local):
    """(prefill, decode) actor handles; the prefill's steps run again after the test."""
    prefill, decode = (cluster.instance(name).actor for name in ("prefill-0", "decode-0"))
    yield prefill, decode
    ray_local.get([prefill.resume_steps.remote(), prefill.unstall.remote(), decode.unstall.remote()])
    wait_all_free(cluster, timeout_s=FREE_S)


def num_cancelled(cluster) -> int:
    return next(i for i in cluster.stats()["instances"] if i["name"] == "decode-0")["num_reservations_cancelled"]


def test_refused_prompt_frees_the_decode_pages_at_once(cluster, actors):
    before = num_cancelled(cluster)
    (done,) = cluster.generate([[3, 4, 10**6]], PARAMS)  # a token id outside the vocabulary
    assert done.finish_reason == "error" and "prompt_token_ids" in done.error, done
    wait_all_free(cluster, timeout_s=FREE_S)
    assert num_cancelled(cluster) == before + 1


def test_abort_while_reserving(cluster, actors, ray_local):
    _, decode = actors
    ray_local.get(decode.stall.remote(60.0))  # its reserve() waits behind the stall
    stream = BackgroundStream(cluster, list(range(3, 30)), PARAMS, request_id="res")
    _wait_until(lambda: cluster.router_stats()["stages"].get("reserving"))
    cluster.abort("res")
    ray_local.get(decode.unstall.remote())
    assert stream.result().finish_reason == "abort"
    wait_all_free(cluster, timeout_s=FREE_S)


@pytest.mark.parametrize("ending", ["abort", "timeout"])
def test_end_before_the_prefill_engine_got_it(cluster, actors, ray_local, ending):
    prefill, _ = actors
    router, saved = cluster._router, cluster._router.settings
    ray_local.get(prefill.stall.remote(60.0))  # its add() waits behind the stall
    if ending == "timeout":
        router.settings = saved.model_copy(update={"request_timeout_s": 1.0})
    try:
        stream = BackgroundStream(cluster, list(range(3, 40)), PARAMS, request_id=f"pre-{ending}")
        _wait_until(lambda: cluster.router_stats()["stages"].get("prefilling"))
        if ending == "abort":
            cluster.abort(f"pre-{ending}")
        last = stream.result()
    finally:
        router.settings = saved
    assert last.finish_reason == "abort"
    assert ending == "abort" or isinstance(last.cause, RequestTimedOut)
    ray_local.get(prefill.unstall.remote())  # then add, then abort: nothing was pushed
    wait_all_free(cluster, timeout_s=FREE_S)


def test_abort_after_the_prefill_engine_accepted_it(cluster, actors, ray_local):
    prefill, _ = actors
    ray_local.get(prefill.pause_steps.remote(0))  # it takes requests but computes nothing
    before = num_cancelled(cluster)
    stream = BackgroundStream(cluster, list(range(3, 40)), PARAMS, request_id="accepted")
    _wait_until(lambda: ray_local.get(prefill.stats.remote())["waiting"] == 1)
    cluster.abort("accepted")
    assert stream.result().finish_reason == "abort"
    wait_all_free(cluster, timeout_s=FREE_S)  # with the prefill's steps still paused
    assert num_cancelled(cluster) == before + 1


def test_abort_mid_push_frees_once_the_pushes_completed(cluster, actors, ray_local):
    prefill, decode = actors
    ray_local.get(prefill.pause_steps.remote(1))  # one forward: 256 of the prompt's 600 tokens
    pushed = ray_local.get(prefill.stats.remote())["pushed_bytes"]
    stream = BackgroundStream(cluster, [3 + i % 200 for i in range(600)], PARAMS, request_id="mid")
    _wait_until(lambda: ray_local.get(prefill.stats.remote())["pushed_bytes"] > pushed)
    aborted = time.monotonic()
    cluster.abort("mid")
    assert stream.result().finish_reason == "abort"
    _wait_until(lambda: ray_local.get(prefill.stats.remote())["quiescing"] == 1)
    ray_local.get(prefill.resume_steps.remote())
    stats = ray_local.get(decode.stats.remote())
    assert time.monotonic() - aborted < FENCE_S, "the check below must run while the fence is in flight"
    assert stats["quarantined"] == 1 and stats["free_pages"] < stats["total_pages"]  # a push may land
    wait_all_free(cluster, timeout_s=FREE_S)
    assert time.monotonic() - aborted >= FENCE_S  # freed only after the prefill's fence completed


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
