"""Where a request goes: one placement for the router and the simulator.

`Placer.route` turns a request, the fleet's instances and the live requests into what to do
with it now (docs/ARCHITECTURE.md §7, step 2):

    Wait(reason)         nothing can start it yet: every prefill instance already has
                         `prefill_queue_tokens` queued, or no instance has its pages; it stays
                         at the queue head; or no live instance can serve it and a
                         replacement is being started (`WAIT_RESTART`, `cluster.restart`)
    Fail(role)           no live instance can serve it (none of either role, or no colocated one)
    Alone(inst, path)    ``inst`` prefills and decodes it: "colocated" (colocated fleet, or a
                         replacement, below), "local" (a decode instance) or "kept" (a prefill
                         instance); with a whole role dead, every request so on a survivor
                         (`degraded_path`)
    Remote(decodes)      reserve its pages on ``decodes``, in this order: the first that has
                         them decodes it and `Placer.hand` names the prefill instance that
                         computes the prompt (adaptive: the one whose TTFT the decision
                         predicted, while it lives); one that refuses (out of pages, dead) passes
                         to the next; when every one refused, it waits (`WAIT_PAGES`)

The order of instances (the `Picker`, its prefix credit), the `router.placement` policy
(`PlacementPolicy`: disaggregated, local, or adaptive's `decide`; `degraded_path` once a whole
role is dead, whatever the policy), the prefill-queue bound, the
replacements (a prefill + decode fleet's "colocated" instances, `cluster.restart`: no PE of the
heap, each takes a request alone when it is the least loaded of it and the instances the
request would otherwise go to: the decode instances, or the survivors of a dead role), the
placement counts and the prefix affinity live here. Its caller is the request flow
(`disagg.cluster.routing.flow`), which moves each request as the route says; the calls that touch an instance
stay with the flow's drivers: the router's (`disagg.cluster.routing.router`) are Ray calls on its event
loop, with their failures (dead actors, aborts while reserving), the simulator's
(`disagg.cluster.simulate.fleet`) calls on its virtual engines. Synchronous and without I/O; it runs
on the caller's thread.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from disagg import trace
from disagg.cluster.launch.instance import Instance
from disagg.cluster.routing.affinity import PrefixAffinity
from disagg.cluster.routing.ledger import Ledger
from disagg.cluster.routing.placement.decision import Decision, decide
from disagg.cluster.routing.placement.fleet_model import FleetModel
from disagg.cluster.routing.placement.policy import degraded_path, policy_of
from disagg.cluster.routing.placement.prediction import PATHS, Targets
from disagg.cluster.routing.requests import Picker, RoutedRequest
from disagg.config import Config
from disagg.errors import NoLiveInstance

logger = logging.getLogger(__name__)

PREDICTIONS_KEPT = 4096  # adaptive placement: predictions awaiting their first token, at most
DECISIONS_KEPT = 32  # adaptive placement: the latest decisions, with their predictions, for stats
WAIT_PREFILL_QUEUE = "prefill_queue"  # every prefill instance has prefill_queue_tokens queued
WAIT_PAGES = "pages"  # no instance has the pages (adaptive: predicted; remote: every reservation refused)
WAIT_RESTART = "restart"  # no live instance can serve it, and a replacement is being started

# decide(req, live prefill instances, decode instances in the picker's order, live requests)
Decide = Callable[[RoutedRequest, list[Instance], list[Instance], Collection[RoutedRequest]], Decision]


@dataclass(frozen=True)
class Wait:
    """Leave the request at the queue head; try again when the fleet changes."""

    reason: str  # WAIT_PREFILL_QUEUE or WAIT_PAGES


@dataclass(frozen=True)
class Fail:
    """No live instance of ``role`` is left, nor one that can take its work: the request fails
    with `error`."""

    role: str

    def error(self) -> NoLiveInstance:
        return NoLiveInstance(f"no live {self.role} instance", role=self.role)


@dataclass(frozen=True)
class Alone:
    """``instance`` prefills and decodes the request (already counted and noted)."""

    instance: Instance
    path: str  # "colocated", or a `PATHS` path: "local", "kept"


@dataclass(frozen=True)
class Remote:
    """Reserve pages on ``decodes`` in order (module docstring), then `Placer.hand`."""

    decodes: tuple[Instance, ...]


Route = Wait | Fail | Alone | Remote


class Placer:
    """The placement of ``config``'s fleet (module docstring). `route` and `hand` take the
    picker's turns (round robin, equal loads) and note prompts in the affinity: one call per
    attempt, as the router's dispatcher makes them.

    Args:
        config: the deployment (its mode, router and scheduler sections).
        instances: every instance of the fleet (dead ones are skipped by ``alive``).
        picker: orders the instances of a role (the router's `Picker`; the simulator's keeps
            its loads up to date).
        affinity: the prefix affinity credited to instances that hold a prompt's prefix, or None.
        clock: seconds now (the router's ``time.monotonic``, the simulator's virtual clock):
            an adaptive decision's time, against which `first_token` measures its TTFT.
        tracked: every move of a request is made in ``ledger`` (`Ledger.touch`, `advance`,
            `drop`; by the request flow, `disagg.cluster.routing.flow`): the picker's loads and the
            adaptive views are read from it, O(instances) a placement, and the live requests passed
            in are not summed. False: summed over them at each placement (the tests of constructed
            states).

    Attributes:
        policy: the `PlacementPolicy` of `router.placement` (a colocated fleet: disaggregated,
            unused).
        placements: requests placed per path (`PATHS`); colocated ones are not counted.
        decisions: the latest adaptive decisions, newest last.
        affinity_hits: placements on an instance believed to hold part of the prompt.
        fleet_model: each instance's step-time model and load, for `decide`.
        ledger: the live requests' sums (``tracked``), or None.
    """

    def __init__(self, config: Config, instances: list[Instance], picker: Picker,
                 affinity: PrefixAffinity | None = None, clock: Callable[[], float] = time.monotonic,
                 tracked: bool = False) -> None:
        self.instances = instances
        self.colocated = config.mode == "colocated"
        self.policy = policy_of(config.router.placement)
        self.picker = picker
        self.affinity = affinity
        sched = config.scheduler
        self.prefill_queue_tokens = config.router.prefill_queue_tokens or 4 * sched.max_num_batched_tokens
        self.fleet_model = FleetModel(sched.max_num_batched_tokens, config.cache.page_size,
                                      seed_fit(config.router.step_profile),
                                      reserve_waits=not sched.overlap_reservations, max_seqs=sched.max_num_seqs,
                                      launches_ahead=sched.async_scheduling,
                                      measured_hops=config.router.measured_hops)
        self.targets = Targets.from_ms(config.router.slo_ttft_ms, config.router.slo_tpot_ms,
                                       config.router.adaptive_prefer, config.router.adaptive_overload)
        self.placements: collections.Counter[str] = collections.Counter({path: 0 for path in PATHS})
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=DECISIONS_KEPT)
        self.affinity_hits = 0
        self._by_name = {inst.name: inst for inst in instances}
        self.clock = clock
        # request id -> (its chosen prediction, when): until its first token (`first_token`)
        self._predicted: collections.OrderedDict[str, tuple[Decision, float]] = collections.OrderedDict()
        # request id -> (path taken, its predicted TPOT, first token's time): from `first_token`
        # to `finished`, while decisions are recorded
        self._tpot_predicted: collections.OrderedDict[str, tuple[str, float, float]] = collections.OrderedDict()
        # request id -> the prefill instance an adaptive remote decision predicted: until `hand`
        self._remote_prefill: collections.OrderedDict[str, str] = collections.OrderedDict()
        # where the "decision" record of each adaptively placed request goes at its first token
        # (`decision_record`) and its "tpot" record at its end (`tpot_record`), as
        # record(kind, fields): None, the trace while it is on (serving); the simulator's
        # --trace-dir records take them here
        self.record: Callable[[str, dict], None] | None = None
        self.degraded: str | None = None  # the survivors' path in force (`degraded_path`), or None
        # the dead instances whose replacement is being started (`cluster.restart`): while one is,
        # a request that no live instance can serve waits for it instead of failing
        self.restarting: Collection[str] = ()
        self.ledger = Ledger(instances, routed=self._remote_prefill) if tracked else None
        if tracked:
            picker.ledger = self.fleet_model.ledger = self.ledger

    def of_role(self, role: str) -> list[Instance]:
        return [inst for inst in self.instances if inst.role == role]

    def add(self, inst: Instance) -> None:
        """Route to ``inst`` from now on: a replacement that joined the fleet (`cluster.restart`)."""
        if inst not in self.instances:
            self.instances.append(inst)
        self._by_name[inst.name] = inst
        if self.ledger is not None:
            self.ledger.add(inst)

    # ------------------------------------------------------------------ the route
    def route(self, req: RoutedRequest, live: Collection[RoutedRequest], decide: Decide | None = None) -> Route:
        """What to do with ``req`` now (module docstring).

        Args:
            req: the request (colocated fleet: just submitted; else the queue head).
            live: the live requests (their loads; ``req`` among them or not).
            decide: the adaptive decision (default `Placer.decide`; the router passes its own
                hook, which tests replace).

        Returns:
            `Wait`, `Fail`, `Alone` (counted and noted already) or `Remote`.
        """
        standalone = self._order(req, "colocated", live)  # a prefill + decode fleet's: replacements
        if self.colocated or not standalone and not any(inst.alive for inst in self.instances):
            if standalone:
                return self._alone(req, standalone[0], "colocated")
            return Wait(WAIT_RESTART) if self.restarting else Fail("colocated" if self.colocated else "decode")
        decodes = self._order(req, "decode", live)
        prefills = self.of_role("prefill")
        alive_prefills = [inst for inst in prefills if inst.alive]
        survivors = self._survivors_path(bool(alive_prefills), bool(decodes))
        if survivors is not None or not (decodes and alive_prefills):
            ranked = decodes if survivors == "local" else self._order(req, "prefill", live)
            first = self.picker.order(ranked + standalone, live)[0] if standalone else ranked[0]
            return self._alone(req, first, "colocated" if first.role == "colocated" else survivors)
        first = self.picker.order(decodes + standalone, live)[0] if standalone else None
        if first is not None and first.role == "colocated":  # a replacement less loaded than every D
            return self._alone(req, first, "colocated")
        if self.policy.always_local and decodes:
            return self._alone(req, decodes[0], "local")
        pushed = None
        if self.policy.predicts and decodes and alive_prefills:
            decision = (decide or self.decide)(req, alive_prefills, decodes, live)
            if decision.chosen is None:
                return Wait(WAIT_PAGES)
            chosen = self._by_name[decision.chosen.decode]
            if decision.path != "remote":
                return self._alone(req, chosen, decision.path)
            decodes = [chosen] + [inst for inst in decodes if inst is not chosen]
            _remember(self._remote_prefill, req.request_id, decision.chosen.prefill)
            pushed = chosen.name
        if not decodes or not alive_prefills:
            return Fail("decode" if not decodes else "prefill")
        # a reservation still on its way to a prefill instance (the router's run beside its
        # dispatch, `Router._reserve`) queues its prompt there too
        queues, unnamed = self.picker.prompt_queues(alive_prefills, live)
        queued = min(queues.values()) + unnamed
        if queued and queued + req.prompt_len > self.prefill_queue_tokens:
            return Wait(WAIT_PREFILL_QUEUE)
        if pushed is not None:  # the decode instance's push rate (`InstanceView.push_rate`)
            self.fleet_model.note_push(pushed, self.clock())
        return Remote(tuple(decodes))

    def decide(self, req: RoutedRequest, prefills: list[Instance], decodes: list[Instance],
               live: Collection[RoutedRequest]) -> Decision:
        """The adaptive choice for ``req`` (`disagg.cluster.routing.placement.decision.decide` over
        `FleetModel.views`, one pass over ``live``), kept in ``decisions``."""
        now = self.clock()
        routed = self._remote_prefill  # the reservations on their way: `FleetModel.views`
        views = self.fleet_model.views(prefills + decodes, live, now, routed)
        cached = None  # each instance prices only what follows the prefix it is believed to hold
        if self.affinity is not None:
            cached = self.affinity.credit([v.name for v in views], self.affinity.keys(req.prompt_token_ids))
        decision = decide(req.prompt_len, views[:len(prefills)], views[len(prefills):], self.targets, cached)
        self.decisions.append(decision)
        if decision.chosen is not None:
            _remember(self._predicted, req.request_id, (decision, now))
            if cached is not None and decision.path == "remote":  # queued on that P until `hand`
                req.cached_tokens = cached.get(decision.chosen.prefill, 0)
        return decision

    def reserved(self, req: RoutedRequest) -> None:
        """``req``'s decode instance (``req.decode``) answered its reservation (now, by ``clock``):
        for an adaptive remote decision that named it, the time since the decision beyond the step
        in flight it predicted goes to that instance's `FleetModel.note_reserve`, which prices the
        next remote paths through it."""
        entry = self._predicted.get(req.request_id)
        if entry is None or req.decode is None:
            return
        decision, at = entry
        chosen = decision.chosen
        if chosen.path == "remote" and chosen.decode == req.decode.name:
            self.fleet_model.note_reserve(req.decode.name, self.clock() - at, chosen.reserve_step_s)

    def first_token(self, req: RoutedRequest, relay_s: float | None = None) -> None:
        """``req``'s first token reached the router (now, by ``clock``; `RoutedRequest.first_token_at`,
        from which the adaptive placement counts its TPOT so far), ``relay_s`` after the step that
        made it returned (None: not measured; the simulator's tokens arrive as their step ends):
        that hop of the instance that computed its prompt (`FleetModel.note_relay`), its
        placement's TTFT prediction against the time since the decision, the miss of its path
        there (`FleetModel.note_ttft`, a diagnostic), and while tracing the decision's "decision"
        record (`decision_record`)."""
        now = req.first_token_at = self.clock()
        entry = self._predicted.pop(req.request_id, None)
        computing = req.colocated or req.prefill
        if relay_s is not None and computing is not None:
            self.fleet_model.note_relay(computing.name, relay_s)
        if entry is None or computing is None:
            return
        decision, at = entry
        chosen = decision.chosen
        path = "remote" if req.colocated is None else _ALONE_PATHS.get(req.colocated.role, "colocated")
        if path == chosen.path:
            self.fleet_model.note_ttft(computing.name, path, now - at, chosen.ttft_s)
        if self.record is not None:
            self.record("decision", decision_record(req, decision, now, path, now - at))
        elif trace.enabled():
            trace.record("decision", **decision_record(req, decision, time.time(), path, now - at))
        else:
            return
        decoder = req.colocated or req.decode
        same = [p for p in decision.predictions if p.path == path and decoder is not None and p.decode == decoder.name]
        taken = chosen if path == chosen.path else (same[0] if same else None)
        if taken is not None:
            _remember(self._tpot_predicted, req.request_id, (path, taken.tpot_s, now))

    def finished(self, req: RoutedRequest) -> None:
        """``req`` ended with ``req.num_output`` tokens (now, by ``clock``): while decisions are
        recorded, an adaptively placed one of 2 tokens or more gets a "tpot" record (written as the
        "decision" records are): the TPOT its decision predicted for the path taken against the
        one it had since its first token, as the router saw its tokens (`tpot_record`)."""
        entry = self._tpot_predicted.pop(req.request_id, None)
        if entry is None or req.num_output < 2:
            return
        path, predicted_s, first_at = entry
        now = self.clock()
        record = tpot_record(req, path, predicted_s, (now - first_at) / (req.num_output - 1))
        if self.record is not None:
            self.record("tpot", {"t": now, **record})
        elif trace.enabled():
            trace.record("tpot", t=time.time(), **record)

    def hand(self, req: RoutedRequest, decode: Instance, live: Collection[RoutedRequest]) -> Instance | None:
        """``decode`` reserved ``req``'s pages (a `Remote` route's first taker): the prefill
        instance to hand its prompt to, counted as remote; None when no prefill instance is alive
        (the caller frees the reservation and fails it). Adaptive: the instance its decision
        predicted the TTFT of (`predict`'s fastest), while alive: the picker's least loaded
        counts a kept request's tokens, not its compute, and would send the prompt behind
        another's queue, a TTFT nobody predicted. Otherwise the least loaded, prefix credit."""
        self._note(req, decode)
        named = self._by_name.get(self._remote_prefill.pop(req.request_id, None))
        ranked = [named] if named is not None and named.alive else self._order(req, "prefill", live)
        if not ranked:
            return None
        req.cached_tokens = self._note(req, ranked[0])
        self.placements["remote"] += 1
        return ranked[0]

    # ------------------------------------------------------------------ helpers
    def _survivors_path(self, prefill_alive: bool, decode_alive: bool) -> str | None:
        """`degraded_path` of the live roles, said once in the log whenever it changes."""
        path = degraded_path(prefill_alive, decode_alive)
        if path != self.degraded:
            if path is not None:
                logger.warning("no live %s instance: every request is now %s on the %s instances (degraded; "
                               "prompts and decodes share their steps)", "prefill" if path == "local" else "decode",
                               path, "decode" if path == "local" else "prefill")
            self.degraded = path
        return path

    def _alone(self, req: RoutedRequest, inst: Instance, path: str) -> Alone:
        req.cached_tokens = self._note(req, inst)
        if path in PATHS:
            self.placements[path] += 1
        return Alone(inst, path)

    def _order(self, req: RoutedRequest, role: str, live: Collection[RoutedRequest]) -> list[Instance]:
        """The live instances of ``role`` in the picker's order, with ``req``'s prefix credit."""
        instances = self.of_role(role)
        credit = None
        if self.affinity is not None:
            credit = self.affinity.credit([inst.name for inst in instances], self.affinity.keys(req.prompt_token_ids))
        return self.picker.order(instances, live, credit)

    def _note(self, req: RoutedRequest, inst: Instance) -> int:
        """``inst`` gets ``req``'s prompt: its pages become that instance's most recent. Returns
        the prompt's tokens it was believed to hold before (0 without an affinity)."""
        if self.affinity is None:
            return 0
        keys = self.affinity.keys(req.prompt_token_ids)
        credit = self.affinity.credit([inst.name], keys)[inst.name]
        if credit:
            self.affinity_hits += 1
        self.affinity.note(inst.name, keys)
        return credit

    def clear_counts(self) -> None:
        """Forget the placement counts and decisions (after the warm-up requests)."""
        for path in PATHS:
            self.placements[path] = 0
        self.decisions.clear()


_ALONE_PATHS = {"decode": "local", "prefill": "kept"}  # a request alone on an instance of the role


def _remember(entries: collections.OrderedDict, request_id: str, value: object) -> None:
    """``entries[request_id] = value``, newest last, at most `PREDICTIONS_KEPT` (the oldest are
    requests that ended, or were aborted, before the entry was used)."""
    entries[request_id] = value
    entries.move_to_end(request_id)
    while len(entries) > PREDICTIONS_KEPT:
        entries.popitem(last=False)


def seed_fit(path: str | None) -> dict | None:
    """The fit of the `disagg profile` JSON at ``path`` (`router.step_profile`), or None.

    Raises:
        ConfigError: the file is missing or not a profile (the message names the setting).
    """
    if path is None:
        return None
    from disagg.cluster.simulate.profile import load_profile
    from disagg.errors import ConfigError

    try:
        return load_profile(path)["fit"]
    except ValueError as err:
        raise ConfigError(f"router.step_profile: {str(err).removeprefix('--profile: ')}") from None


def decision_record(req: RoutedRequest, decision: Decision, t: float, path: str, since_s: float) -> dict:
    """The decision that placed ``req``, as a "decision" trace record written at its first token
    (``t``: wall clock serving, the virtual clock simulated): its prompt, the path chosen and the
    one taken with the instances that computed its prompt and decode it, every candidate's predicted
    TTFT and TPOT (ms), and the first token's time since the decision (``ttft_ms``: what the chosen
    prediction's ``ttft_ms`` predicted)."""
    computing, decoder = req.colocated or req.prefill, req.colocated or req.decode
    return {"request": str(req.request_id), "t": t, "prompt_len": req.prompt_len, "chosen": decision.path,
            "path": path, "prefill": computing and computing.name, "decode": decoder and decoder.name,
            "ttft_ms": round(since_s * 1e3, 3),
            "predictions": [{"path": p.path, "prefill": p.prefill, "decode": p.decode,
                             "ttft_ms": round(p.ttft_s * 1e3, 3), "tpot_ms": round(p.tpot_s * 1e3, 3),
                             "admissible": p.admissible} for p in decision.predictions]}


def tpot_record(req: RoutedRequest, path: str, predicted_s: float, actual_s: float) -> dict:
    """The "tpot" record of a finished adaptively placed request (`Placer.finished`): the path
    taken, the TPOT its decision predicted for that path and the TPOT it had (ms)."""
    return {"request": str(req.request_id), "path": path, "num_output": req.num_output,
            "predicted_tpot_ms": round(predicted_s * 1e3, 3), "tpot_ms": round(actual_s * 1e3, 3)}
