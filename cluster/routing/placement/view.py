"""`InstanceView`: one instance as the placement sees it, its step-time model and live load.

Built by `FleetModel.views` for each decision; every prediction of a path's TTFT and TPOT
(`predict`) and every admission rule (`admission`) reads instances through it. A view is one
decision's snapshot: it takes its decodes' pure step as it is made and each chunk shape's
seconds once (`chunks`; a decision prices the same steps in many rules), so its model is not to
be refitted while it is read. Pure, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from disagg.cluster.routing.placement.progress import NO_PROGRESS, DecodeProgress
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.engine.steps import prompt_pairs

# A stall counts in the running decodes' TPOT over this share of their mean remaining tokens:
# the rest of their budget is left to the prompts that come after it.
HORIZON_SHARE = 0.5


@dataclass
class InstanceView:
    """One instance as the decision sees it: its model and live load. Not written once made
    (a plain dataclass, not a frozen one: a decision makes one per instance, and a frozen
    dataclass's ``__init__`` costs several times a plain one's).

    Attributes:
        name: the instance's name.
        model: its `StepTimeModel`.
        chunk_tokens: prompt tokens per step (scheduler.max_num_batched_tokens).
        queued_prompt_tokens: prompt tokens placed on it and not yet computed.
        num_decoding: sequences decoding on it.
        context_tokens: the tokens those sequences attend to.
        free_pages: pages it can still give (None: unknown, assumed enough).
        page_size: tokens per page.
        queued_prompt_pairs: the attention pairs of the queued prompts (`prompt_pairs` of each
            whole prompt: L (L + 1) / 2 for L tokens, however chunked).
        remaining_tokens: output tokens its decodes may still produce (None: unknown: their TPOT
            is one step's, else their mean over what remains, `mean_tpot_s`).
        output_tokens: the tokens a request placed here is expected to decode (the mean
            max_tokens of the router's live requests; None: unknown).
        stall_factor: its recent steps with decodes over pure decode steps of the same decodes
            (`StallMeter`, >= 1): future decode steps are predicted that much longer.
        reserve_waits: a reservation waits for the forward in flight; False with
            `scheduler.overlap_reservations` (answered mid-forward).
        launches_ahead: its engine launches each pure-decode step before reading the one in
            flight (`scheduler.async_scheduling`; `prompt_wait_s`).
        decode_progress: per decode whose first token the router has seen, ``(seconds since that
            token, tokens so far, max_tokens)`` (`tpot_slack_s`): a `DecodeProgress` (rows given
            as tuples become one); empty: unknown.
        max_seqs: scheduler.max_num_seqs (None: no limit; `seat_wait_s`).
        seated: the sequences holding or awaiting a seat: the decodes, the prompts queued here,
            and pushes reserved here whose prompt is still computed elsewhere.
        reserve_extra_s: what recent reservations took beyond their predicted step in flight (the
            Ray round trip, the actor's other calls, the model's error; may be < 0;
            `FleetModel.note_reserve`).
        relay_s: what recent first tokens computed here took to reach the router
            (`FleetModel.note_relay`).
        incoming: requests that will decode here whose prompts are not yet computed: pushes
            reserved here, local or kept prompts queued here (`tpot_slack_s`).
        push_rate: pushes decided to it per second, recently (`RateMeter`; `admission.stall_past_slack`).
    """

    name: str
    model: StepTimeModel
    chunk_tokens: int
    queued_prompt_tokens: int = 0
    num_decoding: int = 0
    context_tokens: int = 0
    free_pages: int | None = None
    page_size: int = 16
    queued_prompt_pairs: int = 0
    remaining_tokens: int | None = None
    output_tokens: float | None = None
    stall_factor: float = 1.0
    reserve_waits: bool = True
    decode_progress: DecodeProgress = NO_PROGRESS
    max_seqs: int | None = None
    seated: int = 0
    launches_ahead: bool = False
    reserve_extra_s: float = 0.0
    relay_s: float = 0.0
    incoming: int = 0
    push_rate: float = 0.0
    # A pure decode step of the sequences decoding here, taken as the view is made: what most
    # rules price (the step in flight, the decodes' gap, the stall beyond it), many times a decision.
    pure_step_s: float = field(init=False, repr=False, compare=False)
    _chunks: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.decode_progress, DecodeProgress):  # rows given as tuples
            self.decode_progress = DecodeProgress.of(self.decode_progress)
        self.pure_step_s = self.model.step_s(0, self.num_decoding, self.context_tokens, 0)
        self._chunks = {}  # (prompt tokens, pairs, seqs, context) -> `chunks`

    def step_in_flight_s(self) -> float:
        """What a call waits for the forward running here at most (its decodes' step; 0 when none
        decode)."""
        return self.pure_step_s if self.num_decoding else 0.0

    def reserve_step_s(self) -> float:
        """The step in flight a reservation made here now is predicted to wait for: none when
        reservations are answered mid-forward (``reserve_waits`` False)."""
        return self.step_in_flight_s() if self.reserve_waits else 0.0

    def reserve_wait_s(self) -> float:
        """What a reservation made here now takes until the router has its answer: the step in
        flight (`reserve_step_s`) and what the recent ones took beyond it (``reserve_extra_s``)."""
        return max(self.reserve_step_s() + self.reserve_extra_s, 0.0)

    def prompt_wait_s(self) -> float:
        """What a prompt placed here now waits before its first chunk can run, on average: the
        rest of the decodes' step in flight (half of it), and where the engine launched the next
        pure-decode step ahead (``launches_ahead``, nobody queued here) that whole step too: the
        prompt joins the step after it (`EngineCore._launch_ahead`)."""
        step = self.step_in_flight_s()
        return step * (1.5 if self.launches_ahead and not self.queued_prompt_tokens else 0.5)

    def seat_wait_s(self) -> float:
        """Seconds a sequence placed here now waits for a seat: 0 while ``seated`` is under
        ``max_seqs``; else until the k-th of the running decodes ends (k: the sequences beyond the
        limit, this one included), each ending after its remaining tokens at `decode_gap_s`; where
        fewer decodes' progress is known, the mean remaining tokens'."""
        over = self.seated + 1 - self.max_seqs if self.max_seqs else 0
        if over <= 0:
            return 0.0
        gap = self.decode_gap_s(self.num_decoding, self.context_tokens)
        progress = self.decode_progress
        ends = np.maximum(progress.max_tokens - progress.num_output, 0) * gap  # each decode's, unsorted
        if len(ends) >= over:
            return float(np.partition(ends, over - 1)[over - 1])
        mean = self.remaining_tokens / self.num_decoding if self.remaining_tokens and self.num_decoding else 0.0
        return max(float(ends.max()) if len(ends) else 0.0, mean * gap)

    def fits(self, prompt_len: int) -> bool:
        return self.free_pages is None or self.free_pages >= math.ceil((prompt_len + 1) / self.page_size)

    def prefill_s(self, prompt_len: int, cached: int = 0) -> float:
        """Seconds until a prompt of ``prompt_len`` placed now is computed here: the queue ahead
        of it and then its own tokens past the ``cached`` ones (its prefix found in this
        instance's cache), in chunks of ``chunk_tokens`` beside the decodes (the model is linear:
        its steps' sum is the number of steps times the mean step)."""
        total = self.queued_prompt_tokens + prompt_len - cached
        pairs = self.queued_prompt_pairs + prompt_pairs(cached, prompt_len - cached)
        return self.chunks(total, pairs, self.num_decoding, self.context_tokens)[1]

    def queue_left(self, after_s: float) -> tuple[int, int]:
        """The prompt tokens (and their attention pairs) queued here still to compute ``after_s``
        from now: the queue is computed in `prefill_s` (0) seconds, at an even pace."""
        if not self.queued_prompt_tokens or after_s <= 0.0:
            return self.queued_prompt_tokens, self.queued_prompt_pairs
        share = max(0.0, 1.0 - after_s / self.prefill_s(0))
        return round(share * self.queued_prompt_tokens), round(share * self.queued_prompt_pairs)

    def chunks(self, prompt_tokens: int, num_prompt_pairs: int, seqs: int, context: int) -> tuple[int, float]:
        """The steps and seconds of ``prompt_tokens`` (of ``num_prompt_pairs`` attention pairs)
        computed here in chunks of ``chunk_tokens`` beside ``seqs`` decoding sequences of
        ``context`` tokens (the model is linear: the steps' sum is their number times the mean
        step); (0, 0.0) for no tokens. Each shape computed once per view: a decision prices the
        same chunks in a prompt's TTFT, in the TPOT of the decodes beside them and in their stall."""
        key = (prompt_tokens, num_prompt_pairs, seqs, context)
        priced = self._chunks.get(key)
        if priced is None:
            steps = -(-prompt_tokens // self.chunk_tokens)
            if steps:
                mean_step_s = self.model.step_s(prompt_tokens / steps, seqs, context, num_prompt_pairs / steps)
                priced = self._chunks[key] = (steps, steps * mean_step_s)
            else:
                priced = self._chunks[key] = (0, 0.0)
        return priced

    def decode_step_s(self, extra_seqs: int = 0, extra_context: int = 0, prompt_tokens: int = 0) -> float:
        """Seconds of one decode step here with that much more work in it (``prompt_tokens``: a
        chunk of them, a prompt's first)."""
        chunk = min(prompt_tokens, self.chunk_tokens)
        return self.model.step_s(chunk, self.num_decoding + extra_seqs, self.context_tokens + extra_context,
                                 prompt_pairs(0, chunk))

    def mean_tpot_s(self, horizon: float, prompt_tokens: int, num_prompt_pairs: int, extra_seqs: int = 0,
                    extra_context: int = 0) -> float:
        """The mean seconds per output token, over the next ``horizon`` tokens, of the sequences
        decoding here (and ``extra_seqs`` more) while ``prompt_tokens`` (of ``num_prompt_pairs``
        pairs) are computed in chunks beside them: the chunks' n steps, then ``horizon`` - n pure
        decode steps, over ``horizon`` (the chunks' steps alone when n >= ``horizon``): a stall is
        spread over the tokens it delays, as a request's TPOT spreads it."""
        horizon = max(horizon, 1.0)
        seqs, context = self.num_decoding + extra_seqs, self.context_tokens + extra_context
        steps, chunks_s = self.chunks(prompt_tokens, num_prompt_pairs, seqs, context)
        if steps >= horizon:
            return chunks_s / steps
        return (chunks_s + (horizon - steps) * self.decode_gap_s(seqs, context)) / horizon

    def stall_s(self, prompt_tokens: int, num_prompt_pairs: int) -> float:
        """Seconds the running decodes wait beyond their pure decode steps while ``prompt_tokens``
        (of ``num_prompt_pairs`` pairs) are computed here in chunks beside them."""
        seqs, context = self.num_decoding, self.context_tokens
        steps, chunks_s = self.chunks(prompt_tokens, num_prompt_pairs, seqs, context)
        return chunks_s - steps * (self.pure_step_s if seqs else 0.0)

    def tpot_slack_s(self, bound_s: float) -> float | None:
        """The most seconds of stall its decodes can all still absorb within a TPOT of ``bound_s``
        (the SLO's TPOT: decode time over tokens less one). A request that decoded k of its n
        tokens in e seconds, the rest at `decode_gap_s`, has ``bound_s (n - 1) - e - (n - k) gap``;
        each request on its way (``incoming``), one of ``output_tokens`` not yet started,
        ``bound_s (n - 1) - n gap``. The least of those that hold the bound (a stall cannot save
        the rest); None: none known to hold it."""
        slacks = self.tpot_slacks_s(bound_s)
        return float(slacks.min()) if len(slacks) else None

    def tpot_slacks_s(self, bound_s: float, incoming: int | None = None) -> np.ndarray:
        """Each slack `tpot_slack_s` takes the least of, ``[num_slacks]`` float64 in no order: one
        per running decode of 2 tokens or more predicted to hold ``bound_s``, one per request on
        its way (``incoming``; None: this view's) (`fleet_tpot_slacks_s` of this view alone)."""
        return fleet_tpot_slacks_s([self], bound_s, incoming)[0]

    def fresh_slack_s(self, bound_s: float) -> float | None:
        """The TPOT slack (`tpot_slack_s`) of a request of ``output_tokens`` that starts decoding
        here now: ``bound_s (n - 1) - n gap``; None where its TPOT is unknown (``output_tokens``
        unknown, or under 2)."""
        n = self.output_tokens
        if not n or n <= 1:
            return None
        return bound_s * (n - 1) - n * self.decode_gap_s(self.num_decoding, self.context_tokens)

    def decode_gap_s(self, seqs: int, context: int) -> float:
        """The seconds between two tokens of ``seqs`` sequences decoding here from now on: a pure
        decode step, stretched by the prompt chunks that keep coming (``stall_factor``)."""
        if seqs == self.num_decoding and context == self.context_tokens:
            return self.stall_factor * self.pure_step_s
        return self.stall_factor * self.model.step_s(0, seqs, context, 0)

    @property
    def running_horizon(self) -> float | None:
        """The tokens over which a stall now counts in the running decodes' TPOT:
        `HORIZON_SHARE` x their mean remaining tokens (None: none decode, or unknown)."""
        if not self.remaining_tokens or not self.num_decoding:
            return None
        return HORIZON_SHARE * self.remaining_tokens / self.num_decoding


def fleet_tpot_slacks_s(views: Sequence[InstanceView], bound_s: float, incoming: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Every slack `InstanceView.tpot_slacks_s` takes of each of ``views``, in one numpy pass
    over all their decodes (a decision judges every instance: numpy's per-call cost, paid per
    instance, would outweigh the arithmetic). Each decode's slack is its row's own arithmetic, in
    its order: the one a decode-by-decode sum computes, bit for bit.

    Args:
        views: the instances.
        bound_s: the TPOT bound.
        incoming: the requests on their way counted on each (None: each view's ``incoming``).

    Returns:
        ``(slacks, owner)``, ``[num_slacks]`` float64 and int64: the slacks that hold the bound
        (>= 0), in no order, and the index in ``views`` of the instance of each.
    """
    if not views:
        return np.empty(0), np.empty(0, dtype=np.int64)
    progress = [v.decode_progress for v in views]
    # per view: its decodes' gap, the tokens of a request on its way, how many are on their way
    gaps, outputs, counts = np.array([(v.decode_gap_s(v.num_decoding, v.context_tokens), v.output_tokens or 0.0,
                                       v.incoming if incoming is None else incoming) for v in views]).T
    owner = np.repeat(np.arange(len(views)), [len(p) for p in progress])
    n = np.concatenate([p.max_tokens for p in progress])
    k = np.concatenate([p.num_output for p in progress])
    elapsed = np.concatenate([p.elapsed_s for p in progress])
    slacks = bound_s * (n - 1) - elapsed - (n - k) * gaps[owner]
    several = n > 1  # a TPOT needs two tokens
    fresh = (counts > 0) & (outputs > 1)  # the requests on their way whose TPOT is known (`fresh_slack_s`)
    if fresh.any():
        count = counts[fresh].astype(np.int64)
        owner = np.concatenate((owner, np.repeat(np.flatnonzero(fresh), count)))
        slacks = np.concatenate((slacks, np.repeat((bound_s * (outputs - 1) - outputs * gaps)[fresh], count)))
        several = np.concatenate((several, np.ones(int(count.sum()), dtype=bool)))
    held = several & (slacks >= 0)
    return slacks[held], owner[held]
