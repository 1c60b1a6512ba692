"""`RequestFlow` (cluster/routing/flow.py): a request's life as events in, actions out, on constructed
instances (no Ray, no engine). Each transition's stage, actions and the ledger's exact sums after
it; every state is also checked against the sums over the placed requests (`RequestFlow.check`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.cluster.launch.instance import Instance
from disagg.cluster.outputs import RequestMetrics
from disagg.cluster.routing import migration
from disagg.cluster.routing.flow import Abort, Add, Cancel, End, Hand, RequestFlow, Requeue, Reserve, Start
from disagg.cluster.routing.ledger import Ledger
from disagg.cluster.routing.placement.placer import WAIT_PREFILL_QUEUE, Placer, Wait
from disagg.cluster.routing.requests import Picker, RoutedRequest, Stage
from disagg.config import Config
from disagg.errors import InstanceDied, NoLiveInstance, RequestRefused, RequestTimedOut, SignalTimeout
from disagg.sampling import SamplingParams

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROMPT, MAX_TOKENS = 40, 8
DEST = "dest"  # a reservation as the flow sees it: opaque, passed back in `Add` and `Cancel`


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(placement: str = "disaggregated", *, prefill: int = 1, decode: int = 2, **overrides):
    """A flow over tiny-1p1d with ``prefill`` + ``decode`` instances, its clock, and them by name."""
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml").override(
        {"router.placement": placement, "instances.prefill": prefill, "instances.decode": decode, **overrides})
    instances = [Instance(f"{role}-{i}", role, actor=None, pe=k)
                 for k, (role, i) in enumerate([("prefill", i) for i in range(prefill)] +
                                               [("decode", i) for i in range(decode)])]
    clock = Clock()
    placer = Placer(config, instances, Picker(config.router.policy), clock=clock, tracked=True)
    flow = RequestFlow(placer, config.router)
    finished: list[str] = []
    finish = placer.finished
    placer.finished = lambda req: (finished.append(req.request_id), finish(req))
    flow.finished = finished  # the requests the placer heard finish, in order
    return flow, clock, {inst.name: inst for inst in instances}


def request(name: str = "r", prompt_len: int = PROMPT, max_tokens: int = MAX_TOKENS) -> RoutedRequest:
    return RoutedRequest(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), lambda *a: None,
                         RequestMetrics(arrival_time=0.0))


def sums(flow: RequestFlow) -> dict:
    """The ledger's sums that are not zero, after checking every one against the placed requests."""
    flow.check()
    ledger = flow.ledger
    nonzero = lambda counter: {name: n for name, n in counter.items() if n}  # noqa: E731
    return {"count": len(ledger), "outputs": ledger.outputs, "unnamed": ledger.unnamed,
            "loads": nonzero(ledger.loads), "seats": nonzero(ledger.seats), "queued": nonzero(ledger.queued)}


def empty() -> dict:
    return {"count": 0, "outputs": 0, "unnamed": 0, "loads": {}, "seats": {}, "queued": {}}


def remote_to_decoding(flow, by, req):
    """``req`` through arrived, route, reserved (decode-0), handed, first token: decoding."""
    flow.arrived(req)
    assert flow.route(req) == (Reserve(by["decode-0"]),)
    assert flow.reserved(req, by["decode-0"], DEST) == (Hand(by["prefill-0"]),)
    assert flow.handed(req) == (Add(by["prefill-0"], DEST, "remote"),)
    assert flow.first_token(req, by["prefill-0"]) == (Start(by["decode-0"]),)


def test_a_remote_request_through_every_stage_with_the_exact_sums_after_each():
    flow, clock, by = fleet()
    req = request()
    flow.arrived(req)
    assert req.stage == Stage.QUEUED and flow.live == {"r": req} and not flow.placed
    assert req.deadline == clock.now + 300  # tiny-1p1d's router.request_timeout_s
    assert sums(flow) == empty()  # a queued request is in no sum

    assert flow.route(req) == (Reserve(by["decode-0"]),)
    assert req.stage == Stage.RESERVING and flow.placed == {"r": req}
    assert sums(flow) == {**empty(), "count": 1, "outputs": MAX_TOKENS, "unnamed": PROMPT}

    clock.now += 1.0
    assert flow.reserved(req, by["decode-0"], DEST) == (Hand(by["prefill-0"]),)
    assert (req.stage, req.decode, req.prefill, req.dest) == (Stage.RESERVING, by["decode-0"], by["prefill-0"], DEST)
    named = {**empty(), "count": 1, "outputs": MAX_TOKENS, "loads": {"prefill-0": PROMPT, "decode-0": PROMPT},
             "seats": {"prefill-0": 1, "decode-0": 1}, "queued": {"prefill-0": PROMPT}}
    assert sums(flow) == named

    assert flow.handed(req) == (Add(by["prefill-0"], DEST, "remote"),)
    assert req.stage == Stage.PREFILLING and req.lease_deadline == clock.now + 30  # router.lease_s
    assert sums(flow) == named

    assert flow.first_token(req, by["prefill-0"], relay_s=0.001) == (Start(by["decode-0"]),)
    assert (req.stage, req.num_output, req.lease_deadline, req.first_token_at) == (Stage.DECODING, 1, None, clock.now)
    decoding = {**empty(), "count": 1, "outputs": MAX_TOKENS, "loads": {"decode-0": PROMPT + 1},
                "seats": {"decode-0": 1}}
    assert sums(flow) == decoding
    assert req.holders() == [by["prefill-0"], by["decode-0"]]  # its KV may not have landed yet

    assert flow.tokens(req, 3) == ()
    assert req.num_output == 4 and req.kv_landed and req.holders() == [by["decode-0"]]
    assert sums(flow) == {**decoding, "loads": {"decode-0": PROMPT + 4}}

    assert flow.tokens(req, 4, "length") == (End("length", release=False),)
    assert req.num_output == MAX_TOKENS
    assert flow.end(req, "length", release=False) == ()
    assert req.done and not flow.live and not flow.placed and flow.finished == ["r"]
    assert sums(flow) == empty()
    assert flow.end(req, "length") == () and flow.finished == ["r"]  # once


def test_refused_passes_to_the_next_decode_instance_then_requeues_out_of_the_ledger():
    flow, _, by = fleet()
    req = request()
    flow.arrived(req)
    assert flow.route(req) == (Reserve(by["decode-0"]),)
    assert flow.refused(req, by["decode-0"]) == (Reserve(by["decode-1"]),)  # out of pages (or dead)
    assert req.stage == Stage.RESERVING and sums(flow)["unnamed"] == PROMPT
    assert flow.refused(req, by["decode-1"]) == (Requeue(),)
    assert req.stage == Stage.QUEUED and req.decode is None and "r" in flow.live and not flow.placed
    assert sums(flow) == empty()
    assert flow.route(req) == (Reserve(by["decode-1"]),)  # routed again: the picker's next turn
    assert flow.reserved(req, by["decode-1"], DEST) == (Hand(by["prefill-0"]),)
    assert sums(flow)["loads"] == {"prefill-0": PROMPT, "decode-1": PROMPT}


def test_a_reservation_refused_for_good_ends_the_request_and_nothing_is_released():
    flow, _, by = fleet()
    req = request()
    flow.arrived(req)
    flow.route(req)
    error = RequestRefused("decode-0 refused the request: bad", instance="decode-0")
    assert flow.refused(req, by["decode-0"], error) == (End("error", error, release=False),)
    assert flow.end(req, "error", error, release=False) == ()
    assert sums(flow) == empty() and flow.finished == []  # a failure is no finish


def test_a_refused_prompt_ends_it_and_frees_the_reservation_it_had():
    flow, _, by = fleet()
    req = request()
    flow.arrived(req)
    flow.route(req)
    flow.reserved(req, by["decode-0"], DEST)
    flow.handed(req)
    error = RequestRefused("prefill-0.add failed: bad", instance="prefill-0")
    assert flow.refused(req, by["prefill-0"], error) == (End("error", error, release=False),
                                                         Cancel(by["decode-0"], DEST))
    with pytest.raises(ValueError, match="a refused prompt needs its error"):
        flow.refused(req, by["prefill-0"])
    alone_flow, _, alone_by = fleet("local")
    alone = request()
    alone_flow.arrived(alone)
    alone_flow.route(alone)
    assert alone_flow.refused(alone, alone_by["decode-0"], error) == (End("error", error),)


def test_a_reservation_answered_after_its_request_ended_is_cancelled():
    flow, _, by = fleet()
    req = request()
    flow.arrived(req)
    flow.route(req)
    assert flow.end(req, "abort") == ()  # reserving: nothing held yet
    assert flow.reserved(req, by["decode-0"], DEST) == (Cancel(by["decode-0"], DEST),)
    assert flow.refused(req, by["decode-1"]) == () and flow.handed(req) == ()
    assert sums(flow) == empty() and req.decode is None


def test_a_reservation_with_no_live_prefill_instance_is_cancelled_and_requeued_to_go_local():
    flow, _, by = fleet()
    req = request()
    flow.arrived(req)
    flow.route(req)
    by["prefill-0"].alive = False  # died while the reservation was on its way
    assert flow.reserved(req, by["decode-0"], DEST) == (Cancel(by["decode-0"], DEST), Requeue())
    assert req.stage == Stage.QUEUED and (req.decode, req.dest) == (None, None) and sums(flow) == empty()
    (add,) = flow.route(req)  # the survivors' path: a decode instance computes it
    assert (add.instance.role, add.dest, add.path) == ("decode", None, "local") and req.stage == Stage.RUNNING


def test_route_waits_or_fails_without_placing():
    flow, _, by = fleet(**{"router.prefill_queue_tokens": 50})
    first, second = request("a"), request("b")
    for req in (first, second):
        flow.arrived(req)
    assert flow.route(first) == (Reserve(by["decode-0"]),)
    assert flow.route(second) == (Wait(WAIT_PREFILL_QUEUE),)  # 40 queued + 40 > 50
    assert second.stage == Stage.QUEUED and sums(flow)["count"] == 1
    for inst in (by["decode-0"], by["decode-1"], by["prefill-0"]):
        inst.alive = False
    (end,) = flow.route(second)
    assert (end.reason, type(end.error), end.error.role) == ("error", NoLiveInstance, "decode")
    assert second.stage == Stage.QUEUED and sums(flow)["count"] == 1


def test_a_request_placed_alone_runs_on_its_one_instance():
    flow, _, by = fleet("local")
    req = request()
    flow.arrived(req)
    assert flow.route(req) == (Add(by["decode-0"], None, "local"),)
    assert req.stage == Stage.RUNNING and req.colocated is by["decode-0"]
    running = {**empty(), "count": 1, "outputs": MAX_TOKENS, "loads": {"decode-0": PROMPT},
               "seats": {"decode-0": 1}, "queued": {"decode-0": PROMPT}}
    assert sums(flow) == running
    assert flow.first_token(req, by["decode-0"]) == ()  # no prefill instance: its tokens are `tokens`
    assert flow.tokens(req, 1) == () and req.first_token_at is not None
    assert sums(flow) == {**running, "loads": {"decode-0": PROMPT + 1}, "queued": {}}  # its prompt computed
    assert flow.tokens(req, 2) == ()
    assert sums(flow)["loads"] == {"decode-0": PROMPT + 3}
    assert flow.end(req, "abort") == (Abort(by["decode-0"]),)  # a caller's abort: release its pages
    assert sums(flow) == empty() and flow.finished == []


@pytest.mark.parametrize("finished", [None, "length"])
def test_the_first_token_from_the_prefill_instance_starts_the_decode_side(finished):
    flow, _, by = fleet()
    req = request(max_tokens=1 if finished else MAX_TOKENS)
    flow.arrived(req)
    flow.route(req)
    assert flow.first_token(req, by["prefill-0"]) == ()  # reserving: not its first token yet
    flow.reserved(req, by["decode-0"], DEST)
    flow.handed(req)
    assert flow.first_token(req, by["decode-0"], finished) == ()  # not its prefill instance
    want = (Start(by["decode-0"]),) + ((End(finished, release=False),) if finished else ())
    assert flow.first_token(req, by["prefill-0"], finished) == want
    assert req.num_output == 1 and req.stage == Stage.DECODING


def test_what_an_end_releases_follows_the_stage_it_left_and_skips_dead_instances():
    flow, _, by = fleet()
    prefilling, decoding = request("p"), request("d")
    for req in (prefilling, decoding):
        flow.arrived(req)
        (reserve,) = flow.route(req)  # decode-0, then decode-1: the picker's turns
        flow.reserved(req, reserve.instance, DEST)
        flow.handed(req)
    flow.first_token(decoding, by["prefill-0"])
    assert flow.end(prefilling, "abort") == (Abort(by["decode-0"]), Abort(by["prefill-0"],
                                                                          Cancel(by["decode-0"], DEST)))
    by["decode-1"].alive = False
    assert flow.end(decoding, "abort") == ()  # its only holder is dead
    assert sums(flow) == empty()


def test_an_instance_that_dies_migrates_the_requests_it_holds_once():
    flow, _, by = fleet(decode=1)
    held, other = request("held"), request("other")
    remote_to_decoding(flow, by, held)
    flow.arrived(other)  # queued: no instance holds it
    held.output_token_ids = [7]  # what the router streamed: the first token
    migrated = flow.instance_died(by["prefill-0"], "its actor exited")
    # The KV may not have landed (the prefill side holds it): D's reservation is released under
    # the id it had there, and the request is routed again with its first token in its prompt.
    assert migrated == [(held, (Abort(by["decode-0"], engine_id="held"), Requeue(wait=False)))]
    assert not by["prefill-0"].alive and by["prefill-0"].error == "its actor exited"
    assert flow.instance_died(by["prefill-0"], "again") == []
    assert (held.stage, held.prompt_token_ids, held.params.max_tokens) == (Stage.QUEUED, [1] * PROMPT + [7],
                                                                           MAX_TOKENS - 1)
    assert (held.engine_id, held.num_migrations, held.num_output, held.holders()) == (("held", 1), 1, 0, [])
    assert sums(flow) == empty()  # out of the ledger until routed again
    assert flow.route(held) == (Add(by["decode-0"], None, "local"),)  # the survivor computes the resumed prompt
    assert sums(flow)["loads"] == {"decode-0": PROMPT + 1}


def test_a_death_past_the_migration_bound_or_with_no_survivor_fails_the_request():
    flow, _, by = fleet(decode=1)
    bounded, alone = request("bounded"), request("alone")
    for req in (bounded, alone):
        flow.arrived(req)
    bounded.num_migrations = migration.MAX_MIGRATIONS
    assert flow.route(bounded) == (Reserve(by["decode-0"]),)
    flow.reserved(bounded, by["decode-0"], DEST)
    flow.handed(bounded)
    (died,) = flow.instance_died(by["decode-0"], "its actor exited")
    req, (end,) = died
    assert req is bounded and (end.reason, type(end.error), end.error.instance) == ("error", InstanceDied, "decode-0")
    assert str(end.error) == "decode instance decode-0 (PE 1) died: its actor exited"
    assert flow.end(bounded, end.reason, end.error) == (Abort(by["prefill-0"], Cancel(by["decode-0"], DEST)),)
    assert flow.route(alone) == (Add(by["prefill-0"], None, "kept"),)
    ((req, (end,)),) = flow.instance_died(by["prefill-0"], "its actor exited")  # nothing left to serve it
    assert req is alone and isinstance(end.error, InstanceDied) and end.error.instance == "prefill-0"


def test_expired_aborts_past_the_timeout_and_fails_a_lease_only_while_prefilling():
    flow, clock, by = fleet()
    late, leased = request("late"), request("leased")
    flow.arrived(late)
    clock.now += 100.0
    flow.arrived(leased)
    flow.route(leased)
    flow.reserved(leased, by["decode-0"], DEST)
    flow.handed(leased)
    assert flow.expired(clock.now) == []
    (req, end), = flow.expired(clock.now + 31.0)  # past leased's lease (30 s)
    assert req is leased and (end.reason, type(end.error), end.error.dst_pe) == ("error", SignalTimeout, 1)
    expired = flow.expired(clock.now + 201.0)  # past late's deadline too (300 s after its arrival)
    assert [(r.request_id, type(e.error)) for r, e in expired] == [("late", RequestTimedOut),
                                                                     ("leased", SignalTimeout)]
    timeout = expired[0][1].error
    assert expired[0][1].reason == "abort" and (timeout.stage, type(timeout.stage)) == ("queued", str)
    flow.first_token(leased, by["prefill-0"])
    assert [r.request_id for r, _ in flow.expired(clock.now + 31.0)] == []  # its lease is over


def test_the_flow_needs_a_placer_that_keeps_a_ledger():
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml")
    placer = Placer(config, [Instance("decode-0", "decode", actor=None)], Picker("least_loaded"))
    with pytest.raises(ValueError, match="tracked=True"):
        RequestFlow(placer, config.router)


def test_check_fails_when_a_move_is_missed(monkeypatch):
    flow, _, by = fleet()
    req = request()
    remote_to_decoding(flow, by, req)
    monkeypatch.setattr(Ledger, "advance", lambda self, req, num_tokens: None)
    flow.tokens(req, 2)
    assert "summed over the live requests" in flow.audit()
    with pytest.raises(AssertionError, match="summed over the live requests"):
        flow.check()
    flow.rebuild()
    assert flow.audit() is None
