"""The live requests' sums per instance, kept up to date as requests move: the one bookkeeping of
the router and the simulator (docs/ARCHITECTURE.md §7).

What the placement reads of the fleet's load is a sum over the live requests: the `Picker`'s
loads, seats and prompt queues (`disagg.cluster.routing.requests`), and the work each instance's
`InstanceView` prices (`disagg.cluster.routing.placement.tally`). Summed over every live request at each
placement, a decision costs O(live requests): 2.7 ms on 8 instances with 1,000 live, 24 ms on 64
with 6,400 (`benchmarks/bench_placement.py`; the served router's loop, one core, at hundreds of
requests a second). A `Ledger`
keeps each request's share of every sum from its last change instead, so a placement costs
O(instances):

    touch(req)           placed, or changed where it is (stage, instances, first token, prefix credit)
    advance(req, n)      n more output tokens, nothing else changed
    drop(req)            ended

A request's share is those same functions of it alone (`tally` of one request, `load_of`,
`queued_prompt`, `seat_holders`), so the sums equal the sums over the live requests whenever every
move was made. Each instance's decodes' progress (`InstanceView.decode_progress`) is kept the
same way, a row per decode in a `ProgressTable` written at `touch`, `advance` and `drop`: a
decision copies it as arrays and rebuilds no row. `audit` compares the sums and the rows with
those over the live requests field by field (the tests `check` it at every placement and end of
the router's fleets and at every decision of the simulator's; the router's watchdog audits it
every few seconds). The request flow (`disagg.cluster.routing.flow`) makes every move, for the router
and the simulator alike: a request counts from its placement to its end.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from disagg.cluster.routing.placement import InstanceWork, tally
from disagg.cluster.routing.placement.progress import NO_PROGRESS, ProgressTable
from disagg.cluster.routing.requests import Picker, RoutedRequest, load_of, queued_prompt, seat_holders

WORK_FIELDS = ("queued", "pairs", "decoding", "context", "remaining", "seated", "incoming")


@dataclass(slots=True)
class _Share:
    """One request's part of the sums, as last reported. ``work`` and ``loads`` are as `Ledger.
    touch` took them but for ``decoding_work.remaining``: `Ledger.advance` moves the sums and
    counts the tokens in ``advanced``, which `Ledger.drop` adds back where they went before it
    takes the share off (the step end writes one share per token, not its dicts)."""

    work: dict[int, InstanceWork]  # id(instance) -> its `tally` share there
    loads: dict[str, int]  # instance name -> tokens (`load_of`)
    growing: tuple[str, ...]  # the instances whose load its output tokens add to
    seats: tuple[str, ...]  # `seat_holders`
    queued: tuple[str, int] | None  # (instance, prompt tokens) queued there (`Picker.prompt_queues`)
    unnamed: int  # prompt tokens of its reservation on its way, no prefill instance named
    max_tokens: int
    advanced: int = 0  # output tokens `advance` counted since `touch`
    # Where it decodes, once the router has seen its first token (what `advance` moves):
    decoding_work: InstanceWork | None = field(default=None, repr=False)  # its share there
    decoding_total: InstanceWork | None = field(default=None, repr=False)  # that instance's sums
    decoding_progress: ProgressTable | None = field(default=None, repr=False)  # that instance's rows


class Ledger:
    """The sums of the live requests over ``instances`` (module docstring).

    Args:
        instances: every instance of the fleet.
        routed: request id -> the prefill instance an adaptive remote decision named for it
            while its reservation is on its way (the `Placer`'s; `FleetModel.views`): read at
            each `touch`, which the caller makes when that changes.
    """

    def __init__(self, instances: list, routed: Mapping[str, str] | None = None) -> None:
        self.instances = list(instances)
        self.routed = routed if routed is not None else {}
        self._by_name = {inst.name: inst for inst in self.instances}
        self._clear()

    def _clear(self) -> None:
        self.work = {id(inst): InstanceWork() for inst in self.instances}
        # instance -> its decodes' progress, a row per decode whose first token the router has seen
        self.progress: dict[int, ProgressTable] = {key: ProgressTable() for key in self.work}
        self.loads: collections.Counter[str] = collections.Counter()
        self.seats: collections.Counter[str] = collections.Counter()
        self.queued: collections.Counter[str] = collections.Counter()
        self.unnamed = 0
        self.outputs = self.count = 0
        self._shares: dict[str, _Share] = {}

    def add(self, inst) -> None:
        """Count ``inst``, an instance that joined the fleet (a replacement, `cluster.restart`)."""
        self.instances.append(inst)
        self._by_name[inst.name] = inst
        self.work[id(inst)], self.progress[id(inst)] = InstanceWork(), ProgressTable()

    def __len__(self) -> int:
        """The requests counted."""
        return len(self._shares)

    # ------------------------------------------------------------------ moves
    def touch(self, req: RoutedRequest) -> None:
        """``req`` is live and was placed or changed where it is: its share is taken again (a
        request that ended comes off, as `drop`)."""
        self.drop(req)
        if req.done:
            return
        named = [inst for inst in (req.colocated, req.decode, req.prefill) if inst is not None]
        routed = self._by_name.get(self.routed.get(req.request_id))
        if routed is not None and req.stage == "reserving" and req.prefill is None:
            named.append(routed)  # its prompt queued there already (`tally`)
        work, _ = tally(named, (req,), None, self.routed)
        loads = {inst.name: tokens for inst, tokens in load_of(req)}
        growing = tuple(inst.name for inst in (req.decode, req.colocated) if inst is not None)
        inst, tokens = queued_prompt(req)
        queued, unnamed = (None, tokens) if inst is None else ((inst.name, tokens), 0)
        share = _Share(work, loads, growing, tuple(inst.name for inst in seat_holders(req)), queued, unnamed,
                       int(req.params.max_tokens))
        self._shares[req.request_id] = share
        for key, part in work.items():
            _add(self.work[key], part, 1)
            if part.decoding:
                share.decoding_work, share.decoding_total = part, self.work[key]
                share.decoding_progress = self.progress[key]
                if req.first_token_at is not None:
                    self.progress[key].add(req.request_id, req.first_token_at, req.num_output, share.max_tokens)
        self.loads.update(loads)
        self.seats.update(share.seats)
        if queued is not None:
            self.queued[queued[0]] += queued[1]
        self.unnamed += unnamed
        self.outputs += share.max_tokens
        self.count += 1

    def advance(self, req: RoutedRequest, num_tokens: int) -> None:
        """``req``, touched since its first token, made ``num_tokens`` more (``req.num_output``
        counts them already) and nothing else about it changed."""
        share = self._shares.get(req.request_id)
        if share is None:
            return
        share.advanced += num_tokens
        loads = self.loads
        for name in share.growing:
            loads[name] += num_tokens
        part = share.decoding_work
        if part is not None:
            num_output = req.num_output
            remaining = share.max_tokens - num_output
            if remaining < 1:  # max(..., 1) without the call: this runs once per request per step
                remaining = 1
            total = share.decoding_total
            total.context += num_tokens
            total.remaining += remaining - part.remaining
            part.remaining = remaining
            share.decoding_progress.set_output(req.request_id, num_output)

    def drop(self, req: RoutedRequest) -> None:
        """``req`` ended (or is about to be touched again): its share comes off."""
        share = self._shares.pop(req.request_id, None)
        if share is None:
            return
        if share.advanced:  # the tokens `advance` added since the share was taken
            for name in share.growing:
                share.loads[name] += share.advanced
            if share.decoding_work is not None:
                share.decoding_work.context += share.advanced
        for key, part in share.work.items():
            _add(self.work[key], part, -1)
            self.progress[key].remove(req.request_id)
        self.loads.subtract(share.loads)
        self.seats.subtract(share.seats)
        if share.queued is not None:
            self.queued[share.queued[0]] -= share.queued[1]
        self.unnamed -= share.unnamed
        self.outputs -= share.max_tokens
        self.count -= 1

    # ------------------------------------------------------------------ reads
    def tally(self, instances: list, now: float | None) -> tuple[dict[int, InstanceWork], float | None]:
        """`placement.tally` of the live requests over ``instances`` (`FleetModel.views`)."""
        work = {}
        for inst in instances:
            key = id(inst)
            view = self.work[key].copy()
            view.progress = NO_PROGRESS if now is None else self.progress[key].snapshot(now)
            work[key] = view
        return work, (self.outputs / self.count if self.count else None)

    def audit(self, live: Collection[RoutedRequest], now: float | None = None) -> str | None:
        """The first sum that is not the one over the ``live`` requests (`placement.tally`, the
        `Picker`'s), as a sentence; None when every one is. O(live requests)."""
        live = list(live)
        instances = self.instances
        for inst in instances:
            problem = self.progress[id(inst)].audit()
            if problem is not None:
                return f"{inst.name}: {problem}"
        expected, expected_out = tally(instances, live, now, self.routed)
        tracked, tracked_out = self.tally(instances, now)
        for inst in instances:
            want, got = expected[id(inst)], tracked[id(inst)]
            for name in WORK_FIELDS + ("progress",):
                a, b = getattr(want, name), getattr(got, name)
                a, b = (sorted(a), sorted(b)) if name == "progress" else (a, b)
                if a != b:
                    return f"{inst.name}: tracked {name} {b} != {a} summed over the live requests"
        if tracked_out != expected_out:
            return f"tracked mean max_tokens {tracked_out} != {expected_out} over the live requests"
        summed, kept = Picker("least_loaded"), Picker("least_loaded", ledger=self)
        for what in ("loads", "seats", "prompt_queues"):
            want, got = getattr(summed, what)(instances, live), getattr(kept, what)(instances, ())
            if got != want:
                return f"tracked {what} {got} != {want} summed over the live requests"
        return None

    def check(self, live: Collection[RoutedRequest], now: float | None = None) -> None:
        """Assert that every sum is the one over the ``live`` requests (`audit`)."""
        problem = self.audit(live, now)
        assert problem is None, problem

    def rebuild(self, live: Collection[RoutedRequest]) -> None:
        """Forget every share and take those of the ``live`` requests again (after an `audit`
        found a move that was not reported)."""
        self._clear()
        for req in live:
            self.touch(req)


def _add(total: InstanceWork, part: InstanceWork, sign: int) -> None:
    for name in WORK_FIELDS:
        setattr(total, name, getattr(total, name) + sign * getattr(part, name))
