"""Where a request's prompt is prefilled: the adaptive decision over the instances' step-time models.

`router.placement: adaptive` (docs/ARCHITECTURE.md §7) chooses per request among three paths:

    remote  a prefill instance P computes the prompt and pushes its KV layer by layer into a
            decode instance D's pages; D decodes it
    local   a decode instance D prefills it itself, in chunks beside its running decodes
    kept    a prefill instance P prefills it and also decodes it

from predicted times: each instance has a `StepTimeModel` (`disagg.cluster.step_model`: one
step's seconds as a linear function of its shape) fitted online from the instance's own measured
steps (`disagg.cluster.messages.StepSample`) and seeded with a prior (or a profile's fit,
`router.step_profile`), and
an `InstanceView` of its live load (prompt tokens queued, sequences decoding, free pages).
`decide` predicts TTFT and TPOT on every path and keeps the admissible ones: the pages fit (for a
push, the prompt's and its expected answer's: the decode side reserves both), and the targets
(`router.slo_ttft_ms` / `slo_tpot_ms`) hold; without a TPOT target, a path may not slow any running
decode step by more than 10% beyond the remote path's. TPOT is predicted as the SLO counts it, a
request's mean gap: a stall of prompt chunks is spread over the tokens it delays
(`InstanceView.mean_tpot_s`; where the router's requests' max_tokens are unknown, one step's). With
a TPOT target a prompt must also leave every request decoding where it is computed that still
holds the target holding it (D's for a local prompt, P's kept ones for a remote or kept one), and
those on their way there (`InstanceView.incoming`): its chunks' stall is added to each one's whole
TPOT, against what it has spent so far (`InstanceView.tpot_slacks_s`); a local prompt also counts
the pushes expected into its stall (D's recent push rate, `InstanceView.push_rate`) where no other
decode instance can take a push now; a push goes through the
fastest prefill instance that spares its kept requests where the fastest would not. With
`router.adaptive_prefer: remote` and a TTFT target an admissible remote path is taken (a TTFT
under its target earns nothing; local and kept spend the other phase's instance, for the requests
remote cannot serve within the targets); with `fastest`, among admissible paths the lowest predicted TTFT (ties within the model's error margin go to local, then
remote, then kept: `PREFERENCE`; with `balanced`, the config's default, that path, when it
decodes on a decode instance, gives way to an admissible kept one while the decode instance's
predicted TPOT is past `KEEP_SHARE` of the TPOT target, the prefill instance's is lower and the
TTFT target has room for its decode steps: `_decode_on_prefill`); when none is admissible, the smallest violation (a
remote one's TPOT counts the requests P keeps, its chunks beside them: `Prediction.worst_tpot_s`;
each request whose slack the path breaks adds one),
never a local prompt on a decode instance that already misses the TPOT bound or whose slack it
breaks, nor a remote or kept one through a prefill instance whose kept requests' slack it breaks
while another path spares them (with `router.adaptive_overload: no_push`, the least of the paths
that push nothing, a push only where none of them fits). A prompt
computed on an instance whose `scheduler.max_num_seqs` seats are taken waits for a decode there
to end, and a pushed request whose decode instance has none waits after its first token: both are
in the predictions (`InstanceView.seat_wait_s`). A
decode's future steps are predicted stretched by the prompt chunks its instance ran recently
(`StallMeter`): each local prompt is a small stall spread over many tokens, but together they
add up. Pure functions of their inputs, used by the `Placer` (`disagg.cluster.placer`) of the
router and of the simulator.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

from disagg.cluster.requests import seat_holders
from disagg.cluster.step_model import StepTimeModel
from disagg.config import RouterSection
from disagg.engine.steps import prompt_pairs

PATHS = ("remote", "local", "kept")
# Near-equal TTFTs (within the model's error margin) go to the path that disturbs least: local
# (admissible only when it slows no running decode step beyond the bound, it uses a decode
# instance's spare compute and needs no transfer), then remote, then kept.
PREFERENCE = ("local", "remote", "kept")
# `router.adaptive_prefer: balanced`: the fastest path decoding on a decode instance gives way to
# keeping the decode on the prefill instance while the decode instance's predicted TPOT is past
# this share of the TPOT target and the kept prompt's TTFT plus one of the prefill instance's
# decode steps is within this share of the TTFT target (`_decode_on_prefill`). The default since
# 2026-11-28: on two H200s it beat or tied `fastest` on chat and prefill-heavy
# (benchmarks/records/headline-h200x2-2026-11-28b/). Earlier: simulated it won decode-heavy (two
# GPUs, 50 : 34 ms, 1.00x -> 1.15x colocated) and lost strict chat (74 : 17 ms, 5.0 -> 3.8
# req/s/GPU); measured on two H100s (decode-heavy, 70.7 : 14.9 ms) 54% -> 64% attainment at 16
# req/s, 52% -> 43% at 22 (benchmarks/records/headline-h100x2-2026-11-27c/).
KEEP_SHARE = 0.5
DEFAULT_PREFER = RouterSection.model_fields["adaptive_prefer"].default  # one default: the config's
DEFAULT_OVERLOAD = RouterSection.model_fields["adaptive_overload"].default
TPOT_SLACK = 1.1  # without a TPOT target: a decode step may grow to 1.1 x the remote path's step
# A stall counts in the running decodes' TPOT over this share of their mean remaining tokens:
# the rest of their budget is left to the prompts that come after it.
HORIZON_SHARE = 0.5
TTFT_MISS_WEIGHT = 1 / 16  # `FleetModel.note_ttft`: the miss follows about the last 16 first tokens
STALL_WINDOW_STEPS = 128  # `StallMeter`'s memory: about a second of an 8B decode instance's steps
HOP_WINDOW = 32  # `HopMeter`: the recent hops whose median stands for the next one
PUSH_RATE_WINDOW_S = 2.0  # `RateMeter`: the seconds of recent pushes whose rate stands for the next ones


@dataclass(frozen=True)
class InstanceView:
    """One instance as the decision sees it: its model and live load.

    Attributes:
        name: the instance's name.
        model: its `StepTimeModel`.
        chunk_tokens: its prompt-token budget per step (scheduler.max_num_batched_tokens).
        queued_prompt_tokens: prompt tokens placed on it and not yet computed.
        num_decoding: sequences decoding on it.
        context_tokens: the tokens those sequences attend to.
        free_pages: pages it can still give (None: unknown, assumed enough).
        page_size: tokens per page.
        queued_prompt_pairs: the attention pairs of those prompts (`prompt_pairs` of each whole
            prompt: however it is chunked, a prompt of L tokens attends L (L + 1) / 2 pairs).
        remaining_tokens: output tokens its decoding sequences may still produce (their
            max_tokens less those produced; None: unknown). Known, the TPOT predicted for them is
            their mean over what remains (`mean_tpot_s`), as the SLO judges it; unknown, one step's.
        output_tokens: the tokens a request placed here is expected to decode (the mean
            max_tokens of the router's live requests; None: unknown, its TPOT is one step's).
        stall_factor: how much longer its recent steps with decodes ran than pure decode steps
            of the same decodes would (`StallMeter`, >= 1): the prompt chunks placed on it go on
            arriving, so a decode's future steps are predicted that much longer.
        reserve_waits: a reservation on it waits for its forward in flight (its actor runs calls
            between steps); False with `scheduler.overlap_reservations` (answered mid-forward).
        launches_ahead: its engine launches each pure-decode step before reading the tokens of
            the one in flight (`scheduler.async_scheduling`): `prompt_wait_s`.
        decode_progress: per request decoding here whose first token the router has seen,
            ``(seconds since that token, tokens so far, max_tokens)``: how much of its TPOT it
            has spent (`tpot_slack_s`); empty: unknown.
        max_seqs: the sequences its engine runs at once (scheduler.max_num_seqs; None: no
            limit): a prompt placed beyond them waits for a decode to end (`seat_wait_s`).
        seated: the sequences holding or awaiting one of those seats: ``num_decoding``, the
            prompts queued here, and pushed requests reserved here whose prompt is still being
            computed elsewhere.
        reserve_extra_s: what the recent reservations on it took beyond the step in flight they
            were predicted to wait for (`FleetModel.note_reserve`: the Ray round trip, the calls
            its actor ran first, the model's error; may be < 0): `reserve_wait_s`.
        relay_s: what the recent first tokens it computed took to reach the router
            (`FleetModel.note_relay`: its output batch's way back, the router's event loop).
        incoming: requests that will decode here whose prompts are not yet computed: pushed ones
            reserved here (their prompts computed elsewhere), and local or kept ones queued here:
            they decode here within a prompt's time, beside whatever prompt is then computed here
            (`tpot_slack_s` counts them as requests of ``output_tokens`` yet to start).
        push_rate: pushes decided to this instance per second, recently (`RateMeter`): those decided
            while a prompt computed here stalls its decodes arrive into that stall
            (`placement._stall_past_slack`).
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
    decode_progress: tuple = ()
    max_seqs: int | None = None
    seated: int = 0
    launches_ahead: bool = False
    reserve_extra_s: float = 0.0
    relay_s: float = 0.0
    incoming: int = 0
    push_rate: float = 0.0

    def step_in_flight_s(self) -> float:
        """What a call waits for the forward running here at most (its decodes' step; 0 when none
        decode)."""
        return self.model.step_s(0, self.num_decoding, self.context_tokens, 0) if self.num_decoding else 0.0

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
        prompt joins the step after it (`EngineCore._launch_ahead`). With the whole step in
        flight and no step ahead, the predicted TTFT of kept and local prompts was 14-17% short
        (simulated two H100s, decode-heavy 30 req/s, 256 seats, `balanced`; 5-9% with this)."""
        step = self.step_in_flight_s()
        return step * (1.5 if self.launches_ahead and not self.queued_prompt_tokens else 0.5)

    def seat_wait_s(self) -> float:
        """Seconds a sequence placed here now waits for a seat: 0 while ``seated`` is under
        ``max_seqs``; else until the k-th of the running decodes ends (k: the sequences beyond the
        limit, this one included), each ending after its remaining tokens at `decode_gap_s`; where
        fewer decodes' progress is known, the mean remaining tokens'. Decode-heavy on two H100s:
        every TTFT over 0.5 s came while 209-295 requests were in flight against 2 x 128 seats,
        waiting 0.1-5.6 s on one full instance while the other had seats
        (benchmarks/records/headline-h100x2-2026-11-27e/)."""
        over = self.seated + 1 - self.max_seqs if self.max_seqs else 0
        if over <= 0:
            return 0.0
        gap = self.decode_gap_s(self.num_decoding, self.context_tokens)
        ends = sorted(max(n - k, 0) * gap for _, k, n in self.decode_progress)
        if len(ends) >= over:
            return ends[over - 1]
        mean = self.remaining_tokens / self.num_decoding if self.remaining_tokens and self.num_decoding else 0.0
        return max(ends[-1] if ends else 0.0, mean * gap)

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
        step); (0, 0.0) for no tokens."""
        steps = -(-prompt_tokens // self.chunk_tokens)
        if not steps:
            return 0, 0.0
        return steps, steps * self.model.step_s(prompt_tokens / steps, seqs, context, num_prompt_pairs / steps)

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
        decode steps, over ``horizon`` (the chunks' steps alone when n >= ``horizon``). A stall of a
        few long steps is spread over the tokens it delays, as a request's TPOT (its decode time
        over its tokens) spreads it."""
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
        return chunks_s - steps * (self.model.step_s(0, seqs, context, 0) if seqs else 0.0)

    def tpot_slack_s(self, bound_s: float) -> float | None:
        """The most seconds of stall its running decodes can all still absorb within a TPOT of
        ``bound_s``, as the SLO counts a request's TPOT (its whole decode time over its tokens
        less one): a request that has decoded k of its n tokens in e seconds, the rest at
        `decode_gap_s`, has ``bound_s (n - 1) - e - (n - k) gap`` to spare. The smallest such
        slack of those predicted to hold the bound; those already past it are left out (a stall
        cannot save them); each push on its way (``incoming``) as one of ``output_tokens`` tokens
        not yet started: ``bound_s (n - 1) - n gap``. Without them, simulated 8 GPUs long-prompt
        (7P1D-adaptive) put prompts local on the one decode instance while pushes were on their way,
        and every later push was refused for the stall: 0.422 req/s per GPU against 0.938 for the
        same split fixed; with them 0.516 (1P7D-adaptive 0.656 -> 0.719;
        benchmarks/records/plan-h200-2026-11-28/). They refuse a local prompt while a path is
        admissible, but do not make the instance "saturated" where none is (`decide`): that took
        every prompt off the decode instance of a 1P1D fleet past the knee (simulated long-prompt
        at 1.4 req/s, 69.0% -> 23.8%). None: none known to hold it."""
        return min(self.tpot_slacks_s(bound_s), default=None)

    def tpot_slacks_s(self, bound_s: float) -> list[float]:
        """Each slack `tpot_slack_s` takes the least of: one per running decode predicted to hold
        ``bound_s``, one per request on its way (``incoming``)."""
        gap = self.decode_gap_s(self.num_decoding, self.context_tokens)
        slacks = [bound_s * (n - 1) - elapsed - (n - k) * gap for elapsed, k, n in self.decode_progress if n > 1]
        if self.incoming and self.output_tokens and self.output_tokens > 1:
            n = self.output_tokens
            slacks += [bound_s * (n - 1) - n * gap] * self.incoming
        return [s for s in slacks if s >= 0]

    def decode_gap_s(self, seqs: int, context: int) -> float:
        """The seconds between two tokens of ``seqs`` sequences decoding here from now on: a pure
        decode step, stretched by the prompt chunks that keep coming (``stall_factor``)."""
        return self.stall_factor * self.model.step_s(0, seqs, context, 0)

    @property
    def running_horizon(self) -> float | None:
        """The tokens over which a stall now counts in the running decodes' TPOT:
        `HORIZON_SHARE` x their mean remaining tokens (None: none decode, or unknown)."""
        if not self.remaining_tokens or not self.num_decoding:
            return None
        return HORIZON_SHARE * self.remaining_tokens / self.num_decoding


@dataclass(frozen=True)
class Targets:
    """The SLOs the decision predicts against, seconds (None: none), and what it prefers among
    the paths that hold them (``prefer``: `router.adaptive_prefer`, `decide`)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    prefer: str = DEFAULT_PREFER
    overload: str = DEFAULT_OVERLOAD

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None, prefer: str = DEFAULT_PREFER,
                overload: str = DEFAULT_OVERLOAD) -> Targets:
        return cls(None if ttft_ms is None else ttft_ms / 1e3, None if tpot_ms is None else tpot_ms / 1e3, prefer,
                   overload)


@dataclass(frozen=True)
class Prediction:
    """One candidate path with its predictions; ``admissible`` False says ``why``."""

    path: str
    prefill: str | None  # the instance that computes the prompt
    decode: str | None   # the instance that decodes it
    ttft_s: float
    tpot_s: float
    margin: float        # the relative error of the models behind it
    admissible: bool = True
    why: str = ""
    seat_tpot_s: float = 0.0  # the part of ``tpot_s`` a pushed request waits for its decode seat
    reserve_step_s: float = 0.0  # remote: the decode instance's step in flight its reservation waits for
    # remote: the mean TPOT predicted for the requests the prefill instance decodes (kept ones),
    # this prompt's chunks beside them; local and kept count their instance's decodes in ``tpot_s``.
    prefill_tpot_s: float = 0.0

    @property
    def worst_tpot_s(self) -> float:
        """The worst TPOT this placement predicts for anyone: the request's own, and that of
        the requests decoding where its prompt is computed and where it decodes."""
        return max(self.tpot_s, self.prefill_tpot_s)


@dataclass(frozen=True)
class Decision:
    """The chosen path (None: no instance has the pages; wait) and every prediction behind it."""

    chosen: Prediction | None
    predictions: tuple[Prediction, ...]

    @property
    def path(self) -> str | None:
        return None if self.chosen is None else self.chosen.path


def predict(prompt_len: int, prefills: list[InstanceView], decodes: list[InstanceView],
            cached: Mapping[str, int] | None = None, spare: Collection[str] | None = None) -> list[Prediction]:
    """Every candidate: remote via the fastest prefill instance to each decode instance, local on
    each decode instance, kept on each prefill instance (page fit not yet judged). ``cached``:
    instance name -> the prompt's tokens believed in its prefix cache (`cached_tokens`): an
    instance computes only what follows them (the rest still attended to). ``spare``: the
    prefill instances whose decodes the prompt's chunks would not stall past their TPOT slack
    (`decide`; None: all): where the fastest is not one of them, remote also via the fastest that is."""
    out = []
    hit = cached_tokens(prompt_len, cached)
    # A prompt computed on an instance first needs one of its seats (`InstanceView.seat_wait_s`).
    seat_of = {v.name: v.seat_wait_s() for v in prefills + decodes}
    # ... and waits for the decodes' steps ahead of it there (`InstanceView.prompt_wait_s`), as a
    # local prompt on D does (below): a prefill instance that keeps requests decodes them too.
    # Without it the kept and remote TTFTs were half the time measured since the decision, the
    # local one's right (simulated two H100s, decode-heavy 26 req/s, `balanced`: kept 14.9 vs 27.1
    # ms p50, local 23.2 vs 23.0; served: kept 20.8 vs 41.4; benchmarks/records/headline-h100x2-2026-11-27i/).
    start_of = {p.name: max(p.prompt_wait_s(), seat_of[p.name]) for p in prefills}

    def first_token_s(p: InstanceView) -> float:
        return start_of[p.name] + p.prefill_s(prompt_len, hit(p))

    best_p = min(prefills, key=first_token_s, default=None)
    vias = [best_p] if best_p is not None else []
    if best_p is not None and spare is not None and best_p.name not in spare:
        # The fastest prefill instance would break its kept requests' TPOT: also push through
        # the fastest one that spares its own (`decide` judges both).
        spared = [p for p in prefills if p.name in spare]
        if spared:
            vias.append(min(spared, key=first_token_s))
    # Through each: its queue's seconds and then this prompt's own, the same for every D; the
    # requests P keeps decode beside this prompt's chunks, as D's do beside a local one's: what the
    # push costs them counts where nothing is admissible (`decide`'s violation).
    through = [(p, start_of[p.name], p.prefill_s(0), p.prefill_s(prompt_len, hit(p)),
                _running_tpot(p, prompt_len, hit(p))) for p in vias]
    for d in decodes:
        out.extend(_remote(d, *via, seat_of[d.name], prompt_len) for via in through)
        # D's running decodes hold the step in flight (and, launched ahead, the next): a local
        # prompt's first chunk starts after them (`prompt_wait_s`); a remote one's reservation,
        # which D answers between steps (unless it overlaps them), after the step in flight.
        out.append(Prediction("local", d.name, d.name, max(d.prompt_wait_s(), seat_of[d.name])
                              + d.prefill_s(prompt_len, hit(d)) + d.relay_s, _local_tpot(d, prompt_len, hit(d)),
                              d.model.error))
    for p in prefills:
        # Kept: a local prompt on P (computed beside P's queue and the requests it keeps, then
        # decoded between the chunks P goes on computing), judged by the local rule: its stalls
        # spread over the tokens they delay, P's recent stalls stretching its gaps (`StallMeter`).
        # The one-step rule it had (every gap as long as a step with a chunk) kept the prefill
        # GPU out of decoding, where colocated uses both (two H100s, chat: 1-5 of 420 kept).
        out.append(Prediction("kept", p.name, p.name, start_of[p.name] + p.prefill_s(prompt_len, hit(p)) + p.relay_s,
                              _local_tpot(p, prompt_len, hit(p)), p.model.error))
    return out


def _remote(d: InstanceView, p: InstanceView, start_s: float, queue_s: float, done_s: float, p_running_s: float,
            seat_s: float, prompt_len: int) -> Prediction:
    """The remote candidate of a prompt of ``prompt_len`` through prefill instance ``p`` to decode
    instance ``d`` (`predict`): ``p`` can start the prompt ``start_s`` from now (its step in
    flight, its seat), computes its queue in ``queue_s`` and the prompt by ``done_s``, its kept
    requests' TPOT beside it ``p_running_s``; a seat on ``d`` is ``seat_s`` away; its TPOT
    decoding there from its first token on (`_pushed_tpot`)."""
    # A pushed request waits for D's seat after its first token: a gap in its TPOT.
    seat_tpot = seat_s / max(d.output_tokens - 1.0, 1.0) if seat_s and d.output_tokens else 0.0
    # Every path's first token then travels to the router (``relay_s``); a remote one's
    # prompt also waits for D's answer, which the router times (`reserve_wait_s`): without
    # these, two H200s (decode-heavy, 27 req/s) predicted remote TTFTs 2.05x short, 27.8
    # against 57.8 ms p50 (reservation 12.7, relay 6.7), and took remote where no path
    # held the 57-ms target (benchmarks/records/headline-h200x2-2026-11-28c/).
    # P goes on computing its queue meanwhile: the answer delays the prompt only where
    # it comes after P would have reached it. The prompt reaches P with the answer (the
    # router hands it over then), so past it the prompt still waits for P's step in
    # flight: without that wait remote TTFTs were 1.8-2.4x their predictions, kept ones
    # 1.3x (two H200s, decode-heavy 27-28 req/s: 57 against 30-32 ms p50;
    # benchmarks/records/headline-h200x2-2026-11-28f/).
    start = max(d.reserve_wait_s() + p.prompt_wait_s(), start_s + queue_s)
    ttft = start + done_s - queue_s + p.relay_s
    return Prediction("remote", p.name, d.name, ttft, _pushed_tpot(d, prompt_len, ttft) + seat_tpot,
                      max(p.model.error, d.model.error), seat_tpot_s=seat_tpot, reserve_step_s=d.reserve_step_s(),
                      prefill_tpot_s=p_running_s)


def cached_tokens(prompt_len: int, cached: Mapping[str, int] | None) -> Callable[[InstanceView], int]:
    """Per instance view, the tokens of a ``prompt_len`` prompt its prefix cache is believed to
    hold (``cached``: name -> tokens; the router's `PrefixAffinity` credit), at most all but the
    last (an engine computes a prompt's last token whatever it holds). Priced whole, a prompt of
    the shared-prefix workload (88% of its tokens cached) cost ~8x what its instance computes
    (simulated on two H200s, goodput unchanged either way: benchmarks/records/headline-h200x2-2026-11-28g/)."""
    if not cached:
        return lambda view: 0
    return lambda view: max(0, min(cached.get(view.name, 0), prompt_len - 1))


def _pushed_tpot(d: InstanceView, prompt_len: int, arrive_s: float = 0.0) -> float:
    """The TPOT predicted on decode instance ``d`` for a prompt of ``prompt_len`` pushed there,
    its first token ``arrive_s`` from now: the worse of its own (it decodes beside what is left
    then of D's queued prompt chunks: `InstanceView.queue_left`) and D's running decodes' (beside
    all of them, and one more sequence). Where the tokens they have to go are known
    (``output_tokens``, `InstanceView.running_horizon`), a TPOT is the mean over them
    (`InstanceView.mean_tpot_s`); else one step's: a decode step with a chunk in it. Priced
    beside D's whole queue, a push behind a local 29k-token prompt on the one decode instance of
    a simulated 8-GPU long-prompt fleet (7P1D-adaptive) was predicted a 34-39 ms TPOT, though D
    had computed most of it by the push's first token: the pushes went kept instead."""
    queued, queued_pairs = d.queued_prompt_tokens, d.queued_prompt_pairs
    step_d = d.decode_step_s(1, prompt_len, queued)
    own_h, running_h = d.output_tokens, d.running_horizon
    if own_h:
        left, left_pairs = d.queue_left(arrive_s)
        own = d.mean_tpot_s(own_h, left, left_pairs, 1, prompt_len)
    else:
        own = step_d
    if running_h:
        running = d.mean_tpot_s(running_h, queued, queued_pairs, 1, prompt_len)
    else:
        running = step_d if d.num_decoding and not own_h else 0.0
    return max(own, running)


def _local_tpot(d: InstanceView, prompt_len: int, cached: int = 0) -> float:
    """The TPOT predicted on instance ``d`` for a prompt of ``prompt_len`` computed there (local,
    or kept on a prefill instance) past its ``cached`` tokens: the worse of its own (once its
    prompt and the queue ahead of it are computed it decodes without chunks) and that of the
    requests decoding there, which its chunks slow (`_running_tpot`)."""
    own = (d.decode_gap_s(d.num_decoding + 1, d.context_tokens + prompt_len) if d.output_tokens
           else d.decode_step_s(1, prompt_len, d.queued_prompt_tokens))
    return max(own, _running_tpot(d, prompt_len, cached))


def _running_tpot(v: InstanceView, prompt_len: int, cached: int = 0) -> float:
    """The TPOT predicted for the requests decoding on ``v`` (and the prompts queued there,
    which decode while this one's chunks run) when a prompt of ``prompt_len`` tokens, ``cached``
    of them found in its cache, is computed on ``v`` beside them: their mean over
    `InstanceView.running_horizon` where known, else one step with the chunks in it; 0 when
    nothing decodes there."""
    queued, queued_pairs = v.queued_prompt_tokens, v.queued_prompt_pairs
    new, pairs = prompt_len - cached, prompt_pairs(cached, prompt_len - cached)
    if v.running_horizon:
        running = v.mean_tpot_s(v.running_horizon, queued + new, queued_pairs + pairs)
    else:
        running = v.decode_step_s(0, 0, queued + new) if v.num_decoding else 0.0
    if queued and v.output_tokens:  # the prompts queued ahead decode while this one's chunks run
        ahead = v.mean_tpot_s(HORIZON_SHARE * v.output_tokens, new, pairs, 1, queued)
        running = max(running, ahead)
    return running


def decide(prompt_len: int, prefills: list[InstanceView], decodes: list[InstanceView],
           targets: Targets = Targets(), cached: Mapping[str, int] | None = None) -> Decision:
    """Choose a path for a prompt of ``prompt_len`` tokens (module docstring): with a TTFT
    target an admissible remote path, else the lowest predicted TTFT among the admissible ones.

    Args:
        prompt_len: the prompt's tokens (>= 1).
        prefills, decodes: the live instances of each role.
        targets: the SLOs; without a TPOT target the bound is `TPOT_SLACK` x the remote step.
        cached: instance name -> the prompt's tokens believed cached there (`predict`).

    Returns:
        The `Decision`; ``chosen`` is None when no instance has the pages for it.
    """
    views = {v.name: v for v in prefills + decodes}
    judged = []
    hit = cached_tokens(prompt_len, cached)
    # A prompt's chunks stall the requests decoding where it is computed: D's (and the pushes on
    # their way there) for a local prompt, P's kept ones for a remote or kept prompt. A path that
    # breaks one's TPOT slack is refused while another is admissible; pushes go through a prefill
    # instance that spares its kept requests where the fastest would not (`predict`).
    stalls = {v.name: _stall_past_slack(replace(v, push_rate=0.0) if v.push_rate else v, prompt_len,
                                        targets.tpot_s, hit(v))
              for v in prefills + decodes if targets.tpot_s is not None}
    broken = {name: count for name, (count, _) in stalls.items()}  # name -> the requests it breaks
    spare = {p.name for p in prefills if not broken[p.name]} if stalls else None
    candidates = predict(prompt_len, prefills, decodes, cached, spare)
    remote_steps = [c.tpot_s for c in candidates if c.path == "remote" and _fits(c, views, prompt_len)]
    bound = targets.tpot_s
    if bound is None and remote_steps:
        bound = TPOT_SLACK * min(remote_steps)
    for cand in candidates:
        why = ""
        if not _fits(cand, views, prompt_len):
            why = f"{cand.decode} has {views[cand.decode].free_pages} free pages"
        elif targets.ttft_s is not None and cand.ttft_s > targets.ttft_s:
            why = f"TTFT {cand.ttft_s * 1e3:.1f} ms > target {targets.ttft_s * 1e3:.1f} ms"
        elif bound is not None and cand.tpot_s > bound and (targets.tpot_s is not None or cand.path != "remote"):
            why = f"TPOT {cand.tpot_s * 1e3:.2f} ms > bound {bound * 1e3:.2f} ms"
        elif broken.get(cand.prefill):
            why = stalls[cand.prefill][1]
        judged.append(cand if not why else replace(cand, admissible=False, why=why))
    for d in decodes if stalls else ():
        # The pushes decided to D while a local prompt stalls it arrive into that stall: they
        # count where no other decode instance can take a push now. Counted everywhere,
        # simulated 8 GPUs long-prompt 4P4D-adaptive lost what 6P2D gained (with other decode
        # instances the pushes go there; benchmarks/records/plan-h200-2026-11-29b/); counted
        # so, over three seeds 6P2D-adaptive 0.656 -> 0.750 req/s per GPU, 4P4D- 0.625 -> 0.656,
        # 7P1D- 0.781 -> 0.797, 1P7D- equal; chat, prefill-heavy and decode-heavy at 8 GPUs
        # hold the same rates (benchmarks/records/plan-h200-2026-11-29c/).
        if not d.push_rate or any(c.admissible and c.path == "remote" and c.decode != d.name for c in judged):
            continue
        stall = _stall_past_slack(d, prompt_len, targets.tpot_s, hit(d))
        if stall[0] > broken[d.name]:
            stalls[d.name], broken[d.name] = stall, stall[0]
            judged = [replace(c, admissible=False, why=stall[1]) if c.admissible and c.path == "local"
                      and c.decode == d.name else c for c in judged]
    ok = [c for c in judged if c.admissible]
    remote = [c for c in ok if c.path == "remote"]
    if remote and targets.ttft_s is not None and targets.prefer == "remote":
        # A TTFT under its target earns nothing: the split's own path while it holds the
        # targets; local and kept borrow the other phase's instance for the requests it cannot.
        # Wins where the decode side is the bottleneck, loses where the prefill side is
        # (simulated: 8 GPUs chat 5P3D 13.0 -> 14.5 req/s/GPU, 2 GPUs long-prompt strict 1.43x ->
        # 0.95x colocated; benchmarks/records/eightgpu-sim-2026-11-27/).
        return Decision(min(remote, key=lambda c: c.ttft_s), tuple(judged))
    if ok:
        best = min(c.ttft_s for c in ok)
        # Within its model's margin of the best; and whatever is faster than one that is (a path
        # predicted sooner and surer must not lose to a slower one for its wider margin).
        cutoff = max(c.ttft_s for c in ok if c.ttft_s <= best * (1.0 + c.margin))
        near = [c for c in ok if c.ttft_s <= cutoff]
        path = min(near, key=lambda c: (PREFERENCE.index(c.path), c.ttft_s)).path
        # The fastest of that path, even one whose own (smaller) margin left it out of `near`: an
        # uncertain instance's prediction must not win over a surer, faster one of the same path.
        chosen = min((c for c in ok if c.path == path), key=lambda c: c.ttft_s)
        if targets.prefer == "balanced":
            chosen = _decode_on_prefill(prompt_len, chosen, ok, views, targets) or chosen
        return Decision(chosen, tuple(judged))
    fitting = [c for c in judged if _fits(c, views, prompt_len)]
    if not fitting:
        return Decision(None, tuple(judged))
    # Overloaded: a decode instance whose own decodes already miss the TPOT bound (its remote
    # candidate does) has no spare compute for a prompt; a local one there would only slow every
    # decode on it further, however close its own prediction.
    saturated = {c.decode for c in judged if c.path == "remote" and bound is not None and c.tpot_s > bound}
    # (its running decodes' slack only: pushes on their way, or expected, are not yet decoding there)
    saturated |= {name for name, count in broken.items()
                  if count and (not (views[name].incoming or views[name].push_rate)
                                or _stall_past_slack(replace(views[name], incoming=0, push_rate=0.0), prompt_len,
                                                     targets.tpot_s, hit(views[name]))[0])}
    # Nor is a prompt pushed or kept through a prefill instance whose kept requests its chunks
    # would stall past their slack, while another path spares them: the suspected cause (no trace
    # yet) of two H200s' collapse one rate past the knee at f47ab54, the remote prompts rising as
    # attainment fell (decode-heavy 7 -> 147, 98.5% -> 62.7% from 27 to 28 req/s, colocated 93.4%;
    # chat 2x at 30 req/s 64.2% against 89.5%; benchmarks/records/headline-h200x2-2026-11-28e/).
    spare = [c for c in fitting if not (c.path == "local" and c.decode in saturated)
             and not (c.path != "local" and broken.get(c.prefill))] or fitting
    if targets.overload == "no_push":
        # Past the knee a push is work no other path does (the pushing step, the reservation's
        # round trip) and its TTFT was predicted short the most: two H200s, decode-heavy at 28
        # req/s, 85 of the 123 decisions of the last 5 s found nothing admissible and pushed, at
        # 1.7x their predicted TTFT, while colocated, pushing nothing, held 99.6%
        # (benchmarks/records/headline-h200x2-2026-11-28g/).
        spare = [c for c in spare if c.path != "remote"] or spare
    # The smallest violation, each request its chunks stall past its slack where it is computed
    # (on their way there included) counting as one whole miss more. By violation alone, simulated
    # 8 GPUs long-prompt (7P1D-adaptive) put a 31k-token prompt local on the one decode instance,
    # its own TTFT in time, while seven pushes were on their way there: every one of them missed
    # its TPOT. By misses alone (its own, then those it causes), a prompt went where everything
    # already missed (1P7D-adaptive: a 29k-token prompt local at a predicted 4.9 s TTFT).
    def cost(c: Prediction) -> float:
        return _violation(c, targets, bound) + broken.get(c.prefill, 0)

    return Decision(min(spare, key=cost), tuple(judged))


def _decode_on_prefill(prompt_len: int, chosen: Prediction, ok: list[Prediction], views: dict[str, InstanceView],
                       targets: Targets) -> Prediction | None:
    """The admissible kept candidate that ``chosen`` (the fastest path, decoding on a decode
    instance: remote or local) should give way to under `router.adaptive_prefer: balanced`, or
    None. With a TPOT target, when the decode instance's predicted TPOT is past `KEEP_SHARE` of
    it, a prefill instance's is lower, and the TTFT target (if any) has room for one of that
    prefill instance's decode steps ahead of a prompt: its decodes delay every prompt after them,
    so a strict TTFT keeps it a pure prefill instance (simulated, decode-heavy at 25 ms: without
    this, 100% -> 75% attainment at 8 req/s). Near-ties otherwise go by `PREFERENCE`, which put
    every decode on the decode instance while the prefill instance idled (two H100s, chat,
    2026-11-27: kept admissible in 371 of 430 decisions, its TPOT predicted 8.3 ms against the
    decode instance's 17.9, chosen in none; prefill instance 32% busy).

    A local path gives way as a remote one does: kept need not tie it for TTFT (a TTFT under its
    target earns nothing; the room above is what counts). Two H200s, decode-heavy 26 req/s, when
    only a remote/kept tie could give way: the first 5 s put 130 of 145 prompts local on D (its
    TTFT predicted 16-28 ms, kept's 30-40 while P's model still held the prior), P decoded
    nothing, and from 13 s no path held the TPOT target: 41% attainment against colocated's 99%
    (benchmarks/records/headline-h200x2-2026-11-28/)."""
    if targets.tpot_s is None or chosen.path == "kept":
        return None
    decode_side = chosen.tpot_s - chosen.seat_tpot_s  # D's decode speed, not its seat wait
    kept = [c for c in ok if c.path == "kept"]
    if not kept or decode_side <= KEEP_SHARE * targets.tpot_s:
        return None
    best = min(kept, key=lambda c: c.tpot_s)
    if best.tpot_s >= decode_side:
        return None
    if targets.ttft_s is None:
        return best
    room = KEEP_SHARE * targets.ttft_s
    if decode_side * (1.0 + chosen.margin) > targets.tpot_s:
        # Within its model's error of the TPOT target the decode instance's requests may miss
        # it; one kept here will not, and the TTFT target itself bounds the prompts its steps
        # delay. Two H100s' profile, decode-heavy 256 seats at 26 req/s, 80 : 14.9 ms: every
        # miss was a pushed request's TPOT (44 of 273, predicted 14.6 ms p50), kept refused for
        # want of TTFT room (34 + 9 > 40 ms); keeping them: 94.1-95.4% -> 98.8-100% attainment
        # (colocated 96.8-97.8%), the same seeds (benchmarks/records/headline-h100x2-2026-11-27i/).
        room = targets.ttft_s
    step = views[best.prefill].decode_step_s(1, prompt_len)
    return best if best.ttft_s + step <= room else None


def _stall_past_slack(d: InstanceView, prompt_len: int, bound_s: float, cached: int = 0) -> tuple[float, str]:
    """How many of the requests decoding on ``d`` (and on their way there) a prompt of
    ``prompt_len`` computed on ``d`` (``cached`` of its tokens found in its cache) takes past
    their TPOT (its chunks' stall, beyond the prompts queued there, exceeds their
    `InstanceView.tpot_slacks_s`), and why; (0, "") for none. With pushes decided to ``d`` at
    ``push_rate`` per second, those expected to arrive while more of the stall than their slack is
    ahead of them count too (``push_rate`` x (stall - slack), each a request of ``output_tokens``
    not yet started): a long local prompt on the one decode instance of a 7P1D fleet takes every
    push decided while it runs out of the pushes' reach (they go kept)."""
    slacks = d.tpot_slacks_s(bound_s)
    expected_slack = None
    if d.push_rate and d.output_tokens and d.output_tokens > 1:
        n = d.output_tokens
        expected_slack = bound_s * (n - 1) - n * d.decode_gap_s(d.num_decoding, d.context_tokens)
    if not slacks and expected_slack is None:
        return 0, ""
    queued, pairs = d.queued_prompt_tokens, d.queued_prompt_pairs
    stall = (d.stall_s(queued + prompt_len - cached, pairs + prompt_pairs(cached, prompt_len - cached))
             - d.stall_s(queued, pairs))
    broken = sum(1 for slack in slacks if slack < stall)
    expected = d.push_rate * max(stall - max(expected_slack, 0.0), 0.0) if expected_slack is not None else 0.0
    if not broken and expected < 0.5:
        return 0, ""
    known = (f"their TPOT slack {min(slacks) * 1e3:.1f} ms ({broken} of {len(slacks)})" if broken
             else f"the slack of the pushes decided meanwhile, {max(expected_slack, 0.0) * 1e3:.1f} ms")
    more = f", {expected:.1f} pushes expected meanwhile" if expected >= 0.05 else ""
    return broken + expected, f"its chunks stall {d.name}'s decodes {stall * 1e3:.1f} ms > {known}{more}"


def _fits(cand: Prediction, views: dict[str, InstanceView], prompt_len: int) -> bool:
    """Whether ``cand``'s decode instance has the pages: for its prompt, and for a pushed one
    its whole answer too (the decode instance reserves that before the push; ``output_tokens``,
    when known, stands for the answer's length)."""
    d = views[cand.decode]
    answer = int(d.output_tokens or 0) if cand.path == "remote" else 0
    return d.fits(prompt_len + answer)


def _violation(cand: Prediction, targets: Targets, bound: float | None) -> float:
    """How far ``cand`` misses its targets, as the worst ratio of predicted over target."""
    ratios = [cand.worst_tpot_s / bound if bound else 0.0]
    if targets.ttft_s is not None:
        ratios.append(cand.ttft_s / targets.ttft_s)
    return max(ratios) + 1e-9 * cand.ttft_s


class StallMeter:
    """How much longer an instance's recent steps with decodes ran than pure decode steps of the
    same decodes would have (`InstanceView.stall_factor`): exponentially weighted sums of each
    step's measured and pure-decode seconds over about `STALL_WINDOW_STEPS` steps. The ratio (>=
    1) is what the decodes' token gaps have been stretched by the prompt chunks beside them (and
    what the model underrates pure decode steps by)."""

    def __init__(self, window_steps: int = STALL_WINDOW_STEPS) -> None:
        self.keep = 1.0 - 1.0 / window_steps
        self.actual_s = self.pure_s = 0.0

    def note(self, actual_s: float, pure_s: float, count: int = 1) -> None:
        """Record ``count`` steps of ``actual_s`` seconds each, whose decodes alone take ``pure_s``."""
        decay = self.keep ** count
        weight = (1.0 - decay) / (1.0 - self.keep)  # the sum of keep**i for i < count
        self.actual_s = self.actual_s * decay + actual_s * weight
        self.pure_s = self.pure_s * decay + pure_s * weight

    @property
    def factor(self) -> float:
        return max(1.0, self.actual_s / self.pure_s) if self.pure_s > 0 else 1.0


class RateMeter:
    """Events per second recently: an exponentially decaying count over about `PUSH_RATE_WINDOW_S`
    seconds (each event adds 1 / window, which decays by e every window), read at a time."""

    def __init__(self, window_s: float = PUSH_RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.level, self.at = 0.0, None

    def note(self, now: float) -> None:
        self.level = self.rate(now) + 1.0 / self.window_s
        self.at = now

    def rate(self, now: float | None) -> float:
        if self.at is None or now is None:
            return 0.0
        return self.level * math.exp(-max(now - self.at, 0.0) / self.window_s)


class HopMeter:
    """One kind of hop of one instance as measured (seconds): the median of the last
    `HOP_WINDOW` (0 before the first). A median, not a mean: one reservation that waited behind a
    long prompt chunk (54 ms p90 against 12.7 p50 on two H200s) must not price the next ones."""

    def __init__(self, window: int = HOP_WINDOW) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.median = 0.0

    def note(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.median = statistics.median(self.recent)


class InstanceWork:
    """One instance's share of the live requests, summed by `FleetModel.views`: the fields of
    its `InstanceView` that the requests give."""

    __slots__ = ("queued", "pairs", "decoding", "context", "remaining", "progress", "seated", "incoming")

    def __init__(self) -> None:
        self.queued = self.pairs = self.decoding = self.context = self.remaining = self.seated = self.incoming = 0
        self.progress: list[tuple[float, int, int]] = []

    def add(self, req, computing: bool, max_tokens: int, now: float | None) -> None:
        """``req`` (of ``max_tokens``) placed here: its prompt queued (``computing``: not yet
        computed), else decoding here, with its progress where ``now`` and its first token are
        known (`InstanceView.decode_progress`)."""
        prompt_len = len(req.prompt_token_ids)
        if computing:  # what follows its prefix believed cached there (`Request.cached_tokens`)
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
          planned: Mapping[str, str] | None = None) -> tuple[dict[int, InstanceWork], float | None]:
    """The work of ``requests`` on each of ``instances`` (`FleetModel.views`): id(instance) ->
    its `InstanceWork`, and the mean max_tokens of the requests (None: none)."""
    planned = planned or {}
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
            for key in by_name.get(planned.get(req.request_id), ()):
                if unique[key] is not colocated:
                    work[key].add(req, True, max_tokens, now)
        elif stage == "decoding" and decode is not None and decode is not colocated:
            w = of(id(decode))
            if w is not None:
                w.add(req, False, max_tokens, now)
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
        ledger: the `disagg.cluster.ledger.Ledger` of a tracked `Placer` (the router's, the
            simulator's), which keeps the same sums up to date as the requests move
            (``ledger.tally(instances, now)``, `tally`'s answer): a decision costs O(instances +
            decodes) instead of O(live requests); None: `views` sums the live requests' work
            (`tally`) at every decision.
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
        into the predictions: a constant correction of a load-dependent miss made them worse in
        simulation (two GPUs, chat at 28 req/s: 2x-SLO attainment 85% -> 63%), and it only
        learns on the paths still taken (benchmarks/records/headline-h100x2-2026-11-27/)."""
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
        (`StepSample.gap_s`): a token's gap is the step and that. Timed by their GPU spans alone,
        the decodes' gaps were predicted short by the host's part (simulated two H200s,
        decode-heavy 28 req/s with the 1.2-ms host gap measured there: remote TPOT 9.3 predicted
        against 10.7 had, 44 of 185 remote requests past the 11.2-ms target; with the gap, over
        three seeds, attainment 96.6 / 91.9% -> 100 / 94.5% at 27 / 28 req/s, colocated 99.9 /
        96.1%; benchmarks/records/headline-h200x2-2026-11-28d/)."""
        if num_decode_seqs and seconds > 0:
            pure = self.model_of(name).step_s(0, num_decode_seqs, num_context_tokens, 0)
            self.stalls[name].note(seconds + gap_s, pure, count)

    def view(self, inst, requests: Collection, now: float | None = None, planned: Mapping[str, str] | None = None
             ) -> InstanceView:
        """``inst`` (an `Instance`) with the work of the router's live ``requests`` on it: `views`
        of it alone."""
        return self.views([inst], requests, now, planned)[0]

    def views(self, instances: list, requests: Collection, now: float | None = None,
              planned: Mapping[str, str] | None = None) -> list[InstanceView]:
        """Each of ``instances`` (`Instance`s) with the work of the router's live ``requests`` on
        it, in their order; ``now`` (the clock of their ``first_token_at``) also gives its
        decodes' progress. ``planned``: request id -> the prefill instance a remote decision named
        for a request whose reservation is still on its way (no ``prefill`` yet: `Placer.hand`
        names it when the decode instance answers): its prompt is queued there already, as
        `Placer.plan`'s prefill-queue bound counts it. Without it, a prompt decided in the same
        instant (requests released together after a wait) was priced in front of it.

        One pass over the requests for every instance: a decision views the whole fleet, and a
        pass per instance made it O(instances x live requests); a 64-instance adaptive fleet at
        ~1,500 req/s simulated no candidate in 30 minutes (benchmarks/records/plan-h200-2026-11-28/).
        A request counts on the instance each of its fields names, never twice on one: its
        ``colocated`` one; its prefill instance (or the planned one) while its prompt is computed
        there; its decode instance while it decodes (`tally`). With a ``ledger`` the same sums
        come from it instead (``requests`` and ``planned`` unread)."""
        if self.ledger is not None:
            work, output_tokens = self.ledger.tally(instances, now)
        else:
            work, output_tokens = tally(instances, requests, now, planned)
        return [self._view(inst, work[id(inst)], output_tokens, now) for inst in instances]

    def _view(self, inst, work: InstanceWork, output_tokens: float | None, now: float | None = None) -> InstanceView:
        """``inst``'s `InstanceView` of its ``work`` and this model's picture of it."""
        name = inst.name
        load = self.loads.get(name)
        hops = (self.reserve_extra[name].median, self.relay[name].median) if self.measured_hops else (0.0, 0.0)
        return InstanceView(name, self.model_of(name), self.chunk_tokens, work.queued, work.decoding, work.context,
                            None if load is None else load.free_pages, self.page_size, work.pairs, work.remaining,
                            output_tokens, self.stalls[name].factor, self.reserve_waits, tuple(work.progress),
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
