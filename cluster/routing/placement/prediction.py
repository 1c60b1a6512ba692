"""What each path would cost a prompt: `predict`'s TTFT and TPOT per candidate path.

The candidates of one decision: remote through the fastest prefill instance (and, where that one
would break its kept requests, the fastest that spares them) to each decode instance, local on
each decode instance, kept on each prefill instance. Read from `InstanceView`s; `decide` judges
them. Pure functions, no I/O.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from disagg.cluster.routing.placement.view import HORIZON_SHARE, InstanceView
from disagg.config import RouterSection
from disagg.engine.steps import prompt_pairs

PATHS = ("remote", "local", "kept")
DEFAULT_PREFER = RouterSection.model_fields["adaptive_prefer"].default  # one default: the config's
DEFAULT_OVERLOAD = RouterSection.model_fields["adaptive_overload"].default
PREFERS = typing.get_args(RouterSection.model_fields["adaptive_prefer"].annotation)
OVERLOADS = typing.get_args(RouterSection.model_fields["adaptive_overload"].annotation)


@dataclass(frozen=True)
class Targets:
    """The SLOs the decision predicts against, seconds (None: none), what it prefers among the
    paths that hold them (``prefer``: `router.adaptive_prefer`, `choose.CHOOSERS`) and where it
    goes when none does (``overload``: `router.adaptive_overload`, `overload.FALLBACKS`).

    Raises:
        ValueError: ``prefer`` or ``overload`` is not one of the config's values.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    prefer: str = DEFAULT_PREFER
    overload: str = DEFAULT_OVERLOAD

    def __post_init__(self) -> None:
        for name, value, allowed in (("prefer", self.prefer, PREFERS), ("overload", self.overload, OVERLOADS)):
            if value not in allowed:
                raise ValueError(f"Targets.{name} (router.adaptive_{name}): expected one of {', '.join(allowed)}, "
                                 f"got {value!r}")

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

    def refused(self, why: str) -> Prediction:
        """This candidate marked inadmissible for ``why``: ``replace(self, admissible=False,
        why=why)``, without the frozen ``__init__`` (a decision refuses most of its candidates)."""
        new = object.__new__(Prediction)
        new.__dict__.update(self.__dict__, admissible=False, why=why)
        return new

    @property
    def worst_tpot_s(self) -> float:
        """The worst TPOT this placement predicts for anyone: the request's own, and that of
        the requests decoding where its prompt is computed and where it decodes."""
        return max(self.tpot_s, self.prefill_tpot_s)


def predict(prompt_len: int, prefills: list[InstanceView], decodes: list[InstanceView],
            cached: Mapping[str, int] | None = None, spare: Collection[str] | None = None) -> list[Prediction]:
    """Every candidate: remote via the fastest prefill instance to each decode instance, local on
    each decode instance, kept on each prefill instance (page fit not yet judged). ``cached``:
    instance name -> the prompt's tokens believed in its prefix cache (`cached_tokens`): an
    instance computes only what follows them (the rest still attended to). ``spare``: the
    prefill instances whose decodes the prompt's chunks would not stall past their TPOT slack
    (`admission.sparing_prefills`; None: all): where the fastest is not one of them, remote also via
    the fastest that is."""
    out = []
    hit = cached_tokens(prompt_len, cached)
    # A prompt computed on an instance first needs one of its seats (`InstanceView.seat_wait_s`).
    seat_of = {v.name: v.seat_wait_s() for v in prefills + decodes}
    # ... and waits for the decodes' steps ahead of it there (`InstanceView.prompt_wait_s`), as a
    # local prompt on D does (below): a prefill instance that keeps requests decodes them too.
    start_of = {p.name: max(p.prompt_wait_s(), seat_of[p.name]) for p in prefills}
    done_of = {p.name: p.prefill_s(prompt_len, hit(p)) for p in prefills}  # its queue and then the prompt

    def first_token_s(p: InstanceView) -> float:
        return start_of[p.name] + done_of[p.name]

    best_p = min(prefills, key=first_token_s, default=None)
    vias = [best_p] if best_p is not None else []
    if best_p is not None and spare is not None and best_p.name not in spare:
        # The fastest prefill instance would break its kept requests' TPOT: also push through
        # the fastest one that spares its own (`admission.spares_slack` judges both).
        spared = [p for p in prefills if p.name in spare]
        if spared:
            vias.append(min(spared, key=first_token_s))
    # Through each: its queue's seconds and then this prompt's own, the same for every D; the
    # requests P keeps decode beside this prompt's chunks, as D's do beside a local one's: what the
    # push costs them counts where nothing is admissible (`overload.violation`).
    through = [(p, start_of[p.name], p.prefill_s(0), done_of[p.name], running_tpot(p, prompt_len, hit(p)))
               for p in vias]
    for d in decodes:
        out.extend(remote_prediction(d, *via, seat_of[d.name], prompt_len) for via in through)
        # D's running decodes hold the step in flight (and, launched ahead, the next): a local
        # prompt's first chunk starts after them (`prompt_wait_s`); a remote one's reservation,
        # which D answers between steps (unless it overlaps them), after the step in flight.
        out.append(Prediction("local", d.name, d.name, max(d.prompt_wait_s(), seat_of[d.name])
                              + d.prefill_s(prompt_len, hit(d)) + d.relay_s, local_tpot(d, prompt_len, hit(d)),
                              d.model.error))
    for p in prefills:
        # Kept: a local prompt on P (computed beside P's queue and the requests it keeps, then
        # decoded between the chunks P goes on computing), judged by the local rule: its stalls
        # spread over the tokens they delay, P's recent stalls stretching its gaps (`StallMeter`);
        # priced as if every gap held a chunk, P would never decode, where colocated uses both GPUs.
        out.append(Prediction("kept", p.name, p.name, first_token_s(p) + p.relay_s,
                              local_tpot(p, prompt_len, hit(p)), p.model.error))
    return out


def remote_prediction(d: InstanceView, p: InstanceView, start_s: float, queue_s: float, done_s: float,
                      p_running_s: float, seat_s: float, prompt_len: int) -> Prediction:
    """The remote candidate of a prompt of ``prompt_len`` through prefill instance ``p`` to decode
    instance ``d`` (`predict`): ``p`` can start the prompt ``start_s`` from now (its step in
    flight, its seat), computes its queue in ``queue_s`` and the prompt by ``done_s``, its kept
    requests' TPOT beside it ``p_running_s``; a seat on ``d`` is ``seat_s`` away; its TPOT
    decoding there from its first token on (`pushed_tpot`)."""
    # A pushed request waits for D's seat after its first token: a gap in its TPOT.
    seat_tpot = seat_s / max(d.output_tokens - 1.0, 1.0) if seat_s and d.output_tokens else 0.0
    # Every path's first token then travels to the router (``relay_s``); a remote one's
    # prompt also waits for D's answer, which the router times (`reserve_wait_s`). P goes on
    # computing its queue meanwhile: the answer delays the prompt only where it comes after P
    # would have reached it. The prompt reaches P with the answer (the router hands it over
    # then), so past it the prompt still waits for P's step in flight.
    start = max(d.reserve_wait_s() + p.prompt_wait_s(), start_s + queue_s)
    ttft = start + done_s - queue_s + p.relay_s
    return Prediction("remote", p.name, d.name, ttft, pushed_tpot(d, prompt_len, ttft) + seat_tpot,
                      max(p.model.error, d.model.error), seat_tpot_s=seat_tpot, reserve_step_s=d.reserve_step_s(),
                      prefill_tpot_s=p_running_s)


def cached_tokens(prompt_len: int, cached: Mapping[str, int] | None) -> Callable[[InstanceView], int]:
    """Per instance view, the tokens of a ``prompt_len`` prompt its prefix cache is believed to
    hold (``cached``: name -> tokens; the router's `PrefixAffinity` credit), at most all but the
    last (an engine computes a prompt's last token whatever it holds)."""
    if not cached:
        return lambda view: 0
    return lambda view: max(0, min(cached.get(view.name, 0), prompt_len - 1))


def pushed_tpot(d: InstanceView, prompt_len: int, arrive_s: float = 0.0) -> float:
    """The TPOT predicted on decode instance ``d`` for a prompt of ``prompt_len`` pushed there,
    its first token ``arrive_s`` from now: the worse of its own (it decodes beside what is left
    then of D's queued prompt chunks: `InstanceView.queue_left`) and D's running decodes' (beside
    all of them, and one more sequence). Where the tokens they have to go are known
    (``output_tokens``, `InstanceView.running_horizon`), a TPOT is the mean over them
    (`InstanceView.mean_tpot_s`); else one step's: a decode step with a chunk in it."""
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


def local_tpot(d: InstanceView, prompt_len: int, cached: int = 0) -> float:
    """The TPOT predicted on instance ``d`` for a prompt of ``prompt_len`` computed there (local,
    or kept on a prefill instance) past its ``cached`` tokens: the worse of its own (once its
    prompt and the queue ahead of it are computed it decodes without chunks) and that of the
    requests decoding there, which its chunks slow (`running_tpot`)."""
    own = (d.decode_gap_s(d.num_decoding + 1, d.context_tokens + prompt_len) if d.output_tokens
           else d.decode_step_s(1, prompt_len, d.queued_prompt_tokens))
    return max(own, running_tpot(d, prompt_len, cached))


def running_tpot(v: InstanceView, prompt_len: int, cached: int = 0) -> float:
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


