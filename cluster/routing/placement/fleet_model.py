"""`FleetModel`: the router's picture of its instances, read into `InstanceView`s for `decide`.

Per instance: a `StepTimeModel` fed from its step samples, its last reported load, its meters
(`meters`), and its share of the live requests' work (`tally`, or the tracked `Ledger`'s sums).
One per `Placer`, in the router's (or the simulator's) process; no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping

from disagg.cluster.routing.placement.meters import HopMeter, RateMeter, StallMeter
from disagg.cluster.routing.placement.progress import DecodeProgress
from disagg.cluster.routing.placement.view import InstanceView
from disagg.cluster.routing.requests import seat_holders
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.engine.steps import prompt_pairs

TTFT_MISS_WEIGHT = 1 / 16  # `FleetModel.note_ttft`: the miss follows about the last 16 first tokens


class InstanceWork:
    """One instance's share of the live requests, summed by `FleetModel.views`: the fields of
    its `InstanceView` that the requests give. ``progress``: its decodes' rows as they are
    summed (`add`), a `DecodeProgress` once `tally` (or `Ledger.tally`) returns it."""

    __slots__ = ("queued", "pairs", "decoding", "context", "remaining", "progress", "seated", "incoming")

    def __init__(self) -> None:
        self.queued = self.pairs = self.decoding = self.context = self.remaining = self.seated = self.incoming = 0
        self.progress: list[tuple[float, int, int]] | DecodeProgress = []

    def copy(self) -> InstanceWork:
        """These sums, ``progress`` left empty (`Ledger.tally`, at every decision)."""
        new = InstanceWork()
        new.queued, new.pairs, new.decoding, new.context = self.queued, self.pairs, self.decoding, self.context
        new.remaining, new.seated, new.incoming = self.remaining, self.seated, self.incoming
        return new

    def add(self, req, computing: bool, max_tokens: int, now: float | None) -> None:
        """``req`` (of ``max_tokens``) placed here: its prompt queued (``computing``: not yet
        computed), else decoding here, with its progress where ``now`` and its first token are
        known (`InstanceView.decode_progress`)."""
        prompt_len = len(req.prompt_token_ids)
        if computing:  # what follows its prefix believed cached there (`RoutedRequest.cached_tokens`)
            cached = min(req.cached_tokens, prompt_len - 1)
            self.queued += prompt_len - cached
            self.pairs += prompt_pairs(cached, prompt_len - cached)
            if req.colocated is not None:  # decodes here once computed: beside the prompts placed after it
                self.incoming += 1
            return
        num_output = req.num_output
        self.decoding += 1
        self.context += prompt_len + num_output
        self.remaining += max(max_tokens - num_output, 1)
        if now is not None and req.first_token_at is not None:
            self.progress.append((now - req.first_token_at, num_output, max_tokens))


def tally(instances: list, requests: Collection, now: float | None = None,
          routed: Mapping[str, str] | None = None) -> tuple[dict[int, InstanceWork], float | None]:
    """The work of ``requests`` on each of ``instances`` (`FleetModel.views`): id(instance) ->
    its `InstanceWork`, and the mean max_tokens of the requests (None: none)."""
    routed = routed or {}
    unique = {id(inst): inst for inst in instances}  # an instance listed twice is viewed once
    work = {key: InstanceWork() for key in unique}
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for key, inst in unique.items():
        by_name[inst.name].append(key)
    outputs = count = 0
    of = work.get  # the hot loop of a decision (a 64-instance fleet: ~1,600 live requests each)
    for req in requests:
        max_tokens = int(req.params.max_tokens)
        outputs, count = outputs + max_tokens, count + 1
        for held in seat_holders(req):  # each instance once: one seat however held
            w = of(id(held))
            if w is not None:
                w.seated += 1
        stage, colocated, decode, prefill = req.stage, req.colocated, req.decode, req.prefill
        if colocated is not None:  # local or kept: prompt here until its first token
            w = of(id(colocated))
            if w is not None:
                w.add(req, req.num_output == 0, max_tokens, now)
        computing = stage == "reserving" or stage == "prefilling"
        if computing and decode is not None and decode is not colocated:
            w = of(id(decode))
            if w is not None:
                w.incoming += 1
        if computing and prefill is not None:
            if prefill is not colocated:
                w = of(id(prefill))
                if w is not None:
                    w.add(req, True, max_tokens, now)
        elif stage == "reserving" and prefill is None:
            for key in by_name.get(routed.get(req.request_id), ()):
                if unique[key] is not colocated:
                    work[key].add(req, True, max_tokens, now)
        elif stage == "decoding" and decode is not None and decode is not colocated:
            w = of(id(decode))
            if w is not None:
                w.add(req, False, max_tokens, now)
    for w in work.values():
        w.progress = DecodeProgress.of(w.progress)
    return work, (outputs / count if count else None)


class FleetModel:
    """The router's picture of its instances for `decide`: a `StepTimeModel` per instance fed
    from its step samples, its last reported load, and its live requests' prompt and decode work.

    Args:
        chunk_tokens: every engine's prompt-token budget per step (scheduler.max_num_batched_tokens).
        page_size: tokens per page.
        seed_fit: a profile's fit (`StepTimeModel.to_dict`, `disagg profile`'s "fit"): every
            instance's model starts from it and is pulled towards it (`router.step_profile`);
            None: the `StepTimeModel` defaults.
        reserve_waits, max_seqs, launches_ahead: every view's (`InstanceView`): from
            scheduler.overlap_reservations, max_num_seqs and async_scheduling.
        measured_hops: the views carry the hops measured (`note_reserve`, `note_relay`;
            `router.measured_hops`); False: they are still measured (`snapshot`), not priced.

    Attributes:
        ledger: the `disagg.cluster.routing.ledger.Ledger` of a tracked `Placer`, which keeps `tally`'s
            sums up to date as the requests move: a decision costs O(instances + decodes), not
            O(live requests); None: `views` runs `tally` at every decision.
    """

    def __init__(self, chunk_tokens: int, page_size: int, seed_fit: dict | None = None,
                 reserve_waits: bool = True, max_seqs: int | None = None, launches_ahead: bool = False,
                 measured_hops: bool = True) -> None:
        self.chunk_tokens, self.page_size = chunk_tokens, page_size
        self.measured_hops = measured_hops
        self.launches_ahead = launches_ahead
        self.max_seqs = max_seqs
        self.seed_fit = seed_fit
        self.reserve_waits = reserve_waits
        self.models: dict[str, StepTimeModel] = {}
        self.loads: dict[str, object] = {}  # name -> `InstanceLoad` of its last batch
        self.stalls: dict[str, StallMeter] = collections.defaultdict(StallMeter)
        self.ttft_miss: dict[str, dict[str, float]] = collections.defaultdict(dict)  # name -> path -> s
        self.reserve_extra: dict[str, HopMeter] = collections.defaultdict(HopMeter)  # `note_reserve`
        self.relay: dict[str, HopMeter] = collections.defaultdict(HopMeter)  # `note_relay`
        self.pushes: dict[str, RateMeter] = collections.defaultdict(RateMeter)  # `note_push`
        self.ledger = None

    def model_of(self, name: str) -> StepTimeModel:
        model = self.models.get(name)
        if model is None:
            model = self.models[name] = (StepTimeModel() if self.seed_fit is None
                                         else StepTimeModel.from_dict(self.seed_fit))
        return model

    def observe(self, name: str, steps: list, load: object | None) -> None:
        """Feed one `OutputBatch`'s step samples and load of instance ``name``."""
        model = self.model_of(name)
        for sample in steps:
            model.observe(*sample[:5])
            self.note_step(name, *sample[:5], gap_s=sample[5] if len(sample) > 5 else 0.0)
        if load is not None:
            self.loads[name] = load

    def note_ttft(self, name: str, path: str, measured_s: float, predicted_s: float) -> None:
        """A request of ``path`` whose prompt instance ``name`` computed had its first token
        ``measured_s`` after its placement, predicted ``predicted_s``: the path's recent miss
        (exponentially weighted, `TTFT_MISS_WEIGHT`), a diagnostic in `snapshot`. Not fed back
        into the predictions: a constant correction of a load-dependent miss makes them worse,
        and it learns only on the paths still taken."""
        misses = self.ttft_miss[name]
        old = misses.get(path)
        miss = measured_s - predicted_s
        misses[path] = miss if old is None else old + TTFT_MISS_WEIGHT * (miss - old)

    def note_reserve(self, name: str, measured_s: float, step_s: float) -> None:
        """A reservation on decode instance ``name`` answered ``measured_s`` after its decision,
        which predicted it to wait ``step_s`` for the step in flight: the rest is what reservations
        there take beyond their step (`InstanceView.reserve_extra_s`)."""
        self.reserve_extra[name].note(measured_s - step_s)

    def note_push(self, name: str, now: float) -> None:
        """A push to decode instance ``name`` was decided at ``now`` (`InstanceView.push_rate`)."""
        self.pushes[name].note(now)

    def note_relay(self, name: str, seconds: float) -> None:
        """A first token instance ``name`` computed reached the router ``seconds`` after its step
        returned (`InstanceView.relay_s`; a negative reading, clocks apart, counts as 0)."""
        self.relay[name].note(max(seconds, 0.0))

    def note_step(self, name: str, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
                  num_prompt_pairs: int, seconds: float, count: int = 1, gap_s: float = 0.0) -> None:
        """Feed ``count`` measured steps of that shape to instance ``name``'s `StallMeter` (steps
        without decodes stall nobody), each after ``gap_s`` of host time its decodes waited
        (`StepSample.gap_s`): a token's gap is the step and that (timed by their GPU spans alone,
        the decodes' gaps would be predicted short by the host's part)."""
        if num_decode_seqs and seconds > 0:
            pure = self.model_of(name).step_s(0, num_decode_seqs, num_context_tokens, 0)
            self.stalls[name].note(seconds + gap_s, pure, count)

    def view(self, inst, requests: Collection, now: float | None = None, routed: Mapping[str, str] | None = None
             ) -> InstanceView:
        """``inst`` (an `Instance`) with the work of the router's live ``requests`` on it: `views`
        of it alone."""
        return self.views([inst], requests, now, routed)[0]

    def views(self, instances: list, requests: Collection, now: float | None = None,
              routed: Mapping[str, str] | None = None) -> list[InstanceView]:
        """Each of ``instances`` (`Instance`s) with the work of the router's live ``requests`` on
        it, in their order; ``now`` (the clock of their ``first_token_at``) also gives its
        decodes' progress. ``routed``: request id -> the prefill instance a remote decision named
        for a request whose reservation is still on its way (no ``prefill`` yet: `Placer.hand`
        names it when the decode instance answers): its prompt is queued there already, as
        `Placer.route`'s prefill-queue bound counts it (so a prompt decided in the same instant is
        not priced in front of it).

        One pass over the requests for all instances (a pass per instance would make a decision
        O(instances x live requests)). A request counts on the instance each of its fields names,
        never twice on one: its ``colocated`` one; its prefill instance (or the routed one) while
        its prompt is computed there; its decode instance while it decodes (`tally`). With a ``ledger`` the same sums
        come from it instead (``requests`` and ``routed`` unread)."""
        if self.ledger is not None:
            work, output_tokens = self.ledger.tally(instances, now)
        else:
            work, output_tokens = tally(instances, requests, now, routed)
        return [self._view(inst, work[id(inst)], output_tokens, now) for inst in instances]

    def _view(self, inst, work: InstanceWork, output_tokens: float | None, now: float | None = None) -> InstanceView:
        """``inst``'s `InstanceView` of its ``work`` and this model's picture of it."""
        name = inst.name
        load = self.loads.get(name)
        hops = (self.reserve_extra[name].median, self.relay[name].median) if self.measured_hops else (0.0, 0.0)
        return InstanceView(name, self.model_of(name), self.chunk_tokens, work.queued, work.decoding, work.context,
                            None if load is None else load.free_pages, self.page_size, work.pairs, work.remaining,
                            output_tokens, self.stalls[name].factor, self.reserve_waits, work.progress,
                            self.max_seqs, work.seated, self.launches_ahead, *hops, incoming=work.incoming,
                            push_rate=self.pushes[name].rate(now) if name in self.pushes else 0.0)

    def snapshot(self) -> dict:
        """Each instance's fitted model (coefficients, error, samples), its stall factor, its
        measured hops (ms) and its recent TTFT miss per path (measured - predicted, ms)."""
        return {name: {**model.to_dict(), "stall_factor": round(self.stalls[name].factor, 3),
                       "reserve_extra_ms": round(self.reserve_extra[name].median * 1e3, 2),
                       "relay_ms": round(self.relay[name].median * 1e3, 2),
                       "ttft_miss_ms": {path: round(s * 1e3, 2) for path, s in self.ttft_miss.get(name, {}).items()}}
                for name, model in self.models.items()}
