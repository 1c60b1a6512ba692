"""`router.request_timeout_s` on tensor-parallel instances: tiny-tp2-1p1d.yaml (prefill and decode
at two ranks each, CPU actors over gloo and the shm heap), one launch.

A request that runs past its deadline ends with finish_reason "abort" and a `RequestTimedOut`
naming the limit and the stage it was in -- before its prefill began (the prefill leader's loop
holds, its add queued behind), mid-push (the prefill leader holds its forward after the first
layer went out) or decoding (the decode leader's loop holds, as a slow instance's would) -- and
afterwards every page is free on every rank of both instances, read off each rank's own engine:
the abort reached the followers, the decode ranks' reservations were cancelled (at once, not by
their leases) or their quarantine ended, and the pushed pages went.
"""

from __future__ import annotations

import contextlib
import time

import pytest
from cluster_helpers import BackgroundStream, every_rank_free, launch, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.errors import RequestTimedOut
from disagg.sampling import SamplingParams

LEASE_S = 10.0  # long enough that no reservation here ends by its lease
TIMEOUT_S = 1.0
DECODE_TIMEOUT_S = 3.0
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def cluster(ray_local):
    cluster = launch("tiny-tp2-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False)
    yield cluster
    cluster.shutdown()


@pytest.fixture(autouse=True)
def every_page_free_after(cluster, ray_local):
    yield
    dead = [(inst.name, inst.error) for inst in cluster.fleet.instances if not inst.alive]
    assert not dead, f"an instance died (every_rank_free reads live ones only): {dead}"
    wait_all_free(cluster, timeout_s=LEASE_S + 15)
    every_rank_free(cluster, ray_local, timeout_s=30)


@contextlib.contextmanager
def request_timeout(cluster, seconds: float):
    """Requests submitted in the block get ``router.request_timeout_s = seconds``."""
    router = cluster._router
    saved = router.settings
    router.settings = saved.model_copy(update={"request_timeout_s": seconds})
    try:
        yield
    finally:
        router.settings = saved


def assert_timed_out(last, stage: str, timeout_s: float = TIMEOUT_S) -> None:
    assert last.finish_reason == "abort", last
    assert f"timed out after {timeout_s} s (router.request_timeout_s) while {stage}" in last.error, last.error
    assert isinstance(last.cause, RequestTimedOut), last.cause
    assert (last.cause.timeout_s, last.cause.stage) == (timeout_s, stage)


def test_a_request_timed_out_before_its_prefill_began_frees_every_decode_rank_s_reservation(cluster, ray_local):
    prefill = cluster.instance("prefill-0").actor
    before = cluster.router_stats()["aborts"].get("request_timed_out", 0)
    ray_local.get(prefill.stall.remote(30.0))  # the leader's loop holds: the request's add waits behind it
    try:
        with request_timeout(cluster, TIMEOUT_S):
            last = BackgroundStream(cluster, PROMPT, SamplingParams(max_tokens=8), request_id="unprefilled").result()
    finally:
        ray_local.get(prefill.unstall.remote())  # then its add and abort run on both ranks: nothing pushed
    assert_timed_out(last, "prefilling")
    assert last.token_ids == []
    assert cluster.router_stats()["aborts"]["request_timed_out"] == before + 1
    # The prefill side answers QUIESCED, so the router cancels the reservation on every decode
    # rank at once, well before any rank's lease could have ended it; and nobody died of it.
    every_rank_free(cluster, ray_local, timeout_s=LEASE_S / 2)
    assert all(inst.alive for inst in cluster.fleet.instances)


def test_a_request_timed_out_mid_push_frees_every_rank_once_the_push_went_on(cluster, ray_local):
    prefill = cluster.instance("prefill-0").actor
    ray_local.get(prefill.hold_push.remote(30.0))  # the leader holds after layer 0; rank 1 waits on it
    try:
        with request_timeout(cluster, TIMEOUT_S):
            stream = BackgroundStream(cluster, PROMPT, SamplingParams(max_tokens=8), request_id="mid-push")
            assert ray_local.get(prefill.wait_push_held.remote(30.0)), "the prompt's forward never held"
            last = stream.result()
    finally:
        ray_local.get(prefill.release_push.remote())
    assert_timed_out(last, "prefilling")


def test_a_request_timed_out_while_decoding_frees_every_rank(cluster, ray_local):
    decode = cluster.instance("decode-0").actor
    with request_timeout(cluster, DECODE_TIMEOUT_S):  # long enough to reach decoding on a busy machine
        stream = BackgroundStream(cluster, PROMPT, SamplingParams(max_tokens=4000, ignore_eos=True),
                                  request_id="decoding")
        assert stream.started.wait(30), "no token came"
        # The leader's loop holds (a slow instance): no pass reaches its follower, nobody steps.
        ray_local.get(decode.stall.remote(30.0))
        try:
            last = stream.result()
        finally:
            ray_local.get(decode.unstall.remote())
    assert_timed_out(last, "decoding", DECODE_TIMEOUT_S)
    assert 1 <= len(stream.token_ids) < 4000
