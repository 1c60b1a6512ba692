"""A request's life, from its arrival at the router to its end: one piece of code, no I/O.

`RequestFlow` keeps a fleet's live requests and moves each through its `Stage`s as events come
in, doing the `Ledger`'s moves itself (`touch`, `advance`, `drop`: a request is in the ledger
from its placement to its end). Each event is a method; what it returns are the actions its
driver carries out: the router (`disagg.cluster.routing.router`) as Ray calls on its event loop, the
simulator (`disagg.cluster.simulate.fleet`) as calls on its virtual engines. Nothing here
calls an instance, waits, or reads a clock other than the `Placer`'s.

    event                            stage after            actions returned
    arrived(req)                     QUEUED                 -
    route(req[, decide])             RUNNING, RESERVING     Add | Reserve | Wait | End
    reserved(req, inst, dest)        RESERVING, QUEUED      Hand | Cancel, Requeue | Cancel (ended)
                                                            | as refused (inst died meanwhile)
    refused(req, inst[, error])      RESERVING, QUEUED      Reserve (the next) | Requeue | End
    handed(req)                      PREFILLING             Add(prefill, dest)
    first_token(req, inst, ...)      DECODING               Start[, End]
    tokens(req, num_tokens, ...)     -                      [End]
    end(req, reason[, error])        DONE                   Abort, ... (what it held)
    instance_died(inst, reason)      QUEUED (migrated)      per request it held: Abort..., Requeue | End
    expired(now)                     -                      (request, End) per deadline passed

A remote request: `route` -> Reserve(D1); `refused` (D1 out of pages) -> Reserve(D2);
`reserved` -> Hand(P): the `Placer` names the prefill instance as soon as D2 holds the pages;
`handed`, once D2's answer reached the router -> Add(P, dest); `first_token` from P ->
Start(D2): D2 decodes it once the KV has landed; `tokens` from D2; `end`. The router calls
`handed` at once (the reservation's answer is its event); the simulator when its virtual answer
arrives (the decode instance's step in flight, ``--reserve-ms``). A request placed alone (local,
kept, colocated): `route` -> Add(inst); `tokens` from inst; `end`. A request an instance held
when it died migrates (`disagg.cluster.routing.migration`): what it held on the survivors is
released, and it is routed again with the tokens it streamed as part of its prompt.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Any

from disagg.cluster.launch.instance import Instance
from disagg.cluster.routing import migration
from disagg.cluster.routing.placement.placer import Alone, Decide, Fail, Placer, Wait
from disagg.cluster.routing.requests import RoutedRequest, Stage
from disagg.config import RouterSection
from disagg.errors import DisaggError, InstanceDied, RequestTimedOut, SignalTimeout

FAILED = ("abort", "error")  # end reasons that are not a finish: the placer hears no `finished`


@dataclass(frozen=True)
class Reserve:
    """Reserve the request's pages (its prompt's and its answer's) on ``instance``; its answer
    is `RequestFlow.reserved` or `RequestFlow.refused`."""

    instance: Instance


@dataclass(frozen=True)
class Hand:
    """``instance`` computes the prompt: once the reservation's answer reached the router,
    `RequestFlow.handed`."""

    instance: Instance


@dataclass(frozen=True)
class Add:
    """Give the prompt to ``instance``. With ``dest`` (the decode reservation) it computes the
    prompt and pushes its KV there; without, it computes and decodes it. ``path``: the placement
    path, "remote", "local", "kept" or "colocated"."""

    instance: Instance
    dest: Any
    path: str


@dataclass(frozen=True)
class Start:
    """Tell ``instance``, the decode instance, the first token: it decodes the request once its
    KV has landed (and frees the reservation then, if that token ended it)."""

    instance: Instance


@dataclass(frozen=True)
class Cancel:
    """Free the reservation ``dest`` on ``instance`` now: no push will land in it."""

    instance: Instance
    dest: Any


@dataclass(frozen=True)
class Abort:
    """Release the request on ``instance``. ``quiesced``, for a prefill instance: carried out
    when its abort answers `PushState.QUIESCED` (no push of the request can land anymore).
    ``engine_id``: the id the engine knows the placement by when it is no longer the request's
    (`RoutedRequest.engine_id`: a placement left behind by a migration); None: the request's."""

    instance: Instance
    quiesced: Cancel | None = None
    engine_id: Hashable | None = None


@dataclass(frozen=True)
class Requeue:
    """Back at the queue head. ``wait``: every decode instance of the route refused the pages,
    and it waits for a change (`WAIT_PAGES`) before it is routed again; False: routed again at
    once (migrated off a dead instance)."""

    wait: bool = True


@dataclass(frozen=True)
class End:
    """End the request through the driver's end (which calls `RequestFlow.end`).

    Attributes:
        reason: the finish reason ("stop", "length"), "abort" or "error".
        error: the typed cause; None for a finish or a caller's abort.
        release: False when the engines ended it themselves: nothing to release.
    """

    reason: str
    error: DisaggError | None = None
    release: bool = True


Action = Reserve | Hand | Add | Start | Cancel | Abort | Requeue | End | Wait


class RequestFlow:
    """The live requests of one fleet and their moves (module docstring).

    Args:
        placer: the fleet's `Placer`, built with ``tracked=True``: its `Ledger` is kept here.
        settings: the router section: ``lease_s`` and ``request_timeout_s`` are read from it as
            they are needed (a driver may replace it).

    Attributes:
        live: request id -> every request not ended, queued ones too.
        placed: request id -> the live requests that were placed: those the ledger counts.
        ledger: the placer's `Ledger`.
    """

    def __init__(self, placer: Placer, settings: RouterSection) -> None:
        if placer.ledger is None:
            raise ValueError("placer: expected a Placer built with tracked=True (the flow keeps its ledger), "
                             "got one without a ledger")
        self.placer, self.ledger, self.settings = placer, placer.ledger, settings
        self.live: dict[Any, RoutedRequest] = {}
        self.placed: dict[Any, RoutedRequest] = {}
        self._untried: dict[Any, collections.deque[Instance]] = {}  # a route's decodes not yet asked

    # ------------------------------------------------------------------ entry and placement
    def arrived(self, req: RoutedRequest) -> None:
        """``req`` reached the router: live and queued (in no sum until it is placed), with its
        deadline (``request_timeout_s``) from now."""
        self.live[req.request_id] = req
        req.stage = Stage.QUEUED
        timeout_s = self.settings.request_timeout_s
        if timeout_s is not None:
            req.deadline = self.placer.clock() + timeout_s

    def route(self, req: RoutedRequest, decide: Decide | None = None) -> tuple[Action, ...]:
        """Place ``req`` now (`Placer.route`; ``decide``: the adaptive decision's hook).

        Returns:
            (`Wait`,): it stays at the queue head; (`End`,): no live instance can take it;
            (`Add`,): one instance computes and decodes it (RUNNING); (`Reserve`,): its pages
            are reserved on the route's first decode instance (RESERVING).
        """
        route = self.placer.route(req, self.placed.values(), decide)
        if isinstance(route, Wait):
            return (route,)
        if isinstance(route, Fail):
            return (End("error", route.error()),)
        if isinstance(route, Alone):
            req.colocated, req.stage = route.instance, Stage.RUNNING
            self._place(req)
            return (Add(route.instance, None, route.path),)
        req.stage = Stage.RESERVING  # its prompt queued on no prefill instance yet: `queued_prompt`
        self._place(req)
        first, *rest = route.decodes
        self._untried[req.request_id] = collections.deque(rest)
        return (Reserve(first),)

    def reserved(self, req: RoutedRequest, inst: Instance, dest: Any) -> tuple[Action, ...]:
        """``inst`` reserved ``req``'s pages at ``dest``: it decodes ``req``, and the `Placer`
        names the prefill instance (`Placer.hand`), which gets the prompt at `handed`.

        Returns:
            (`Hand`,); (`Cancel`, `Requeue`) when no prefill instance is alive any more (QUEUED
            again, out of the ledger: routed again, it takes the survivors' path,
            `degraded_path`); (`Cancel`,) when ``req`` ended while reserving (``dest`` never left
            the driver); what `refused` returns when ``inst`` died while its answer was on its
            way (``dest`` is never handed on).
        """
        if not inst.alive and not req.done:
            # Answered, then taken out of service before the answer was heard (dead, or swapped
            # for a rebuilt fleet's instance of the same name, `Router.adopt`): its pages died
            # with it, and ``dest`` may name pages of a live successor that nobody reserved.
            return self.refused(req, inst)
        self._untried.pop(req.request_id, None)
        if req.done:
            return (Cancel(inst, dest),)
        req.decode, req.dest = inst, dest
        prefill = self.placer.hand(req, inst, self.placed.values())
        if prefill is None:
            req.decode = req.dest = None
            req.stale_end = inst  # the cancel's "abort" output there ends no later placement
            req.stage = Stage.QUEUED
            self._unplace(req)
            return Cancel(inst, dest), Requeue()
        req.prefill = prefill
        self.ledger.touch(req)
        return (Hand(prefill),)

    def refused(self, req: RoutedRequest, inst: Instance, error: DisaggError | None = None) -> tuple[Action, ...]:
        """``inst`` did not take ``req``.

        Args:
            error: None while reserving: ``inst`` was out of pages or dead, and the route's next
                decode instance is asked. Otherwise why ``inst`` refused ``req`` for good (its
                reservation while reserving, else its prompt: `Add` failed).

        Returns:
            (`Reserve`,) of the next decode instance; (`Requeue`,) when none is left (QUEUED
            again, out of the ledger); (`End`,) with ``error``, and `Cancel` of the decode
            reservation when a refused prompt had one; () when ``req`` ended already.
        """
        if req.done:
            return ()
        if req.stage == Stage.RESERVING:
            untried = self._untried.get(req.request_id)
            if error is None and untried:
                return (Reserve(untried.popleft()),)
            self._untried.pop(req.request_id, None)
            if error is not None:
                return (End("error", error, release=False),)
            req.stage = Stage.QUEUED
            self._unplace(req)
            return (Requeue(),)
        if error is None:
            raise ValueError(f"request {req.request_id!r}: a refused prompt needs its error, got None")
        if req.dest is not None:  # the prefill instance never took it: no push lands in D's pages
            return End("error", error, release=False), Cancel(req.decode, req.dest)
        return (End("error", error),)

    def handed(self, req: RoutedRequest) -> tuple[Action, ...]:
        """The reservation's answer reached the router: the prompt goes to the prefill instance
        `reserved` named (PREFILLING; its lease, ``lease_s``, starts). () when ``req`` ended."""
        if req.done:
            return ()
        self.placer.reserved(req)
        req.stage = Stage.PREFILLING
        req.lease_deadline = self.placer.clock() + self.settings.lease_s
        self.ledger.touch(req)
        return (Add(req.prefill, req.dest, "remote"),)

    # ------------------------------------------------------------------ outputs
    def first_token(self, req: RoutedRequest, inst: Instance, finished: str | None = None,
                    relay_s: float | None = None) -> tuple[Action, ...]:
        """``inst``, the prefill instance, computed ``req``'s prompt: its first token came
        (DECODING; its lease is over).

        Args:
            finished: the finish reason when that token ended ``req``, else None.
            relay_s: seconds from the step that made the token to its arrival (`Placer.first_token`).

        Returns:
            (`Start`,), then `End` when ``finished``; () when ``req`` is not prefilling on ``inst``.
        """
        if req.stage != Stage.PREFILLING or inst is not req.prefill:
            return ()
        self.placer.first_token(req, relay_s)
        req.lease_deadline = None
        req.stage = Stage.DECODING
        req.num_output += 1
        self.ledger.touch(req)
        if finished:
            return Start(req.decode), End(finished, release=False)
        return (Start(req.decode),)

    def tokens(self, req: RoutedRequest, num_tokens: int, finished: str | None = None,
               relay_s: float | None = None) -> tuple[Action, ...]:
        """``req``'s decode instance (or the one instance it runs on) produced ``num_tokens``
        more tokens; the first of them may be its first token (`Placer.first_token`, ``relay_s``).
        A decode instance's token means its KV landed (`RoutedRequest.holders`: the prefill instance
        let it go).

        Returns:
            (`End`,) when ``finished`` (the finish reason of the last token), else ().
        """
        if req.done or num_tokens <= 0:
            return ()
        first = req.num_output == 0
        if first:
            self.placer.first_token(req, relay_s)
        req.kv_landed = True
        req.num_output += num_tokens
        if finished:
            return (End(finished, release=False),)
        if first:  # its prompt computed: it decodes there from now on
            self.ledger.touch(req)
        else:
            self.ledger.advance(req, num_tokens)
        return ()

    # ------------------------------------------------------------------ endings
    def end(self, req: RoutedRequest, reason: str, error: DisaggError | None = None,
            release: bool = True) -> tuple[Action, ...]:
        """``req`` ended (DONE): out of the live requests and the ledger; a finish (``reason``
        not in `FAILED`) reaches the placer (`Placer.finished`).

        Returns:
            With ``release``, what frees what it held on the live instances: on the decode and
            the prefill instance while prefilling (the prefill instance's `Abort` frees the
            reservation once no push can land: ``quiesced``), on the decode instance while
            decoding, on its one instance while running; () when ``req`` ended already.
        """
        if req.done:
            return ()
        stage, req.stage = req.stage, Stage.DONE
        if self.live.get(req.request_id) is req:
            del self.live[req.request_id]
        self._unplace(req)
        self._untried.pop(req.request_id, None)
        if reason not in FAILED:
            self.placer.finished(req)
        return _releases(req, stage) if release else ()

    def instance_died(self, inst: Instance, reason: str) -> list[tuple[RoutedRequest, tuple[Action, ...]]]:
        """``inst`` died: it is never routed to again, and every request it holds
        (`RoutedRequest.holders`) migrates (`disagg.cluster.routing.migration`): what it holds on
        the live instances is released under its old engine id, and it is QUEUED again, out of
        the ledger, with the tokens it streamed in its prompt. It fails with `InstanceDied`
        instead once it migrated `MAX_MIGRATIONS` times, or when no instance is left to serve it
        and no replacement is on its way (`Placer.restarting`).

        Returns:
            Per request it held, newest first (each requeued at the head, they keep their
            order): (`Abort`..., `Requeue` not waiting), or (`End`,). [] when it was dead already.
        """
        if not inst.alive:
            return []
        inst.alive, inst.error = False, reason
        message = f"{inst.label()} died: {reason}"
        serving = bool(self.placer.restarting) or any(other.alive for other in self.placer.instances)
        out: list[tuple[RoutedRequest, tuple[Action, ...]]] = []
        for req in reversed(holders_of(list(self.live.values()), inst)):
            if not (serving and migration.can_migrate(req)):
                out.append((req, (End("error", InstanceDied(message, instance=inst.name, reason=reason)),)))
                continue
            releases = tuple(Abort(a.instance, a.quiesced, req.engine_id) for a in _releases(req, req.stage))
            self._unplace(req)
            self._untried.pop(req.request_id, None)
            migration.resume(req)
            out.append((req, (*releases, Requeue(wait=False))))
        return out

    def expired(self, now: float) -> list[tuple[RoutedRequest, End]]:
        """The requests past a deadline at ``now`` (the placer's clock): aborted past
        ``request_timeout_s``; failed when a prefill's KV did not land within ``lease_s``."""
        out = []
        for req in self.live.values():
            if req.deadline is not None and now > req.deadline:
                limit = self.settings.request_timeout_s
                out.append((req, End("abort", RequestTimedOut(
                    f"timed out after {limit} s (router.request_timeout_s) while {req.stage}",
                    timeout_s=limit, stage=str(req.stage)))))
            elif req.lease_deadline is not None and now > req.lease_deadline and req.stage == Stage.PREFILLING:
                out.append((req, End("error", SignalTimeout(
                    f"its KV did not land within router.lease_s = {self.settings.lease_s} s ({req.prefill.name} -> "
                    f"{req.decode.name}); decode pages released", request_id=req.request_id,
                    src_pe=req.prefill.pe, dst_pe=req.decode.pe))))
        return out

    # ------------------------------------------------------------------ the ledger
    def audit(self) -> str | None:
        """The first of the ledger's sums that is not the one over the placed requests
        (`Ledger.audit`), as a sentence; None when all are."""
        return self.ledger.audit(self.placed.values(), self.placer.clock())

    def check(self) -> None:
        """Assert that the ledger's sums are those over the placed requests (`Ledger.check`)."""
        self.ledger.check(self.placed.values(), self.placer.clock())

    def rebuild(self) -> None:
        """Take the placed requests' shares again (after an `audit` found a move not made)."""
        self.ledger.rebuild(self.placed.values())

    def _place(self, req: RoutedRequest) -> None:
        self.placed[req.request_id] = req
        self.ledger.touch(req)

    def _unplace(self, req: RoutedRequest) -> None:
        if self.placed.get(req.request_id) is req:
            del self.placed[req.request_id]
            self.ledger.drop(req)


def _releases(req: RoutedRequest, stage: Stage) -> tuple[Action, ...]:
    """What frees what ``req`` held on the live instances when it left ``stage`` (`RequestFlow.end`)."""
    if stage == Stage.PREFILLING:
        decode, prefill = req.decode, req.prefill
        out = [Abort(decode)] if decode.alive else []
        if prefill.alive:
            out.append(Abort(prefill, Cancel(decode, req.dest)))
        return tuple(out)
    inst = req.decode if stage == Stage.DECODING else req.colocated if stage == Stage.RUNNING else None
    return (Abort(inst),) if inst is not None and inst.alive else ()


def holders_of(requests: Collection[RoutedRequest], inst: Instance) -> list[RoutedRequest]:
    """The ``requests`` whose life ``inst`` takes part in (`RoutedRequest.holders`)."""
    return [req for req in requests if any(holder is inst for holder in req.holders())]
