"""Replacing a dead instance (`cluster.restart`) on tiny-1p1d and tiny-tp2-1p1d (CPU actors).

A killed instance is replaced by a new actor named after it (``prefill-0`` -> ``prefill-0r1``) in
its share of the machine; the replacement is no PE of the heap, so it serves as a colocated
instance: it computes and decodes its own requests, beside the survivors, with tokens equal to an
in-process colocated engine's (greedy). Requests that arrive while nothing can serve wait for the
replacement instead of failing; `cluster.restart_limit` bounds the replacements of one instance;
``cluster.restart: false`` leaves the fleet degraded. The time from the kill to the replacement
serving is printed (``-s``) and kept in the router's ``restarts`` snapshot. The rebuild of the
whole fleet (`cluster.rebuild`) waits ``cluster.rebuild_after_s`` (60 s), past each test's end:
tests/cluster/test_rebuild.py covers it.
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import launch, mixed_prompts, reference_tokens, wait_all_free

from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 10
PROMPTS = mixed_prompts(6, seed=21)
BACKOFF_S = 0.1


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    return reference_tokens(PROMPTS, [MAX_TOKENS] * len(PROMPTS))


def test_a_killed_prefill_instance_is_replaced_and_the_replacement_serves_on_its_own(ray_local, want):
    with launch("tiny-1p1d", cluster__restart_backoff_s=BACKOFF_S) as cluster:
        dead = cluster.instance("prefill-0")
        killed_at = time.monotonic()
        ray_local.kill(dead.actor, no_restart=True)
        new = _wait_for_instance(cluster, "prefill-0r1")
        serving_s = time.monotonic() - killed_at
        recovery_s = cluster.router_stats()["restarts"]["recovery_s"]["prefill-0r1"]
        print(f"\nkill -> prefill-0r1 serving: {serving_s:.2f} s (router: death seen -> serving {recovery_s:.2f} s, "
              f"backoff {BACKOFF_S} s)")
        assert new.role == "colocated" and new.pe is None and new.alive

        done = cluster.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), timeout_s=120)
        assert [(c.finish_reason, c.error) for c in done] == [("length", None)] * len(PROMPTS)
        assert [c.token_ids for c in done] == want
        served = {(c.metrics.prefill_instance, c.metrics.decode_instance) for c in done}
        assert served == {("prefill-0r1", "prefill-0r1"), ("decode-0", "decode-0")}, served  # both compute
        assert cluster.healthy
        stats = wait_all_free(cluster)
        (entry,) = stats["degraded"]
        assert (entry["name"], entry["replaced_by"]) == ("prefill-0", "prefill-0r1"), entry
        by_name = {inst["name"]: inst for inst in stats["instances"]}
        assert by_name["prefill-0r1"]["alive"] and by_name["prefill-0r1"]["role"] == "colocated"
        assert stats["router"]["restarts"]["restarts"] == {"prefill-0": 1}


def test_requests_sent_while_nothing_serves_wait_for_the_replacements(ray_local, want):
    with launch("tiny-1p1d", cluster__restart_backoff_s=BACKOFF_S) as cluster:
        for name in ("prefill-0", "decode-0"):
            ray_local.kill(cluster.instance(name).actor, no_restart=True)
        _wait_until(lambda: not any(inst.alive for inst in cluster.fleet.instances))
        done = cluster.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), timeout_s=120)
        assert [(c.finish_reason, c.error) for c in done] == [("length", None)] * len(PROMPTS)
        assert [c.token_ids for c in done] == want
        assert {c.metrics.decode_instance for c in done} <= {"prefill-0r1", "decode-0r1"}
        assert cluster.router_stats()["failures"] == {}
        wait_all_free(cluster)


def test_the_restart_limit_bounds_the_replacements_of_one_instance(ray_local, want):
    with launch("tiny-1p1d", cluster__restart_backoff_s=BACKOFF_S, cluster__restart_limit=1) as cluster:
        ray_local.kill(cluster.instance("prefill-0").actor, no_restart=True)
        first = _wait_for_instance(cluster, "prefill-0r1")
        ray_local.kill(first.actor, no_restart=True)
        _wait_until(lambda: not first.alive)
        time.sleep(10 * BACKOFF_S)  # past the second backoff: a replacement would be starting
        assert cluster.router_stats()["restarts"]["pending"] == []
        assert [inst.name for inst in cluster.fleet.instances] == ["prefill-0", "decode-0", "prefill-0r1"]
        assert [(d["name"], d["replaced_by"]) for d in cluster.degraded] == [("prefill-0", "prefill-0r1"),
                                                                             ("prefill-0r1", None)]
        done = cluster.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), timeout_s=120)
        assert [c.token_ids for c in done] == want  # degraded: local on decode-0
        assert {c.metrics.decode_instance for c in done} == {"decode-0"}


def test_restart_false_leaves_the_fleet_degraded(ray_local, want):
    with launch("tiny-1p1d", cluster__restart=False, cluster__restart_backoff_s=BACKOFF_S) as cluster:
        dead = cluster.instance("prefill-0")
        ray_local.kill(dead.actor, no_restart=True)
        _wait_until(lambda: not dead.alive)
        time.sleep(20 * BACKOFF_S)
        assert [inst.name for inst in cluster.fleet.instances] == ["prefill-0", "decode-0"]
        assert cluster.router_stats()["restarts"] is None
        assert [(d["name"], d["replaced_by"]) for d in cluster.degraded] == [("prefill-0", None)]
        done = cluster.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), timeout_s=120)
        assert [c.token_ids for c in done] == want


def test_a_tensor_parallel_replacement_has_every_rank(ray_local, want):
    with launch("tiny-tp2-1p1d", cluster__restart_backoff_s=BACKOFF_S) as cluster:
        dead = cluster.instance("decode-0")
        ray_local.kill(dead.ranks[1].actor, no_restart=True)  # one rank: the instance dies as a whole
        cluster.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True), timeout_s=120)
        new = _wait_for_instance(cluster, "decode-0r1")
        assert new.tensor_parallel == 2 and [rank.rank for rank in new.ranks] == [0, 1]
        assert sorted(new.bundles) == sorted(dead.bundles)
        done = cluster.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), timeout_s=120)
        assert [c.token_ids for c in done] == want
        assert "decode-0r1" in {c.metrics.decode_instance for c in done}
        wait_all_free(cluster)
        pages = ray_local.get([actor.rank_pages.remote() for actor in new.actors], timeout=30)
        assert all(p["free_pages"] == p["total_pages"] for p in pages), pages


def _wait_for_instance(cluster, name: str, timeout_s: float = 60.0):
    _wait_until(lambda: any(inst.name == name and inst.alive for inst in cluster.fleet.instances), timeout_s)
    return cluster.instance(name)


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
