"""Rebuilding the fleet after a death (`cluster.rebuild`) on tiny-1p1d (CPU actors).

prefill-0 is killed while requests decode on decode-0 (their steps held, so they are surely in
flight); the survivor serves until the rebuild holds the queue, the requests in flight either
finish during the drain (``drain``) or, the drain over at once with their steps still held,
migrate to the new fleet (``migrate``), or, at their migration bound, are waited for past the
drain's timeout (``pinned``); requests sent meanwhile queue. Every accepted request
ends with the tokens of an in-process colocated engine, none failed; the rebuilt fleet is at full
strength: the config's instance names, new actors, no degraded entry, and a new request goes
prefill -> decode with its KV pushed; every page is free afterwards. The time from the kill to
full strength is printed (``-s``) and kept in the router's ``rebuild`` snapshot.

The rebuild's race, without Ray (`RequestFlow` on constructed instances, test_flow.py's): a
reservation answered by an instance that was taken out of service while the answer was on its
way (killed, or swapped for the new fleet's instance of the same name) is dropped.
"""

from __future__ import annotations

import time

import httpx
import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor
from test_flow import DEST, PROMPT, empty, fleet, request, sums

from disagg.cluster.launch import bootstrap
from disagg.cluster.launch.instance import Instance
from disagg.cluster.routing import migration
from disagg.cluster.routing.flow import Add, Hand, Requeue, Reserve
from disagg.cluster.routing.requests import Stage
from disagg.cluster.serve import BackgroundServer, build_app
from disagg.errors import ClusterError
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 24
PROMPTS = mixed_prompts(6, seed=31)
IN_FLIGHT, LATER = PROMPTS[:3], PROMPTS[3:]


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    return reference_tokens(PROMPTS, [MAX_TOKENS] * len(PROMPTS))


@pytest.mark.parametrize("drain", ["drain", "migrate", pytest.param("pinned", marks=pytest.mark.slow)])
def test_a_killed_instance_s_fleet_is_rebuilt_to_full_strength_and_no_request_fails(ray_local, monkeypatch, want,
                                                                                       drain):
    if drain == "pinned":  # no request may migrate: the drain waits for them past its timeout
        monkeypatch.setattr(migration, "MAX_MIGRATIONS", 0)
    with launch("tiny-1p1d", HookedInstanceActor, cluster__rebuild_after_s=0.2, cluster__restart_backoff_s=30.0,
                cluster__rebuild_drain_s=30.0 if drain == "drain" else 0.0) as cluster:
        old = {inst.name: inst.actor for inst in cluster.fleet.instances}
        decode = cluster.instance("decode-0").actor
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        streams = [BackgroundStream(cluster, p, params, request_id=f"r{i}") for i, p in enumerate(IN_FLIGHT)]
        _wait_until(lambda: all(len(s.token_ids) >= 2 for s in streams))  # decoding on decode-0
        ray_local.get(decode.pause_steps.remote(0))
        # What decode-0 holds now stays there until it is moved (it steps no more): a request that
        # ran ahead may have ended before the pause (the others waited for their prompts).
        decoding = _settled(lambda: cluster.router_stats()["stages"].get("decoding", 0))
        assert decoding >= 1
        killed_at = time.monotonic()
        ray_local.kill(old["prefill-0"], no_restart=True)
        _wait_until(lambda: cluster.rebuild_phase in ("draining", "restarting"))
        later = [BackgroundStream(cluster, p, params, request_id=f"later{i}") for i, p in enumerate(LATER)]
        if drain != "migrate":
            ray_local.get(decode.resume_steps.remote())  # the requests in flight finish on decode-0
        _wait_until(lambda: cluster.rebuild_phase is None, timeout_s=120)
        full_s = time.monotonic() - killed_at
        last = cluster.router_stats()["rebuild"]["last"]
        print(f"\n{drain}: kill -> full strength {full_s:.2f} s (router: {last})")

        for i, (stream, tokens) in enumerate(zip(streams + later, want)):
            end = stream.result(timeout_s=60)
            assert (end.finish_reason, end.error) == ("length", None), (i, end)
            assert stream.token_ids == tokens, i
        assert last["migrated"] == (decoding if drain == "migrate" else 0), last
        stats = wait_all_free(cluster)
        assert stats["degraded"] == [] and stats["rebuild"]["phase"] is None, stats["degraded"]
        assert stats["router"]["failures"] == {}
        placements = stats["router"]["placements"]  # nothing placed on the survivor alone: the queue waited
        assert (placements["local"], placements["kept"]) == (0, 0), placements
        assert [inst.name for inst in cluster.fleet.instances] == ["prefill-0", "decode-0"]
        assert all(inst.alive and inst.actor is not old[inst.name] for inst in cluster.fleet.instances)
        assert [inst["pe"] for inst in stats["instances"]] == [0, 1]

        pushed = stats["instances"][0]["pushed_bytes"]
        (done,) = cluster.generate(PROMPTS[:1], params, timeout_s=60)
        assert done.token_ids == want[0]
        assert (done.metrics.prefill_instance, done.metrics.decode_instance) == ("prefill-0", "decode-0")
        after = wait_all_free(cluster)
        assert after["instances"][0]["pushed_bytes"] > pushed  # its KV crossed the new heap
        assert after["router"]["placements"]["remote"] >= 1


def test_a_fleet_start_that_fails_is_tried_again_and_a_replacement_under_way_is_given_up(ray_local, monkeypatch,
                                                                                          want):
    real, calls = bootstrap.start_fleet, []

    def fails_once(*args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ClusterError("the first start fails (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(bootstrap, "start_fleet", fails_once)
    with launch("tiny-1p1d", cluster__rebuild_after_s=0.5, cluster__restart_backoff_s=0.1) as cluster:
        ray_local.kill(cluster.instance("prefill-0").actor, no_restart=True)  # a replacement starts at 0.1 s
        _wait_until(lambda: cluster.rebuild_phase == "restarting")
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        done = cluster.generate(PROMPTS, params, timeout_s=120)  # queued through both starts
        assert [(c.finish_reason, c.token_ids) for c in done] == [("length", tokens) for tokens in want]
        last = cluster.router_stats()["rebuild"]["last"]
        assert last["starts"] == 2 and len(calls) == 2, last
        assert [inst.name for inst in cluster.fleet.instances] == ["prefill-0", "decode-0"]
        stats = wait_all_free(cluster)
        assert stats["degraded"] == [] and stats["router"]["restarts"]["pending"] == []
        assert stats["router"]["placements"]["remote"] == len(PROMPTS)


@pytest.mark.slow
def test_a_replacement_serves_until_the_rebuild_and_health_says_the_phase(ray_local, want):
    """``cluster.restart``'s replacement serves (outside the heap) while the rebuild waits; the
    rebuild kills it with the old fleet; /health answers 200 throughout, naming the phase."""
    with launch("tiny-1p1d", cluster__restart_backoff_s=0.1, cluster__rebuild_after_s=600.0) as cluster, \
            BackgroundServer(build_app(cluster)) as server:
        ray_local.kill(cluster.instance("prefill-0").actor, no_restart=True)
        _wait_until(lambda: any(inst.name == "prefill-0r1" and inst.alive for inst in cluster.fleet.instances))
        replacement = cluster.instance("prefill-0r1").actor
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        done = cluster.generate(PROMPTS, params, timeout_s=60)
        assert [c.token_ids for c in done] == want
        assert "prefill-0r1" in {c.metrics.decode_instance for c in done}
        health = httpx.get(server.base_url + "/health").json()
        assert (health["status"], health["rebuild"]) == ("degraded", "waiting"), health

        rebuild = cluster._router.rebuilder  # the wait ends now (it reads the section each turn)
        rebuild.section = rebuild.section.model_copy(update={"rebuild_after_s": 0.0})
        phases, codes = set(), set()
        deadline = time.monotonic() + 120
        while cluster.rebuild_phase is not None and time.monotonic() < deadline:
            answer = httpx.get(server.base_url + "/health")
            codes.add(answer.status_code)
            phases.add(answer.json().get("rebuild"))
            time.sleep(0.05)
        assert cluster.rebuild_phase is None and codes == {200}, (phases, codes)
        assert "restarting" in phases, phases
        assert httpx.get(server.base_url + "/health").json() == {"status": "ok", "degraded": []}
        assert [inst.name for inst in cluster.fleet.instances] == ["prefill-0", "decode-0"]
        with pytest.raises(ray_local.exceptions.RayActorError):
            ray_local.get(replacement.stats.remote(), timeout=30)
        (again,) = cluster.generate(PROMPTS[:1], params, timeout_s=60)
        assert again.token_ids == want[0]
        assert (again.metrics.prefill_instance, again.metrics.decode_instance) == ("prefill-0", "decode-0")
        stats = wait_all_free(cluster)
        assert stats["instances"][0]["pushed_bytes"] > 0 and stats["router"]["restarts"]["pending"] == []


def test_a_reservation_answered_by_a_swapped_out_instance_is_dropped_and_the_request_routed_again():
    """The rebuild takes the fleet out of service (`Router.migrate_all`) while a reservation is
    on its way to decode-0: the request holds no instance yet, so it does not migrate. The new
    fleet is adopted (`Router.adopt`: same names, new instances), then the old decode-0's answer
    comes. Taken as valid, the new prefill-0 would push the prompt's KV into the old heap's
    reservation: pages of the new decode-0 that nobody reserved. Dropped, the request is queued
    again out of the ledger, and routed onto the new fleet."""
    flow, _, old = fleet(decode=1)
    req = request()
    flow.arrived(req)
    assert flow.route(req) == (Reserve(old["decode-0"]),)
    for inst in old.values():
        assert flow.instance_died(inst, "stopped for the fleet's rebuild (cluster.rebuild)") == []
    new = {name: Instance(name, inst.role, actor=None, pe=inst.pe) for name, inst in old.items()}
    flow.placer.instances[:] = new.values()  # `Fleet.adopt`: the placer's list is the fleet's
    for inst in new.values():
        flow.placer.add(inst)

    assert flow.reserved(req, old["decode-0"], DEST) == (Requeue(),)
    assert (req.stage, req.decode, req.prefill, req.dest) == (Stage.QUEUED, None, None, None)
    assert sums(flow) == empty() and flow.placed == {}
    (reserve,) = flow.route(req)
    assert reserve.instance is new["decode-0"]
    (hand,) = flow.reserved(req, new["decode-0"], "new-dest")
    assert hand.instance is new["prefill-0"]
    assert flow.handed(req) == (Add(new["prefill-0"], "new-dest", "remote"),)


def test_a_reservation_answered_by_an_instance_that_died_meanwhile_asks_the_next_one():
    """decode-0 answers, then dies before its answer is heard: the route's next decode
    instance is asked, as when the call itself failed (`Router._reserve`)."""
    flow, _, by = fleet(decode=2)
    req = request()
    flow.arrived(req)
    assert flow.route(req) == (Reserve(by["decode-0"]),)
    assert flow.instance_died(by["decode-0"], "its actor exited") == []
    assert flow.reserved(req, by["decode-0"], DEST) == (Reserve(by["decode-1"]),)
    assert req.decode is None and req.stage == Stage.RESERVING
    assert flow.reserved(req, by["decode-1"], "dest-1") == (Hand(by["prefill-0"]),)
    assert (req.decode, req.dest) == (by["decode-1"], "dest-1")
    assert sums(flow)["loads"] == {"prefill-0": PROMPT, "decode-1": PROMPT}


def _settled(read, quiet_s: float = 1.0, timeout_s: float = 30.0):
    """``read()`` once it has not changed for ``quiet_s`` (messages already on their way arrived)."""
    deadline = time.monotonic() + timeout_s
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"still changing after {timeout_s} s: {value}"
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
