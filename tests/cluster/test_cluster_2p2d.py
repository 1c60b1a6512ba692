"""tiny-2p2d.yaml on four CPU actors: xPyD parity, then a killed prefill and a killed decode actor.

The tests run in file order on one launch: parity with both sides whole, then prefill-0 is
killed (its requests migrate to the survivors, `disagg.cluster.routing.migration`: every request
finishes with the colocated tokens), then decode-0 (likewise, mid-decode: the streams go on
without a token repeated or lost). After each, every surviving instance's pages are all free.
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.sampling import SamplingParams

LEASE_S = 2.0


@pytest.fixture(scope="module")
def cluster(ray_local):
    cluster = launch("tiny-2p2d", HookedInstanceActor, router__lease_s=LEASE_S)
    yield cluster
    cluster.shutdown()


def test_xpyd_parity_and_both_sides_used(cluster):
    stats = cluster.stats()
    assert [(i["name"], i["pe"]) for i in stats["instances"]] == [
        ("prefill-0", 0), ("prefill-1", 1), ("decode-0", 2), ("decode-1", 3)]
    assert set(stats["paths"]) == {"0->2", "0->3", "1->2", "1->3"}
    prompts = mixed_prompts(16, seed=3)
    max_tokens = [4, 24, 1, 12] * 4
    got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    assert [c.token_ids for c in got] == reference_tokens(prompts, max_tokens)
    assert {c.metrics.prefill_instance for c in got} == {"prefill-0", "prefill-1"}
    assert {c.metrics.decode_instance for c in got} == {"decode-0", "decode-1"}
    wait_all_free(cluster)



def test_a_shared_prefix_follows_its_instances(cluster):
    """The router sends requests sharing a 64-token system prompt to the prefill and decode
    instances it sent the first one to (cluster/routing/affinity.py), where their pages are cached: each
    later one finds the four whole pages on both sides. Without the affinity the idle fleet's
    instances take turns and half the hits are lost."""
    import random

    rng = random.Random(11)
    system = [rng.randrange(3, 256) for _ in range(64)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(6)] for _ in range(4)]
    want = reference_tokens(prompts, [3] * 4)

    def hits() -> dict:
        return {i["name"]: i["prefix_hit_tokens"] for i in cluster.stats()["instances"]}
    before = hits()
    got = [cluster.generate([p], SamplingParams(max_tokens=3))[0] for p in prompts]
    assert [c.token_ids for c in got] == want
    pairs = {(c.metrics.prefill_instance, c.metrics.decode_instance) for c in got}
    assert len(pairs) == 1, pairs
    (prefill, decode), after = next(iter(pairs)), hits()
    assert after[prefill] - before[prefill] == after[decode] - before[decode] == 3 * 64
    assert cluster.router_stats()["affinity_hits"] >= 6
    wait_all_free(cluster)

def test_killed_prefill_actor_migrates_its_requests_and_every_one_finishes(cluster, ray_local):
    victim = cluster.instance("prefill-0")
    ray_local.get(victim.actor.drop_next.remote(2))  # what reaches prefill-0 stays there
    prompts = mixed_prompts(6, seed=4)
    streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    _wait_until(lambda: cluster.router_stats()["stages"].get("prefilling", 0) >= 1)
    ray_local.kill(victim.actor, no_restart=True)
    want = reference_tokens(prompts, [10] * 6)
    for stream, tokens in zip(streams, want):
        last = stream.result()
        assert (last.finish_reason, last.error, stream.token_ids) == ("length", None, tokens), last
    assert cluster.router_stats()["counts"]["migrated"] >= 1
    assert cluster.healthy and not victim.alive  # degraded, but every role still has a live instance
    stats = wait_all_free(cluster, timeout_s=LEASE_S + 20)
    dead = [i for i in stats["instances"] if not i["alive"]]
    assert [i["name"] for i in dead] == ["prefill-0"] and "died" in dead[0]["error"]
    after = cluster.generate(prompts[:3], SamplingParams(max_tokens=10, ignore_eos=True))
    assert [c.token_ids for c in after] == want[:3]
    assert {c.metrics.prefill_instance for c in after} == {"prefill-1"}


def test_killed_decode_actor_migrates_its_requests_and_every_one_finishes(cluster, ray_local):
    prompts = mixed_prompts(4, seed=5)
    streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in prompts]
    for stream in streams:
        stream.started.wait(60)
    victim = cluster.instance("decode-0")
    migrated = cluster.router_stats()["counts"].get("migrated", 0)
    ray_local.kill(victim.actor, no_restart=True)
    want = reference_tokens(prompts, [200] * 4)
    for stream, tokens in zip(streams, want):
        last = stream.result()
        assert (last.finish_reason, last.error, stream.token_ids) == ("length", None, tokens), last
    assert cluster.router_stats()["counts"]["migrated"] > migrated  # decode-0 held some of them
    assert cluster.router_stats()["failures"] == {}
    wait_all_free(cluster, timeout_s=LEASE_S + 20)
    assert cluster.healthy and [i["name"] for i in cluster.stats()["instances"] if not i["alive"]] == [
        "prefill-0", "decode-0"]
    after = cluster.generate(prompts[:2], SamplingParams(max_tokens=5, ignore_eos=True))
    assert {c.metrics.decode_instance for c in after} == {"decode-1"}
    assert [c.token_ids for c in after] == [t[:5] for t in want[:2]]
    wait_all_free(cluster)


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
