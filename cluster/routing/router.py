"""The router: where a request enters the fleet, gets its pages, and streams back.

Disaggregated: a FIFO queue feeds one dispatcher; for the head request it reserves pages on the
least-loaded live decode instance D (`dest = D.reserve(...)`, beside the dispatch of the
requests behind it; OutOfPages on every D -> back to the queue head to wait for pages to free),
hands the prompt to the least-loaded prefill instance P (`P.add(req, dest)`), and when P's first
token arrives calls `D.start(req, first)`; D's tokens follow. Colocated: each request goes
straight to the least-loaded colocated instance. `router.placement` local sends every request to
the least-loaded decode instance to prefill and decode itself; adaptive decides per request
(`disagg.cluster.routing.placement`): remote (the path above), local, or kept (a prefill instance
prefills and decodes it); local and kept requests are, from here on, colocated requests on that
instance. Each request's life (routed, reserved, refused, handed, first token, tokens, ended,
an instance's death, a deadline) is the `RequestFlow`'s (`disagg.cluster.routing.flow`, which the
simulator drives too; it asks the `Placer` which instances, in which order, and when to wait,
and keeps the `Ledger`): the router maps its actions to actor calls (`_act`) and the answers and
failures of those calls back to its events. One poller per instance keeps one `next_outputs` call
outstanding and fans each batch out per request; a watchdog enforces `lease_s` (first token
never came: fail, release D's pages) and `request_timeout_s`. Aborts release pages on both
sides. D's reservation is freed at once (`cancel_reservation`) whenever no push can land in it:
P refused the request or never got it, or P's abort answered `PushState.QUIESCED` (at once, or
once its in-flight pushes completed); else D quarantines it until the ring or its lease (a dead
or silent P). An instance that dies is never routed to again; the requests it holds
(`RoutedRequest.holders`: P and D until D produced a token, then D alone) migrate: routed again
with the tokens they streamed in their prompt (`disagg.cluster.routing.migration`, each placement
under its own engine id), up to a bound, then fail `InstanceDied`. A death also schedules the
fleet's rebuild (`cluster.rebuild`, `disagg.cluster.routing.rebuild`): the dispatcher holds the
queue while the old fleet drains and a fresh one starts, `adopt` swaps it in. An abort that arrives
before its request's submit is remembered (`EARLY_ABORT_TTL_S`, `MAX_REMEMBERED_IDS`) and ends
that request at its submit. Failures are typed (`disagg.errors`): `submit` raises `QueueFull`; a
request that ends badly carries `NoLiveInstance`, `InstanceDied`, `RequestRefused`,
`RequestTimedOut`, `SignalTimeout` (lease) or `TransferError` (a landed push whose digest did
not match, `transfer.verify`) as its last delta's ``cause``.
Runs on one asyncio loop in the launching process (see `disagg.cluster.cluster`); callbacks to
callers go through each request's sink. The whole path, file by file: docs/ARCHITECTURE.md §7.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import ray

from disagg import trace
from disagg.cluster.launch.bootstrap import Fleet, Instance, start_replacement
from disagg.cluster.outputs import RequestMetrics, StreamDelta
from disagg.cluster.routing.affinity import prefix_affinity, smallest_cache_pages
from disagg.cluster.routing.call_errors import cause_of, death_reason, engine_ended_error, failure_reason, refusal_error
from disagg.cluster.routing.flow import Abort, Action, Add, Cancel, End, Hand, RequestFlow, Requeue, Reserve, Start
from disagg.cluster.routing.migration import request_of
from disagg.cluster.routing.placement import Decision
from disagg.cluster.routing.placement.placer import Placer, Wait
from disagg.cluster.routing.rebuild import Rebuilder, Starting
from disagg.cluster.routing.restart import Restarter
from disagg.cluster.routing.requests import Picker, RecentIds, RoutedRequest, Sink, Stage
from disagg.config import RouterSection
from disagg.engine.request import PushState
from disagg.errors import ClusterError, DisaggError, NoLiveInstance, OutOfPages, QueueFull

logger = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.05   # how often deadlines and leases are checked
PAGES_RETRY_S = 0.2        # out of pages everywhere: retry the queue head at least this often
# How often the watchdog audits the ledger against the placed requests (`Ledger.audit`: O(live),
# ~4 ms at 1,000 live requests, `benchmarks/bench_placement.py`); a move the flow failed to make
# is logged and the ledger rebuilt.
LEDGER_AUDIT_S = 10.0
# An abort for an id the router has not seen waits this long for that id's submit (the caller's
# abort may overtake it on the way to the router's loop); the first submit with the id consumes it.
EARLY_ABORT_TTL_S = 30.0
MAX_REMEMBERED_IDS = 4096  # early aborts kept at most; ended ids are kept 4 times as many


class Router:
    """Routes requests over a fleet; every method runs on the router's event loop.

    Args:
        fleet: the started fleet (`disagg.cluster.launch.bootstrap.start_fleet`).
    """

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        config = fleet.config
        self.queue: collections.deque[RoutedRequest] = collections.deque()
        self.picker = Picker(config.router.policy, config.scheduler.max_num_seqs)
        self.counts: collections.Counter[str] = collections.Counter()
        self.aborts: collections.Counter[str] = collections.Counter()    # by `failure_reason`
        self.failures: collections.Counter[str] = collections.Counter()  # by `failure_reason`
        self.early_aborts = RecentIds(MAX_REMEMBERED_IDS, EARLY_ABORT_TTL_S)
        # An abort of one of these came after its request ended: it must not wait for a submit.
        self.ended_ids = RecentIds(4 * MAX_REMEMBERED_IDS)
        self.placer = Placer(config, fleet.instances, self.picker, prefix_affinity(config, smallest_cache_pages(fleet)),
                             tracked=True)
        # each request's life (`disagg.cluster.routing.flow`), which keeps the placement's sums (`Ledger`):
        # this module maps its actions to actor calls
        self.flow = RequestFlow(self.placer, config.router)
        self.requests: dict[str, RoutedRequest] = self.flow.live  # the live requests, by id
        self.ledger = self.placer.ledger
        self.ledger_rebuilds = 0  # audits that found the ledger out of step (`_audit_ledger`)
        restart = config.cluster  # dead instances replaced (`cluster.restart`); what no one can serve waits
        self.restarter = Restarter(lambda dead, name: start_replacement(fleet, dead, name), restart.restart_backoff_s,
                                   restart.restart_limit) if restart.restart else None
        # the whole data plane restarted into one new heap after a death (`cluster.rebuild`): a
        # prefill + decode fleet's way back to full strength
        self.rebuilder = Rebuilder(self, fleet, restart, self.restarter.cancel) if (
            self.restarter is not None and restart.rebuild and config.mode == "disaggregated") else None
        self.placer.restarting = Starting(self.restarter.pending, self.rebuilder, fleet.instances) if (
            self.restarter is not None) else ()
        self._tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._refused: RoutedRequest | None = None  # back at the queue head: every decode instance refused it
        self._stopping = False

    @property
    def settings(self) -> RouterSection:
        """The router section in force (the flow's: its timeouts and leases read it)."""
        return self.flow.settings

    @settings.setter
    def settings(self, settings: RouterSection) -> None:
        self.flow.settings = settings

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        """Start the pollers, the dispatcher (colocated too: requests wait there for a replacement), the watchdog."""
        self._wake = asyncio.Event()
        for inst in self.fleet.instances:
            self._spawn(self._poll(inst))
        self._spawn(self._dispatch_loop())
        self._spawn(self._watchdog())

    async def stop(self) -> None:
        """Abort every live request and stop the router's tasks."""
        self._stopping = True
        if self.restarter is not None:
            self.restarter.stopped = True
        if self.rebuilder is not None:
            self.rebuilder.stopped = True
        for req in list(self.requests.values()):
            self._end(req, "abort", NoLiveInstance("the cluster is shutting down"))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ entry
    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any, sink: Sink) -> None:
        """Accept a request; its deltas go to ``sink`` on this loop.

        Raises:
            ValueError: duplicate live id, empty prompt, or prompt + max_tokens over max_model_len.
            QueueFull: the router's queue is full (router.max_queue).
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight; ids must be unique")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        max_tokens = int(getattr(params, "max_tokens", 0) or 0)
        limit = self.fleet.sizing.max_model_len
        if len(prompt_token_ids) + max_tokens > limit:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({max_tokens}) exceeds max_model_len ({limit} tokens)")
        if self.early_aborts.pop(request_id):
            self._abort_at_submit(request_id, prompt_token_ids, params, sink)
            return
        if len(self.queue) >= self.settings.max_queue:
            raise QueueFull(f"the router's queue is full ({self.settings.max_queue} requests waiting for a "
                               "prefill slot or decode pages, router.max_queue); retry later")
        req = RoutedRequest(request_id, list(prompt_token_ids), params, sink, RequestMetrics(arrival_time=time.time()))
        self.flow.arrived(req)
        trace.event("submit", request_id)
        self.counts["submitted"] += 1
        self.ended_ids.pop(request_id)  # a new life of the id: its aborts are this request's
        if self.fleet.config.mode == "colocated" and not self.queue:
            self._place_colocated(req)
        else:
            self.queue.append(req)
            self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Abort a live request at whatever stage; False when it is not live.

        An abort for an id that is not live and did not end recently is remembered for
        `EARLY_ABORT_TTL_S`: the first `submit` with that id consumes it, and that request ends
        as aborted before anything reaches an engine. An abort for an id that ended recently
        (the last `4 * MAX_REMEMBERED_IDS` ends) is late and dropped, so a later request reusing
        the id is not hit; the cost: an abort that overtakes the submit of such a reused id is
        lost (`Cluster` sends submits and aborts in order, so only one sent before `stream`
        began can overtake).
        """
        req = self.requests.get(request_id)
        if req is None:
            if request_id not in self.ended_ids:
                self.early_aborts.add(request_id)
            return False
        self._end(req, "abort")
        return True

    def _abort_at_submit(self, request_id: str, prompt_token_ids: list[int], params: Any, sink: Sink) -> None:
        """End a request whose abort came before its submit: one aborted delta, no engine call."""
        req = RoutedRequest(request_id, list(prompt_token_ids), params, sink, RequestMetrics(arrival_time=time.time()))
        self.flow.arrived(req)
        self.counts["submitted"] += 1
        self._end(req, "abort")

    # ------------------------------------------------------------------ placement
    def _place_colocated(self, req: RoutedRequest) -> None:
        """Place ``req`` now, or queue it while no instance lives and a replacement is on its way."""
        actions = self.flow.route(req)
        if isinstance(actions[0], Wait):
            self.queue.append(req)
            self._wake.set()
        else:
            self._act(req, actions)

    async def _dispatch_loop(self) -> None:
        """Place queued requests in order; when the head cannot go yet, wait for a change (or retry)."""
        while not self._stopping:
            if not self.queue or self.rebuilder is not None and self.rebuilder.holds:
                self._wake.clear()
                await self._wake.wait()
                continue
            req = self.queue[0]
            if self._refused is not req and (req.done or await self._place(req)):
                if self.queue and self.queue[0] is req:
                    self.queue.popleft()
                continue
            self._refused = None  # a head every decode instance refused waits for a change first
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), PAGES_RETRY_S)
            except asyncio.TimeoutError:
                pass

    async def _place(self, req: RoutedRequest) -> bool:
        """Carry out the flow's route for the queue head (`RequestFlow.route`).

        Returns False (the request stays at the queue head) when it says wait: every prefill
        instance already has ``prefill_queue_tokens`` queued, or no decode instance has the
        pages (decode pages are reserved only when a prefill instance can start on the prompt
        soon, so a lease measures the push, not the queue). A remote request leaves the queue
        while it reserves (`_reserve`); refused everywhere, it comes back to the head.
        """
        actions = self.flow.route(req, self._decide)
        if isinstance(actions[0], Wait):
            return False
        self._act(req, actions)
        return True

    async def _reserve(self, req: RoutedRequest, inst: Instance) -> None:
        """Reserve ``req``'s pages on ``inst`` (the flow's `Reserve`) and act on the answer: the
        prompt goes to a prefill instance, or the next decode instance is asked, or, every one
        refusing, it goes back to the queue head, which then waits for a change (pages freed, a
        request ended) before it is routed again."""
        if req.done:  # aborted or timed out before this call went out
            return
        try:
            dest = await inst.actor.reserve.remote(req.engine_id, req.prompt_len, req.params, req.prompt_token_ids)
        except ray.exceptions.RayActorError as err:
            self._instance_died(inst, death_reason(err))
            actions = self.flow.refused(req, inst)
        except ray.exceptions.RayTaskError as err:
            cause = cause_of(err)
            refusal = None if isinstance(cause, OutOfPages) else refusal_error(
                inst, f"{inst.name} refused the request: {cause}", cause)
            actions = self.flow.refused(req, inst, refusal)
        else:
            if not req.done:
                trace.event("reserved", req.request_id, instance=inst.name)
            actions = self.flow.reserved(req, inst, dest)
        self._act(req, actions)

    def _decide(self, req: RoutedRequest, prefills: list[Instance], decodes: list[Instance],
                live: list[RoutedRequest]) -> Decision:
        """The adaptive placement's choice for ``req`` (`Placer.decide`; tests replace this hook)."""
        return self.placer.decide(req, prefills, decodes, live)

    def _act(self, req: RoutedRequest, actions: tuple[Action, ...], tokens: list[int] = (),
             times: list[float] = ()) -> None:
        """Carry out the flow's ``actions`` for ``req`` as actor calls, in order; ``tokens`` and
        ``times`` are the event's (a `Start` sends the first of them, an `End` emits them)."""
        for action in actions:
            if isinstance(action, Add):
                self._add(req, action)
            elif isinstance(action, Reserve):
                # The reservation's round trip (D answers between its steps) runs beside the
                # dispatch: the requests behind it are placed meanwhile, as the simulator places
                # them. Awaited here, it would hold every later request (local and kept too) at
                # the queue.
                self._spawn(self._reserve(req, action.instance))
            elif isinstance(action, Hand):  # the reservation's answer is this event
                self._act(req, self.flow.handed(req))
            elif isinstance(action, Start):
                ref = action.instance.actor.start.remote(req.engine_id, tokens[0])
                self._spawn(self._await(action.instance, ref, "start", req, req.engine_id))
            elif isinstance(action, Cancel):
                self._cancel_on(action.instance, action.dest)
            elif isinstance(action, Abort):
                self._abort_on(req, action)
            elif isinstance(action, Requeue):
                self.queue.appendleft(req)
                if action.wait:  # every decode instance refused it: the head waits for a change
                    self._refused = req
                self._wake.set()
            elif isinstance(action, End):
                self._end(req, action.reason, action.error, tokens=tokens, times=times, release=action.release)
            else:
                raise AssertionError(f"request {req.request_id}: the router has no call for {action}")

    def _add(self, req: RoutedRequest, add: Add) -> None:
        """Give ``req``'s prompt to ``add.instance``: with the decode reservation (remote), or
        to compute and decode it (colocated, local, kept: from here a colocated request there)."""
        inst = add.instance
        req.metrics.dispatch_time = time.time()
        req.metrics.prefill_instance = inst.name
        req.metrics.decode_instance = inst.name if add.dest is None else req.decode.name
        trace.event("placed", req.request_id, path=add.path, instance=inst.name)
        dest = () if add.dest is None else (add.dest,)
        ref = inst.actor.add.remote(req.engine_id, req.prompt_token_ids, req.params, *dest)
        self._spawn(self._await(inst, ref, "add", req, req.engine_id))

    async def _await(self, inst: Instance, ref: Any, what: str, req: RoutedRequest | None,
                     engine_id: Any = None) -> None:
        """Await an actor call made for ``req``'s placement ``engine_id`` (None: a release; its
        failures, and those of a placement ``req`` migrated away from, are only logged)."""
        try:
            await ref
        except ray.exceptions.RayActorError as err:
            self._instance_died(inst, death_reason(err))
        except ray.exceptions.RayTaskError as err:
            if req is not None and not req.done and req.engine_id == engine_id:
                if what == "add":  # the engine checks the prompt there
                    cause = cause_of(err)
                    refusal = refusal_error(inst, f"{inst.name}.add failed: {cause}", cause)
                    self._act(req, self.flow.refused(req, inst, refusal))
                else:
                    self._end(req, "error", ClusterError(f"{inst.name}.{what} failed: {cause_of(err)}"))
            else:
                logger.debug("%s.%s failed: %s", inst.name, what, cause_of(err))

    # ------------------------------------------------------------------ outputs
    async def _poll(self, inst: Instance) -> None:
        """Keep one next_outputs call outstanding on ``inst``; fan each batch out per request."""
        while inst.alive and not self._stopping:
            try:
                batch = await inst.actor.next_outputs.remote(self.settings.poll_wait_s)
            except ray.exceptions.RayActorError as err:
                self._instance_died(inst, death_reason(err))
                return
            except ray.exceptions.RayTaskError as err:
                self._instance_died(inst, f"next_outputs failed: {cause_of(err)}")
                return
            self.placer.fleet_model.observe(inst.name, batch.steps, batch.load)
            if batch.outputs:
                self._on_rows(inst, batch.outputs)
            if batch.fatal:
                self._instance_died(inst, "its engine failed: " + batch.fatal.strip().splitlines()[-1])
                return

    def _on_rows(self, inst: Instance, rows: list[tuple]) -> None:
        by_request: dict[Any, list[tuple]] = collections.defaultdict(list)
        for row in rows:
            by_request[row[0]].append(row)
        for engine_id, own in by_request.items():
            req = request_of(self.requests, engine_id)
            if req is None or all(holder is not inst for holder in req.holders()):
                continue  # ended already (abort, timeout, failure): late outputs are dropped
            if inst is req.colocated:  # colocated, or placed local / kept: every token comes from it
                self._on_tokens(req, inst, own)
            elif inst.role == "prefill":
                self._on_first_token(req, inst, own[0])
            elif inst is req.decode:
                self._on_tokens(req, inst, own)

    def _on_first_token(self, req: RoutedRequest, inst: Instance, row: tuple) -> None:
        _, token_id, finished, reason, error, emit_time = row
        if req.stage != Stage.PREFILLING or inst is not req.prefill:
            return
        if token_id is None:  # the prefill engine ended it (abort, error)
            self._end(req, "error", ClusterError(error or f"{inst.name} ended the prefill (finish_reason {reason})"))
            return
        if not req.output_token_ids:
            trace.event("first_token", req.request_id)
        # The decode side learns the first token even when it ends the request (`Start`): it then
        # frees the reservation once its KV has landed (or its lease closes).
        actions = self.flow.first_token(req, inst, (reason or "stop") if finished else None, time.time() - emit_time)
        self._wake.set()  # the prefill queue shrank: the queue head may go now
        self._act(req, actions, [token_id], [emit_time])
        if not finished:
            self._emit(req, StreamDelta(req.request_id, [token_id], [emit_time]))

    def _on_tokens(self, req: RoutedRequest, inst: Instance, rows: list[tuple]) -> None:
        tokens, times, finish, ended = [], [], None, None
        for _, token_id, finished, reason, error, emit_time in rows:
            if token_id is None and reason == "abort" and req.stale_end is inst:  # its cancelled reservation's
                req.stale_end = None
                continue
            if token_id is None:  # the engine ended it without a token (abort, error, lease expiry)
                ended = End("error", engine_ended_error(req, inst, reason, error), release=False)
                break
            tokens.append(token_id)
            times.append(emit_time)
            if finished:
                finish = reason or "stop"
                break
        if tokens and not req.output_token_ids:  # the caller's first (a migrated request's came before)
            trace.event("first_token", req.request_id)
        relay_s = time.time() - times[0] if tokens else None  # since its emit_time
        actions = self.flow.tokens(req, len(tokens), finish, relay_s) + ((ended,) if ended is not None else ())
        if actions:
            self._act(req, actions, tokens, times)
        elif tokens:
            self._emit(req, StreamDelta(req.request_id, tokens, times))

    # ------------------------------------------------------------------ endings
    def _end(self, req: RoutedRequest, reason: str, error: DisaggError | None = None, *, tokens: list[int] = (),
             times: list[float] = (), release: bool = True) -> None:
        """Finish ``req`` once (`RequestFlow.end`): release what it holds (unless its engine
        already did), tell the sink its last ``tokens``.

        ``error`` (None for a caller's abort or a normal finish) reaches the caller as the delta's
        ``error`` text and, typed, as its ``cause``; aborts and failures are counted by its type.
        """
        if req.done:
            return
        queued = req.stage == Stage.QUEUED
        releases = self.flow.end(req, reason, error, release)
        self.ended_ids.add(req.request_id)
        if queued and req in self.queue:
            self.queue.remove(req)
        self._act(req, releases)
        req.metrics.finished_time = time.time()
        self.counts[reason] += 1
        if reason == "abort":
            self.aborts[failure_reason(error)] += 1
        elif reason == "error":
            self.failures[failure_reason(error)] += 1
        if error is not None:
            logger.info("request %s: %s: %s", req.request_id, reason, error)
        self._emit(req, StreamDelta(req.request_id, list(tokens), list(times), True, reason,
                                    None if error is None else str(error), error))
        if self._wake is not None:
            self._wake.set()  # pages may have been freed: retry the queue head

    def _abort_on(self, req: RoutedRequest, abort: Abort) -> None:
        """Release ``req`` on ``abort.instance`` (submitted now: after any earlier call for it). A
        prefill instance's abort (``quiesced``) frees the decode reservation at once when it
        answers that no push of the request can land anymore; else D's lease is the safety net."""
        ref = abort.instance.actor.abort.remote(req.engine_id if abort.engine_id is None else abort.engine_id)
        if abort.quiesced is None:
            self._spawn(self._await(abort.instance, ref, "abort", None))
        else:
            self._spawn(self._cancel_when_quiesced(abort.instance, ref, abort.quiesced))

    async def _cancel_when_quiesced(self, prefill: Instance, ref: Any, cancel: Cancel) -> None:
        """Await P's abort (one call per abort); QUIESCED -> free D's reservation now (``cancel``).
        None (P does not have it: its ring or D's lease ends the quarantine) or a failure -> nothing."""
        try:
            state = await ref
        except ray.exceptions.RayActorError as err:
            self._instance_died(prefill, death_reason(err))
            return
        except ray.exceptions.RayTaskError as err:
            logger.debug("%s.abort failed: %s", prefill.name, cause_of(err))
            return
        if state == PushState.QUIESCED:
            self._cancel_on(cancel.instance, cancel.dest)

    def _cancel_on(self, decode: Instance, dest: Any) -> None:
        """Free D's reservation ``dest`` now: the caller knows that no push will land in it."""
        if decode.alive:
            ref = decode.actor.cancel_reservation.remote(dest)
            self._spawn(self._await(decode, ref, "cancel_reservation", None))

    def _emit(self, req: RoutedRequest, delta: StreamDelta) -> None:
        metrics = req.metrics
        if delta.emit_times and metrics.first_token_time is None:
            metrics.first_token_time = delta.emit_times[0]
        metrics.token_times.extend(delta.emit_times)
        req.output_token_ids.extend(delta.token_ids)  # what a migration resumes from
        try:
            req.sink(delta, metrics if delta.finished else None)
        except Exception:  # a caller that went away must not stop the router
            logger.exception("request %s: the sink raised; aborting the request", req.request_id)
            if not delta.finished:
                self._end(req, "abort", ClusterError("the caller's sink raised"))

    def _instance_died(self, inst: Instance, reason: str) -> None:
        """Never route to ``inst`` again; the requests it holds migrate, or fail past the bound
        (`RequestFlow.instance_died`), their other side released; the others go on."""
        if not inst.alive:
            return
        logger.error("%s is dead: %s", inst.label(), reason)
        replacing = self.restarter.replace(inst, self._replaced) if self.restarter and not self._stopping else None
        if replacing is not None:  # pending before its requests end: a request left waits for it
            self._spawn(replacing)
        rebuilding = self.rebuilder.schedule(time.monotonic()) if self.rebuilder and not self._stopping else None
        if rebuilding is not None:
            self._spawn(rebuilding)
        for req, actions in self.flow.instance_died(inst, reason):
            if isinstance(actions[-1], Requeue):
                self.counts["migrated"] += 1
            self._act(req, actions)
        self._wake.set()

    def _replaced(self, inst: Instance) -> None:
        """``inst``, a replacement (`Restarter`), serves from now on: routed to and polled."""
        self.placer.add(inst)  # into ``fleet.instances`` too: the placer's list is the fleet's
        self._spawn(self._poll(inst))
        self._wake.set()

    # ------------------------------------------------------------------ the rebuild (`Rebuilder` drives these)
    def migrate_all(self, reason: str) -> int:
        """Take every instance out of service as if it died (`RequestFlow.instance_died`): what
        each holds migrates to the queue's head (the rebuild counts as a replacement on its way,
        `Starting`); return the requests moved."""
        moved = 0
        for inst in self.fleet.instances:
            for req, actions in self.flow.instance_died(inst, reason):
                moved += isinstance(actions[-1], Requeue)
                self._act(req, actions)
        self.counts["migrated"] += moved
        return moved

    def adopt(self, fleet: Fleet | None) -> None:
        """Serve on ``fleet``, a fresh fleet of the config (a rebuild): its instances take the
        old ones' places (same names) in the fleet, the placer and the ledger; each is polled;
        the prefix affinity forgets what the old ones held; replacements resume. The queue goes
        (None: the rebuild gave up, nothing serves, and the queued requests fail)."""
        if fleet is not None:
            self.fleet.adopt(fleet)
            for inst in self.fleet.instances:
                self.placer.add(inst)
                if self.placer.affinity is not None:
                    self.placer.affinity.forget(inst.name)
                self._spawn(self._poll(inst))
            self.restarter.resume()
        self._wake.set()

    async def _watchdog(self) -> None:
        """Abort requests past request_timeout_s; fail reservations past lease_s
        (`RequestFlow.expired`); audit the ledger every `LEDGER_AUDIT_S`."""
        next_audit = time.monotonic() + LEDGER_AUDIT_S
        while not self._stopping:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = time.monotonic()
            if now >= next_audit:
                self._audit_ledger()
                next_audit = now + LEDGER_AUDIT_S
            for req, end in self.flow.expired(now):
                self._end(req, end.reason, end.error, release=end.release)

    def _audit_ledger(self) -> None:
        """Compare the ledger's sums with the placed requests' (`RequestFlow.audit`); where one
        differs (a move of a request that was not made: a defect of the flow), log it, count it
        (``ledger_rebuilds`` in `snapshot`) and rebuild the ledger from the placed requests, so
        one missed move does not skew every later placement."""
        problem = self.flow.audit()
        if problem is None:
            return
        self.ledger_rebuilds += 1
        logger.error("the router's ledger is out of step with its live requests (%s); rebuilt from them", problem)
        self.flow.rebuild()

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict:
        """Queue length, live requests per stage, outcome counts, aborts and failures by reason
        (`failure_reason`), instance loads (tokens) and the CPU seconds used so far by the router's
        thread and by its whole process (``cpu_s``; `disagg bench` turns them into each run's
        ``host_cpu`` fractions: a router thread near 1.0 is the bottleneck, not the GPUs)."""
        live = list(self.requests.values())
        placer = self.placer
        return {"queued": len(self.queue), "live": len(live),
                "cpu_s": {"router_thread": time.thread_time(), "process": time.process_time()},
                "stages": dict(collections.Counter(str(req.stage) for req in live)),
                "counts": dict(self.counts), "aborts": dict(self.aborts), "failures": dict(self.failures),
                "loads": self.picker.loads(self.fleet.instances, live), "placements": dict(placer.placements),
                "affinity_hits": placer.affinity_hits, "ledger_rebuilds": self.ledger_rebuilds,
                "restarts": self.restarter.snapshot() if self.restarter is not None else None,
                "rebuild": self.rebuilder.snapshot() if self.rebuilder is not None else None,
                "placement": {"mode": self.settings.placement, "models": placer.fleet_model.snapshot(),
                              "decisions": [d.as_row() for d in placer.decisions]}}

    def clear_counts(self) -> None:
        """Forget outcome, abort, failure and placement counts (after the warm-up requests)."""
        for counter in (self.counts, self.aborts, self.failures):
            counter.clear()
        self.placer.clear_counts()
