"""A fleet on a virtual clock: simulated instances (`instance.py`) and the router's placement.

Discrete events, in time order (ties in the order they were made, so a run is deterministic):

    arrival    a request reaches the router (the bench's arrival offsets; with max_concurrency
               it waits at the client for a free slot, as `vllm bench serve` does)
    step_end   an instance's forward ends: its tokens reach the router (no hop time)
    push_end   a pushed prompt's KV has landed on its decode instance (`link.SimSender`): the
               decode side gets its first token (the router's `Start`) and decodes it once a
               step polls the landing; the prefill side frees its pages at its next step
    hand       a decode instance's reservation of a remote request answered: its prompt goes to
               the prefill instance. An instance's actor runs calls between its steps, so a
               reservation made while the decode instance is mid-forward answers when that
               forward ends

After each event every touched instance that is idle and has work runs its engine's next step
(`SimInstance.begin_step`: the real `EngineCore`), whose outputs reach the router at the end of
the forward it read, ``StepTimeModel.step_s(shape)`` after that forward's start. A request's life is the
router's own: the same `RequestFlow` (`disagg.cluster.routing.flow`) moves the same `RoutedRequest` records
through the same `Placer` (the `Picker`'s order, the prefill queue bound, `router.placement` local
or adaptive through `placement.decide` over `FleetModel.view`s whose models are the profiles' fits)
and keeps the same `Ledger`; `_act` carries its actions out as calls on the simulated instances
where the router makes Ray calls: decode reservations in the route's order, then the prompt to the
prefill instance the `Placer` names. Prefix caching (``cache.prefix_caching``): requests carry their
prompts' token ids, every engine holds its prefix cache (a prompt computes only what
follows its longest cached prefix, a reservation forks the decode side's cached whole pages and its
push carries only what follows them), and the `Placer` has the router's prefix affinity
(`affinity.prefix_affinity`). Each fleet starts cold, as `disagg bench` resets the prefix cache
before each run.
Profiles per role (`fleet_profiles`): each instance runs its role's profile (its step-time
model, its rank's KV bytes per token), whose TP must be the role's ``instances.tensor_parallel``;
one profile times every role of a fleet of one TP. The fleet's pages (unless the config gives
them) are the wider side's count the tightest profile's memory holds, which a narrower side's
ranks view as more pages (`fleet_pages`, as a launch sizes one heap); the context is the
tightest profile's.
Pushes (`link.py`): layer by layer beside the forward that computes the tokens; a prefill
instance's links carry one forward's tokens after the other at ``link_gbps`` per rank, each token
priced by the busiest link of its rank pairs (`link.link_bytes_per_token`: prefill TP a into
decode TP b), and a push ends no earlier than its forward. Not modelled: router and network
hops (beyond ``--hop-ms`` before placement and ``--reserve-ms`` for a remote request's
reservation), request timeouts, instance failures.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from disagg.cluster.launch.instance import Instance
from disagg.cluster.outputs import RequestMetrics
from disagg.cluster.routing.affinity import prefix_affinity
from disagg.cluster.routing.flow import Add, End, Hand, RequestFlow, Requeue, Reserve, Start
from disagg.cluster.routing.placement.placer import Placer, Wait
from disagg.cluster.routing.requests import Picker, RoutedRequest
from disagg.cluster.simulate.instance import SimInstance
from disagg.cluster.simulate.link import link_bytes_per_token
from disagg.cluster.simulate.profile import profile_tensor_parallel
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.config import Config
from disagg.engine.options import EngineOptions
from disagg.engine.request import pages_for
from disagg.sampling import SamplingParams

ARRIVAL, STEP_END, PUSH_END, HAND = 0, 1, 2, 3
# `watch_slos` calls a token late past its deadline plus this much: a token at the deadline
# exactly meets the SLO, and the two sides of that test round on their own.
LATE_MARGIN_S = 1e-9
ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True)
class Timeline:
    """What the client sees of one request: send time and each token's time (virtual seconds)."""

    prompt_len: int
    max_tokens: int
    sent: float
    token_times: list[float] = field(default_factory=list)
    error: str = ""
    ended: bool = False


def _sink(delta: Any, metrics: Any) -> None:  # the router's sink; the fleet records tokens itself
    return None


def check_hops(**hops: float) -> None:
    """Raise ValueError naming the flag of the first of ``hops`` (``hop_ms``, ``step_gap_ms``,
    ``reserve_ms``: `SimFleet`'s) that is not a finite number of milliseconds >= 0."""
    for name, value in hops.items():
        if not 0 <= value < float("inf"):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: expected a finite number of milliseconds >= 0, got {value}")


def roles_of(config: Config) -> list[str]:
    """The roles ``config`` runs (those with instances), in `ROLES` order."""
    return [role for role in ROLES if getattr(config.instances, role)]


def fleet_profiles(config: Config, profile: dict | Mapping[str, dict]) -> dict[str, dict]:
    """The profile of each role ``config`` runs: ``profile`` for every one (a `disagg profile`
    result), or ``profile[role]`` (one per role).

    Raises:
        ValueError: a role without a profile, or whose profile timed another TP than the role's
            ``instances.tensor_parallel`` (its step times are another instance's: a TP-k step
            all-reduces over k ranks, on a k-th of the heads).
    """
    one = "fit" in profile
    out = {}
    for role in roles_of(config):
        if not one and role not in profile:
            raise ValueError(f"profiles: expected one for each role the config runs ({', '.join(roles_of(config))}), "
                             f"got none for {role}")
        prof = profile if one else profile[role]
        want, got = config.instances.tensor_parallel_of(role), profile_tensor_parallel(prof)
        if want != got:
            raise ValueError(f"--profile: the profile timed an instance of tensor_parallel {got}, the config's {role} "
                             f"instances run at tensor_parallel {want}: profile the config's instance (`disagg "
                             f"profile CONFIG`) or give a profile of TP {want}")
        out[role] = prof
    return out


def profiles_by_role(config: Config, profiles: Mapping[int, dict]) -> dict[str, dict]:
    """The profile of each role ``config`` runs, picked from ``profiles`` (by the TP each timed)
    by the role's ``instances.tensor_parallel`` (`disagg simulate --profile P1 --profile P2`).

    Raises:
        ValueError: a role at a TP no profile timed (the message names the role and the TP).
    """
    out = {}
    for role in roles_of(config):
        tp = config.instances.tensor_parallel_of(role)
        if tp not in profiles:
            raise ValueError(f"--profile: the config's {role} instances run at tensor_parallel {tp}, and no profile "
                             f"timed TP {tp} (profiles of TP {', '.join(map(str, profiles))}): give one more "
                             f"--profile, of an instance of TP {tp} (`disagg profile CONFIG --set "
                             f"instances.tensor_parallel={tp}`)")
        out[role] = profiles[tp]
    return out


class SimFleet:
    """The instances of ``config`` and its router on one virtual clock.

    Args:
        config: the deployment (instances, cache, scheduler, router sections).
        profile: a `disagg profile` result for every role, or one per role (`fleet_profiles`):
            each role's step-time model and KV bytes per token, and the engine's pages when the
            config sizes the cache from GPU memory (the fewest of the profiles').
        link_gbps: the push bandwidth, GB/s per link (one per rank of a prefill instance).
        hop_ms: from a request's send to its arrival at the router's placement (HTTP, router and
            Ray hops; the client's clock starts at the send), ms.
        step_gap_ms: host time between two forwards of an instance (the step loop's reading,
            bookkeeping and calls between steps; a served trace's "gap between steps"), ms.
        reserve_ms: a remote request's reservation round trip beyond the decode instance's step
            in flight (router -> decode actor -> router, before its prompt goes to the prefill
            instance; a served trace's remote "submit -> reserved"), ms.
    """

    def __init__(self, config: Config, profile: dict | Mapping[str, dict], link_gbps: float = 364.0,
                 hop_ms: float = 0.0, step_gap_ms: float = 0.0, reserve_ms: float = 0.0) -> None:
        if not link_gbps > 0:
            raise ValueError(f"--link-gbps: expected a bandwidth > 0 GB/s, got {link_gbps}")
        check_hops(hop_ms=hop_ms, step_gap_ms=step_gap_ms, reserve_ms=reserve_ms)
        self.hop_s = hop_ms / 1e3
        self.step_gap_s = step_gap_ms / 1e3
        self.reserve_s = reserve_ms / 1e3
        self.config = config
        self.profiles = fleet_profiles(config, profile)
        engines = [prof["engine"] for prof in self.profiles.values()]
        self.page_size = config.cache.page_size
        self.num_pages, self.role_pages = fleet_pages(self.profiles, config.cache.num_pages,
                                                      config.instances.gpus_per_instance)
        self.max_model_len = min([config.model.max_model_len or math.inf] + [e["max_model_len"] for e in engines])
        self.vocab_size = int(engines[0].get("vocab_size") or 32000)
        self.link_bytes_per_s = link_gbps * 1e9
        self.models = {role: StepTimeModel.from_dict(prof["fit"]) for role, prof in self.profiles.items()}
        self.token_bytes = {role: float(prof["engine"]["kv_bytes_per_token"]) for role, prof in self.profiles.items()}
        names = [(f"{role}-{i}", role) for role in ROLES for i in range(getattr(config.instances, role))]
        pes = {pe: role for pe, (_, role) in enumerate(names)}
        self.instances = [self._instance(name, role, pe, pes) for pe, (name, role) in enumerate(names)]
        self._by_name = {inst.name: inst for inst in self.instances}
        self.picker = Picker(config.router.policy, config.scheduler.max_num_seqs)
        self.placer = Placer(config, self.instances, self.picker,
                             prefix_affinity(config, min(self.role_pages.values())),
                             clock=lambda: self.now, tracked=True)
        self.placer.fleet_model.models = {inst.name: self.models[inst.role] for inst in self.instances}
        self.ledger = self.placer.ledger
        self.flow = RequestFlow(self.placer, config.router)  # each request's life, the router's; it keeps the ledger
        self.now = 0.0
        self._events: list[tuple] = []
        self._order = itertools.count()
        self._queue: collections.deque[RoutedRequest] = collections.deque()
        self.timelines: dict[str, Timeline] = {}
        self._live: dict[str, tuple[RoutedRequest, Timeline]] = {}  # request id -> the two, until its end
        self.num_events = 0
        self.halted = False
        self.fuse = True  # run the pure-decode forwards no event can change in one event (`SimInstance.fuse`)
        self._slos_s: dict[str, float] = {}  # `watch_slos`: the SLOs watched, seconds (margin added)
        self._on_late: Callable[[str], None] | None = None
        self._deadlines: list[tuple[float, str, str]] = []  # (when, request id, the SLO it would miss by then)
        self._late: set[str] = set()  # the requests `watch_slos` called late
        self.step_records: list[dict] | None = None  # `keep_records`: trace records of the run

    def _instance(self, name: str, role: str, pe: int, roles: Mapping[int, str]) -> Instance:
        """The simulated instance ``name`` of ``role`` at PE ``pe``, timed by its role's profile,
        its pushes into each PE (of ``roles``: every PE's role) priced by their rank pairs."""
        sched = self.config.scheduler
        options = EngineOptions(num_pages=self.role_pages[role], page_size=self.page_size,
                                max_num_seqs=sched.max_num_seqs,
                                max_num_batched_tokens=sched.max_num_batched_tokens,
                                prefix_caching=self.config.cache.prefix_caching, use_cuda_graphs=False,
                                async_scheduling=sched.async_scheduling, async_prompts=sched.async_prompts)
        tp_of = self.config.instances.tensor_parallel_of
        own = self.token_bytes[role]
        link_bytes = {dst: link_bytes_per_token(own, tp_of(role), self.token_bytes[other], tp_of(other))
                      for dst, other in roles.items() if other != "colocated" and tp_of(other) != tp_of(role)}
        engine = SimInstance(self.models[role], options, max_model_len=self.max_model_len,
                             vocab_size=self.vocab_size, clock=lambda: self.now, pe=pe, bytes_per_token=own,
                             link_bytes_per_s=self.link_bytes_per_s, link_bytes=link_bytes,
                             step_gap_s=self.step_gap_s)
        return Instance(name=name, role=role, actor=engine)

    def of_role(self, role: str) -> list[Instance]:
        return self.placer.of_role(role)

    @property
    def placements(self) -> collections.Counter[str]:
        """Requests placed per path (`placement.PATHS`), as the router's stats count them."""
        return self.placer.placements

    def prefix_stats(self) -> dict[str, dict]:
        """Per instance, its engine's prefix-cache counters and pushed KV as `disagg bench` reads
        them from engine stats (``prefix_query_tokens``, ``prefix_hit_tokens``, ``pushed_bytes``)."""
        out = {}
        for inst in self.instances:
            stats = inst.actor.stats()
            out[inst.name] = {"prefix_query_tokens": stats["prefix_query_tokens"],
                              "prefix_hit_tokens": stats["prefix_hit_tokens"],
                              "pushed_bytes": stats["num_pushed_tokens"] * inst.actor.bytes_per_token}
        return out

    # ------------------------------------------------------------------ the clock
    def submit_at(self, t: float, request_id: str, prompt: Any, max_tokens: int) -> None:
        """A request sent at virtual time ``t``: it reaches the router ``hop_ms`` later.

        Args:
            prompt: its token ids (a list or an int array: the prefix caches and the affinity key
                them), or an int: a prompt of that many tokens that shares no prefix with any other
                (its first id is negative and its own, the rest 0).
        """
        self._push(t + self.hop_s, ARRIVAL, (request_id, prompt, max_tokens, t))
        for slo in ("ttft", "e2el"):
            if slo in self._slos_s:
                heapq.heappush(self._deadlines, (t + self._slos_s[slo], request_id, slo))

    def watch_slos(self, slos_s: Mapping[str, float], on_late: Callable[[str], None]) -> None:
        """Call ``on_late(request_id)`` once for each request submitted from now on that surely
        misses one of ``slos_s`` (``ttft``, ``tpot``, ``e2el``: seconds, `bench.metrics.meets_slos`'s),
        as soon as the clock passes the time by which it would have had to have its first token
        (TTFT) or its last (E2EL; TPOT: its first token's time plus the SLO for each token after
        it) and that token is not recorded (`_check_deadlines`). The run's events are not
        touched: the simulation is the one it is unwatched."""
        unknown = sorted(set(slos_s) - {"ttft", "tpot", "e2el"})
        if unknown or not all(v >= 0 for v in slos_s.values()):
            raise ValueError(f"watch_slos: expected ttft, tpot or e2el >= 0 s, got {dict(slos_s)}")
        self._slos_s = {slo: float(v) + LATE_MARGIN_S for slo, v in slos_s.items()}
        self._on_late = on_late

    def run(self, on_end: Any = None) -> None:
        """Process events until none is left, or until `halt`. ``on_end(request_id, now)`` hears
        each request end."""
        self._on_end, self.halted = on_end, False
        while self._events and not self.halted:
            if self._deadlines:
                self._check_deadlines(self._events[0][0])
                if self.halted:
                    break
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            self.num_events += 1
            touched = self._handle(kind, payload)
            self._dispatch(touched)
            self._launch([self._by_name[name] for name in sorted(touched)])

    def _check_deadlines(self, until: float) -> None:
        """Tell `watch_slos`'s ``on_late`` of each request whose deadline is at or before
        ``until`` (the next event's time: nothing happens before it) and whose token due by then
        is not recorded: a token is recorded at the end of the forward that computes it (the step
        ending there, `_step_end`: a forward computing a prompt's chunk, or ending a request, is
        the last of its step, `SimInstance.fuse`), so this one comes from a forward ending after
        ``until``, past the SLO."""
        while self._deadlines and self._deadlines[0][0] <= until and not self.halted:
            _, request_id, slo = heapq.heappop(self._deadlines)
            timeline = self.timelines.get(request_id)
            if request_id in self._late or (timeline is not None and timeline.ended):
                continue
            if slo != "ttft" or timeline is None or not timeline.token_times:
                self._late.add(request_id)
                self._on_late(request_id)

    def halt(self) -> None:
        """Stop `run` after the event being processed: what has not ended by then never ends
        (its timeline stays open; `run.client_output` makes it a failed request)."""
        self.halted = True

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, payload))

    def _handle(self, kind: int, payload: Any) -> set[str]:
        """Apply one event; the names of the instances it touched."""
        if kind == ARRIVAL:
            return self._arrive(*payload)
        if kind == STEP_END:
            return self._step_end(payload)
        if kind == HAND:
            return self._hand(payload)
        req, prefill = payload
        # The decode side learns the first token even when it ended the request (it frees the
        # reservation then), as the flow's `Start` tells it; the prefill side's next step frees
        # the prompt's pages (its pushes are done).
        if req.decode.actor.start(req.request_id):
            self._end(req, "length")
        return {prefill.name, req.decode.name}

    def _launch(self, instances: list[Instance]) -> None:
        """Launch the next forward of each idle instance with work; then fuse the pure-decode
        forwards that surely follow, up to the first event any of them could see."""
        launched = []
        for inst in instances:
            engine = inst.actor
            if engine.current is None and engine.has_work() and engine.begin_step() is not None:
                launched.append(inst)
        nxt = self._events[0][0] if self._events else math.inf
        firsts = [inst.actor.current.end_times[0] for inst in launched]
        for i, inst in enumerate(launched):
            if self.fuse:
                inst.actor.fuse(min([nxt] + firsts[:i] + firsts[i + 1:]))
            step = inst.actor.current
            self._push(step.end_times[-1], STEP_END, inst)
            if self.placer.policy.predicts:  # the router's view of the steps, as `_poll` feeds it
                self._note_steps(inst.name, step)
            if self.step_records is not None:
                self._record_steps(inst.name, step)

    def keep_records(self) -> None:
        """Keep the run's trace records in ``step_records``: every forward as a "step" record and
        every adaptive decision as a "decision" record (`placer.decision_record`) and its request's
        TPOT, predicted and had, as a "tpot" record at its end (`placer.tpot_record`), virtual clock."""
        self.step_records = []
        self.placer.record = lambda kind, fields: self.step_records.append({"kind": kind, **fields})

    def _record_steps(self, name: str, step) -> None:
        """A launched step's forwards as `disagg.trace` "step" records (the fields the step loop
        writes when serving), so a simulated run's steps compare with a traced one's; fused
        forwards are pure decodes of the same sequences, a token longer each."""
        gap = self._by_name[name].actor.step_gap_s
        for forward in step.forwards:
            shape = forward.shape
            self.step_records.append({
                "kind": "step", "instance": name, "t_start": forward.start_s, "t_end": forward.end_s - gap,
                "num_prefill_tokens": shape.num_prefill_tokens, "num_decode_seqs": shape.num_decode_seqs,
                "num_context_tokens": shape.num_context_tokens, "num_prompt_pairs": shape.num_prompt_pairs,
                "num_prompts": int(shape.num_prefill_tokens > 0)})

    def _note_steps(self, name: str, step) -> None:
        """Feed a launched step's forwards to the fleet model's stall meters (its fit is the
        profile's: the simulated steps take exactly what it predicts), each with the host gap
        before it, as the step loop reports a GPU-timed forward's (`StepSample.gap_s`)."""
        shape, fleet, gap = step.shape, self.placer.fleet_model, self._by_name[name].actor.step_gap_s
        fleet.note_step(name, shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_context_tokens,
                        shape.num_prompt_pairs, step.durations[0] - gap, gap_s=gap)
        fused = len(step.durations) - 1  # pure decode forwards of the same sequences, a token longer each
        if fused:
            n = shape.num_decode_seqs
            fleet.note_step(name, 0, n, shape.num_context_tokens + n * (fused + 1) // 2, 0,
                            sum(step.durations[1:]) / fused - gap, fused, gap_s=gap)

    # ------------------------------------------------------------------ router
    def _arrive(self, request_id: str, prompt: Any, max_tokens: int, sent: float) -> set[str]:
        if isinstance(prompt, int):
            ids = [-len(self.timelines) - 1] + [0] * (prompt - 1)
        else:
            ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        prompt_len = len(ids)
        timeline = self.timelines[request_id] = Timeline(prompt_len, max_tokens, sent)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = RoutedRequest(request_id, ids, params, _sink, RequestMetrics(arrival_time=self.now))
        self._live[request_id] = req, timeline
        self.flow.arrived(req)
        longest = pages_for(min(prompt_len + max_tokens, self.max_model_len), self.page_size)
        if prompt_len + max_tokens > self.max_model_len or longest > min(self.role_pages.values()):
            self._end(req, "error", f"RequestRefused: prompt {prompt_len} + max_tokens {max_tokens} does not fit "
                                    f"max_model_len {self.max_model_len} / {min(self.role_pages.values())} pages "
                                    f"of {self.page_size}")
            return set()
        if self.config.mode == "colocated":
            return self._place(req) or set()
        self._queue.append(req)
        return set()

    def _dispatch(self, touched: set[str]) -> None:
        """Place queued requests in order while the head can go (the router's dispatch loop)."""
        while self._queue:
            placed = self._place(self._queue[0])
            if placed is None:
                return
            self._queue.popleft()
            touched.update(placed)

    def _place(self, req: RoutedRequest) -> set[str] | None:
        """Route ``req`` (`RequestFlow.route`, the router's) and carry the route out on the simulated
        instances: the instances it touched, None to wait at the queue head."""
        if self.placer.policy.predicts:  # the loads its views read
            for inst in self.instances:
                self.placer.fleet_model.loads[inst.name] = inst.actor.load()
        return self._act(req, self.flow.route(req))

    def _act(self, req: RoutedRequest, actions: tuple) -> set[str] | None:
        """Carry out the flow's ``actions`` for ``req`` as virtual calls: a reservation runs at once
        on the decode instance's engine (its answer reaches the router when that instance's step in
        flight ends, plus ``reserve_ms``: `HAND`); the instances touched, None when ``req`` waits
        at the queue head (`Wait`, `Requeue`)."""
        touched: set[str] = set()
        for action in actions:
            if isinstance(action, (Wait, Requeue)):
                return None
            if isinstance(action, Reserve):
                inst = action.instance
                dest = inst.actor.reserve(req.request_id, req.prompt_token_ids, req.params.max_tokens)
                answer = self.flow.refused(req, inst) if dest is None else self.flow.reserved(req, inst, dest)
                more = self._act(req, answer)
                if more is None:
                    return None
                touched |= more
            elif isinstance(action, Hand):
                answered = self._call_done(req.decode) + self.reserve_s
                if answered > self.now:
                    self._push(answered, HAND, req)
                    touched.add(req.decode.name)
                else:
                    touched |= self._hand(req)
            elif isinstance(action, Add):
                action.instance.actor.add(req.request_id, req.prompt_token_ids, req.params.max_tokens,
                                          dest=action.dest)
                touched.update({action.instance.name} if action.dest is None else {action.instance.name,
                                                                                    req.decode.name})
            elif isinstance(action, End):
                self._end(req, action.reason, "" if action.error is None
                          else f"{type(action.error).__name__}: {action.error}")
            else:
                raise AssertionError(f"the simulator's instances never die nor abort: no {action} for it")
        return touched

    def _call_done(self, inst: Instance) -> float:
        """When a reservation made now on ``inst`` has run: at the end of its forward in flight,
        or now when decode instances answer mid-forward (`scheduler.overlap_reservations`)."""
        step = inst.actor.current
        if step is None or self.config.scheduler.overlap_reservations:
            return self.now
        return next((t for t in step.end_times if t > self.now), self.now)

    def _hand(self, req: RoutedRequest) -> set[str]:
        """The reservation's answer reached the router: ``req``'s prompt goes to its prefill instance."""
        return self._act(req, self.flow.handed(req))

    # ------------------------------------------------------------------ outputs
    def _step_end(self, inst: Instance) -> set[str]:
        live, flow = self._live, self.flow
        tpot_s = self._slos_s.get("tpot")
        for request_id, finished, times, pushed in inst.actor.finish_step():
            req, timeline = live[request_id]
            if tpot_s is not None and not timeline.token_times and timeline.max_tokens > 1:
                heapq.heappush(self._deadlines, (times[0] + tpot_s * (timeline.max_tokens - 1), request_id, "tpot"))
            timeline.token_times += times
            reason = "length" if finished else None  # requests run to max_tokens: EOS is ignored
            if not pushed:
                actions = flow.tokens(req, len(times), reason)
            else:  # pushed: the first token; decoding waits for the push
                assert len(times) == 1, "a forward computing a prompt is never fused"
                actions = flow.first_token(req, inst, reason)
            for action in actions:
                if isinstance(action, Start):  # when the push of its last token is done (`link.SimSender`)
                    self._push(max(self.now, req.dest.ticket.at), PUSH_END, (req, inst))
                else:
                    self._end(req, action.reason)
        return {inst.name}

    def _end(self, req: RoutedRequest, reason: str, error: str = "") -> None:
        """``req`` ended (`RequestFlow.end`; its engines ended it, nothing to release): ``error``
        the client's, empty for a finish."""
        if req.done:
            return
        self.flow.end(req, reason, release=False)
        _, timeline = self._live.pop(req.request_id)
        assert not timeline.ended, f"request {req.request_id} ended twice"
        timeline.ended, timeline.error = True, error
        if self._on_end is not None:
            self._on_end(req.request_id, self.now)

    @property
    def placed(self) -> dict[str, RoutedRequest]:
        """The live requests placed on instances (`RequestFlow.placed`: those the ledger counts)."""
        return self.flow.placed

    def check_ledger(self) -> None:
        """Assert that the ledger's sums are those over the placed requests (`RequestFlow.check`)."""
        self.flow.check()


def fleet_pages(profiles: Mapping[str, dict], num_pages: int | None = None,
                gpus_per_instance: float = 1.0) -> tuple[int, dict[str, int]]:
    """The fleet's page count and each role's pages, as a launch sizes them (`disagg.cluster.
    launch.preflight.size_cache`, `disagg.transfer.heads.HeadLayout.num_pages_of`): every PE
    allocates the fleet's count of pages of the side with the most KV bytes per token per rank
    (``num_pages``, else the fewest its memory holds: a profile's pages, divided among the
    instances sharing a GPU, times its page's share of the widest page), and a rank of a
    narrower side views the same bytes as proportionally more pages. One TP on both sides: one
    count for every role.

    Args:
        profiles: each role's profile (``engine.num_pages``, ``engine.kv_bytes_per_token``).
        num_pages: the config's ``cache.num_pages`` (None: from the profiles).
        gpus_per_instance: the config's ``instances.gpus_per_instance``.

    Returns:
        (the fleet's ``cache.num_pages``, role -> its instances' pages).
    """
    token_bytes = {role: float(prof["engine"]["kv_bytes_per_token"]) for role, prof in profiles.items()}
    widest = max(token_bytes.values())
    if num_pages is None:
        num_pages = min(max(1, int(int(prof["engine"]["num_pages"] * gpus_per_instance) * token_bytes[role] / widest))
                        for role, prof in profiles.items())
    return num_pages, {role: int(num_pages * widest // token_bytes[role]) for role in profiles}
