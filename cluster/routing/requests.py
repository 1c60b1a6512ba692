"""A request's state in the router, and which instance gets the next one.

`RoutedRequest` records where a request is (its `Stage`: queued -> reserving -> prefilling -> decoding
-> done in disaggregated mode; queued -> running -> done colocated; `disagg.cluster.routing.flow` moves
it), which instances hold it, its deadlines, and what it has produced. `Picker` chooses an
instance per role: least-loaded (prefill: queued prompt tokens; decode and colocated: reserved +
running tokens) or round-robin. `RecentIds`
remembers request ids for a bounded count and time (aborts that came before their submit, ids
that ended). Used by the router (`disagg.cluster.routing.router`, on its event loop) and the simulator.
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
from dataclasses import dataclass, field
from collections.abc import Hashable
from typing import Any, Callable

from disagg.cluster.launch.instance import Instance
from disagg.cluster.outputs import RequestMetrics, StreamDelta

# sink(delta, metrics): called on the router's loop for every delta; metrics only with the last.
Sink = Callable[[StreamDelta, "RequestMetrics | None"], None]


class Stage(str, enum.Enum):
    """Where a request is in its life (`disagg.cluster.routing.flow` moves it; a plain string compares
    equal to its member, so records and tests may say ``"decoding"``).

        QUEUED      at the router, waiting to be placed (or back at the queue head)
        RESERVING   a decode instance is reserving its pages (or has, and its answer is on its
                    way); its prompt has not reached a prefill instance
        PREFILLING  its prompt is with the prefill instance, its KV pushed into the reservation
        DECODING    its first token came: the decode instance decodes it
        RUNNING     one instance computes and decodes it (colocated, or placed local or kept)
        DONE        ended
    """

    QUEUED = "queued"
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    RUNNING = "running"
    DONE = "done"

    __str__ = str.__str__
    __format__ = str.__format__


STAGES = tuple(stage.value for stage in Stage)
_DONE = Stage.DONE  # `RoutedRequest.done` reads it once per token: no lookup on the enum class


@dataclass(slots=True)
class RoutedRequest:
    """One request inside the router (slots: the step end reads and writes a few fields of
    every decoding request at every step).

    Attributes:
        request_id: the caller's id (unique among live requests; a string).
        prompt_token_ids: the prompt its engines compute: the caller's, and after a migration
            the tokens streamed before it too (`num_resumed_tokens`).
        params: the `SamplingParams`, passed to the engines as is (after a migration, with
            ``max_tokens`` less the tokens streamed before it).
        sink: where deltas go (see `Sink`).
        metrics: timings, filled as the request moves.
        stage: its `Stage`.
        prefill, decode, colocated: the instances it was placed on (None until placed);
            `holders` says which of them it still depends on.
        dest: the decode reservation (`RecvDest`) handed to the prefill instance, or None.
        deadline: ``time.monotonic()`` after which it is aborted (request_timeout_s), or None.
        lease_deadline: ``time.monotonic()`` after which a reservation whose KV has not landed
            (no first token yet) is failed, or None.
        num_output: tokens produced so far.
        kv_landed: the decode instance produced a token of it: the doorbell rang, so every push
            of the prefill instance landed and the prefill instance has let the request go.
        first_token_at: when its first token reached the router, by the `Placer`'s clock
            (`Placer.first_token`), or None: the adaptive placement's measure of its TPOT so far.
        cached_tokens: the prompt's tokens the router's prefix affinity believed cached on the
            instance placed to compute it, when it was placed (`Placer`): the adaptive
            placement counts only the rest as that instance's queued prompt work.
        stale_end: a decode instance whose reservation of it was cancelled to queue it again
            (no live prefill instance, `RequestFlow.reserved`): the "abort" output that the
            cancel makes there ends no later placement of it on that instance (the router drops
            it once), or None.
        output_token_ids: every token streamed to the caller so far (the router notes each
            delta's), over all its placements.
        num_migrations: times it was moved off a dead instance (`disagg.cluster.routing.migration`):
            its engine id's number (`engine_id`).
        num_resumed_tokens: the tokens of ``output_token_ids`` that its last migration put at the
            end of ``prompt_token_ids`` (its ``params.max_tokens`` counts the rest).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    sink: Sink
    metrics: RequestMetrics
    stage: Stage = Stage.QUEUED
    prefill: Instance | None = None
    decode: Instance | None = None
    colocated: Instance | None = None
    dest: Any = None
    deadline: float | None = None
    lease_deadline: float | None = None
    num_output: int = 0
    kv_landed: bool = False
    first_token_at: float | None = None
    cached_tokens: int = 0
    stale_end: Instance | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_migrations: int = 0
    num_resumed_tokens: int = 0

    @property
    def done(self) -> bool:
        return self.stage == _DONE

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def engine_id(self) -> Hashable:
        """The id the engines know its current placement by: ``request_id`` until its first
        migration, then ``(request_id, num_migrations)`` (the caller's ids are strings, so no live
        id is such a pair): the leftovers of a placement it migrated away from keep their id on the
        survivors (`disagg.cluster.routing.migration`)."""
        return self.request_id if self.num_migrations == 0 else (self.request_id, self.num_migrations)

    def holders(self) -> list[Instance]:
        """The instances that can still affect this request: the death of one fails it.

        Colocated: its one instance. Disaggregated: the prefill and the decode instance while
        the prompt is with the prefill side (queued there, prefilling, pushing: its first token
        may have come, but until the decode side produced a token its KV may not have landed);
        then the decode instance alone (`kv_landed`).
        """
        if self.colocated is not None:
            return [self.colocated]
        if self.kv_landed:
            return [self.decode]
        return [inst for inst in (self.prefill, self.decode) if inst is not None]


class RecentIds:
    """Request ids, each with the time it was noted; the oldest go first once there are more
    than ``max_ids`` or they are older than ``ttl_s``.

    Args:
        max_ids: how many ids are kept at most.
        ttl_s: seconds an id is kept, or None (kept until ``max_ids`` pushes it out).
        clock: a monotonic clock, seconds (tests pass a fake one).
    """

    def __init__(self, max_ids: int, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if max_ids < 1:
            raise ValueError(f"max_ids: expected at least 1, got {max_ids}")
        self.max_ids, self.ttl_s, self.clock = max_ids, ttl_s, clock
        self._noted: collections.OrderedDict[Any, float] = collections.OrderedDict()

    def add(self, request_id: Any) -> None:
        """Note ``request_id`` now (again: its time is renewed)."""
        self._noted.pop(request_id, None)
        self._noted[request_id] = self.clock()
        self._trim()

    def pop(self, request_id: Any) -> bool:
        """Forget ``request_id``; True when it was noted (and not expired)."""
        self._trim()
        return self._noted.pop(request_id, None) is not None

    def __contains__(self, request_id: Any) -> bool:
        self._trim()
        return request_id in self._noted

    def __len__(self) -> int:
        self._trim()
        return len(self._noted)

    def _trim(self) -> None:
        while len(self._noted) > self.max_ids:
            self._noted.popitem(last=False)
        if self.ttl_s is not None:
            oldest = self.clock() - self.ttl_s
            while self._noted and next(iter(self._noted.values())) < oldest:
                self._noted.popitem(last=False)


@dataclass
class Picker:
    """Chooses instances by policy, by the loads of the live requests.

    Args:
        policy: "least_loaded" or "round_robin".
        max_seqs: least_loaded: the sequences an engine runs at once (scheduler.max_num_seqs;
            None: no limit); an instance whose seats are all held (`seat_holders`) goes after
            those with a free one, whatever its load: a request placed there waits for one of
            its decodes to end.
        ledger: a `disagg.cluster.routing.ledger.Ledger` its owner keeps up to date: the loads, seats and
            prompt queues come from it, O(instances), and the ``requests`` passed are not read;
            None: summed over them.
    """

    policy: str
    max_seqs: int | None = None
    ledger: Any = None
    _turns: dict[str, itertools.count] = field(default_factory=dict)

    def order(self, candidates: list[Instance], requests: list[RoutedRequest],
              credit: dict[str, int] | None = None) -> list[Instance]:
        """Live ``candidates`` in the order to try them (best first).

        Args:
            credit: least_loaded only: tokens of the request's prompt each instance is believed
                to have cached (`disagg.cluster.routing.affinity`), taken off its load (work it saves).
        """
        live = [inst for inst in candidates if inst.alive]
        if not live:
            return []
        turn = next(self._turns.setdefault(live[0].role, itertools.count())) % len(live)
        rotated = live[turn:] + live[:turn]
        if self.policy == "round_robin":
            return rotated
        loads = self.loads(live, requests)
        if credit:
            loads = {name: load - credit.get(name, 0) for name, load in loads.items()}
        # Stable sort of the rotation: equal loads take turns (an idle fleet fed one request at a
        # time would otherwise send every one to the first instance).
        if self.max_seqs is None:
            return sorted(rotated, key=lambda inst: loads[inst.name])
        seats = self.seats(live, requests)
        return sorted(rotated, key=lambda inst: (seats[inst.name] >= self.max_seqs, loads[inst.name]))

    def seats(self, instances: list[Instance], requests: list[RoutedRequest]) -> dict[str, int]:
        """Each of ``instances``' seats held or awaited by the live ``requests`` (`seat_holders`)."""
        if self.ledger is not None:
            return {inst.name: self.ledger.seats[inst.name] for inst in instances}
        seats = {inst.name: 0 for inst in instances}
        for req in requests:
            for inst in seat_holders(req):
                if inst.name in seats:
                    seats[inst.name] += 1
        return seats

    def loads(self, instances: list[Instance], requests: list[RoutedRequest]) -> dict[str, int]:
        """Each of ``instances``' load in tokens, as `order` counts it (`load_of`)."""
        if self.ledger is not None:
            return {inst.name: self.ledger.loads[inst.name] for inst in instances}
        loads = {inst.name: 0 for inst in instances}
        for req in requests:
            for inst, tokens in load_of(req):
                if inst.name in loads:
                    loads[inst.name] += tokens
        return loads

    def prompt_queues(self, instances: list[Instance], requests: list[RoutedRequest]) -> tuple[dict[str, int], int]:
        """Each of ``instances``' prompt tokens placed on it and not yet computed
        (`router.prefill_queue_tokens` bounds them; `queued_prompt`), and the prompt tokens of the
        reservations still on their way to a prefill instance (none named yet). Not `loads`,
        which also weighs the tokens a request decodes there: a prefill instance keeping a few
        requests would otherwise hold every remote prompt back behind decodes that queue no prompt,
        and every request queued behind that one."""
        if self.ledger is not None:
            return {inst.name: self.ledger.queued[inst.name] for inst in instances}, self.ledger.unnamed
        queued, unnamed = {inst.name: 0 for inst in instances}, 0
        for req in requests:
            inst, tokens = queued_prompt(req)
            if inst is None:
                unnamed += tokens
            elif inst.name in queued:
                queued[inst.name] += tokens
        return queued, unnamed


def seat_holders(req: RoutedRequest) -> tuple[Instance, ...]:
    """The instances on which ``req`` holds or awaits one of the engine's `scheduler.max_num_seqs`
    seats: the one that computes and decodes it (local, kept, colocated), the decode instance it is
    reserved on (decoding, or to decode once its prompt lands), and a prefill instance while it
    computes its prompt; each instance once, however it is held there (one seat)."""
    stage = req.stage
    if stage == "done":
        return ()
    colocated, decode, prefill = req.colocated, req.decode, req.prefill
    if decode is colocated:
        decode = None
    if prefill is colocated or prefill is decode or (stage != "reserving" and stage != "prefilling"):
        prefill = None
    return tuple(inst for inst in (colocated, decode, prefill) if inst is not None)


def queued_prompt(req: RoutedRequest) -> tuple[Instance | None, int]:
    """Where ``req``'s prompt waits to be computed (`Picker.prompt_queues`): (the instance, its
    tokens): a pushed prompt's prefill instance until it lets it go, a kept or local one's instance
    until its first token; (None, its tokens) while its reservation is on its way and no prefill
    instance is named; (None, 0) once computed."""
    if req.stage == "reserving" and req.prefill is None:
        return None, req.prompt_len
    if req.prefill is not None and req.stage in ("reserving", "prefilling"):
        return req.prefill, req.prompt_len
    if req.colocated is not None and req.num_output == 0 and not req.done:
        return req.colocated, req.prompt_len
    return None, 0


def load_of(req: RoutedRequest) -> list[tuple[Instance, int]]:
    """What ``req`` weighs on each instance holding it, tokens."""
    out = []
    if req.prefill is not None and req.stage in ("reserving", "prefilling"):
        out.append((req.prefill, req.prompt_len))  # queued prompt tokens
    for inst in (req.decode, req.colocated):
        if inst is not None and not req.done:
            out.append((inst, req.prompt_len + req.num_output))  # reserved + running tokens
    return out
