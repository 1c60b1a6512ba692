"""The uneven four-instance splits on CPU actors: 1P3D and 3P1D (tiny-2p2d.yaml with --set counts).

tests/cluster/test_cluster_2p2d.py covers 2P2D (parity, a killed prefill, a killed decode). Here
each uneven split must give the tokens of an in-process colocated engine, use every instance and
end with every page free. On 3P1D a prefill actor is then killed while it holds requests: those
migrate to the other prefill instances and finish with the colocated tokens like the rest, and
the pages the lone decode instance first reserved for them (the router aborts them there on the
death; the decode quarantines them until their lease closes, as a sender's write may still be in
flight) come back.
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

LEASE_S = 2.0


def launch_split(num_prefill: int, num_decode: int):
    return launch("tiny-2p2d", HookedInstanceActor, router__lease_s=LEASE_S, instances__prefill=num_prefill,
                  instances__decode=num_decode)


def check_parity_and_spread(cluster, num_prefill: int, num_decode: int) -> None:
    """16 mixed prompts equal the colocated reference, every instance serves some, pages all free."""
    stats = cluster.stats()
    names = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
    assert [(i["name"], i["pe"]) for i in stats["instances"]] == [(n, pe) for pe, n in enumerate(names)]
    assert set(stats["paths"]) == {f"{p}->{d}" for p in range(num_prefill)
                                   for d in range(num_prefill, num_prefill + num_decode)}
    prompts = mixed_prompts(16, seed=3)
    max_tokens = [4, 24, 1, 12] * 4
    got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    assert [c.error for c in got] == [None] * 16
    assert [c.token_ids for c in got] == reference_tokens(prompts, max_tokens)
    assert {c.metrics.prefill_instance for c in got} == set(names[:num_prefill])
    assert {c.metrics.decode_instance for c in got} == set(names[num_prefill:])
    wait_all_free(cluster)


def test_1p3d_parity_every_decode_used_pages_free(ray_local):
    with launch_split(1, 3) as cluster:
        check_parity_and_spread(cluster, 1, 3)


def test_3p1d_parity_then_killed_prefill_frees_the_decode_pages_it_held(ray_local):
    with launch_split(3, 1) as cluster:
        check_parity_and_spread(cluster, 3, 1)
        victim = cluster.instance("prefill-1")
        ray_local.get(victim.actor.drop_next.remote(2))  # what reaches prefill-1 stays there
        prompts = mixed_prompts(9, seed=4)
        streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
        _wait_until(lambda: _only_stuck_left(cluster, streams, ray_local.get(victim.actor.num_dropped.remote())))
        num_stuck = cluster.router_stats()["live"]
        decode = _instance_stats(cluster, "decode-0")
        assert decode["leases"] == num_stuck and decode["free_pages"] < decode["total_pages"], decode

        ray_local.kill(victim.actor, no_restart=True)
        want = reference_tokens(prompts, [10] * len(prompts))
        for stream, tokens in zip(streams, want):  # the stuck ones migrated to the other prefill instances
            last = stream.result()
            assert (last.finish_reason, last.error, stream.token_ids) == ("length", None, tokens), last
        assert cluster.router_stats()["counts"]["migrated"] == num_stuck
        stats = wait_all_free(cluster, timeout_s=LEASE_S + 20)  # the decode's reservations came back
        assert [i["name"] for i in stats["instances"] if not i["alive"]] == ["prefill-1"]
        assert cluster.healthy
        after = cluster.generate(prompts[:4], SamplingParams(max_tokens=10, ignore_eos=True))
        assert [c.token_ids for c in after] == want[:4]
        assert "prefill-1" not in {c.metrics.prefill_instance for c in after}
        wait_all_free(cluster)


def _only_stuck_left(cluster, streams, num_dropped: int) -> bool:
    """Every request not held by the dropping prefill has finished; at least one is held (the
    live ones are the dropped ones: with every request dispatched at once, all of them are
    "prefilling" for a moment before any has finished)."""
    router = cluster.router_stats()
    num_done = sum(stream.done.is_set() for stream in streams)
    return router["live"] >= 1 and router["stages"] == {"prefilling": router["live"]} and \
        num_done + router["live"] == len(streams) and router["live"] == num_dropped


def _instance_stats(cluster, name: str) -> dict:
    return next(i for i in cluster.stats()["instances"] if i["name"] == name)


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
