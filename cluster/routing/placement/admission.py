"""Which paths a prompt may take: the admission rules of `decide`.

Each rule looks at one candidate `Prediction` and the decision's `Judging` and answers why the
candidate is not admissible ("" when it admits it); `admit` applies `ADMISSION_RULES` in order
and the first refusal becomes the candidate's ``why``. `spares_expected_pushes` runs after them:
it reads which pushes the others admitted. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from disagg.cluster.routing.placement.prediction import Prediction, Targets, cached_tokens
from disagg.cluster.routing.placement.view import InstanceView, fleet_tpot_slacks_s
from disagg.engine.steps import prompt_pairs

TPOT_SLACK = 1.1  # without a TPOT target: a decode step may grow to 1.1 x the remote path's step


@dataclass(frozen=True)
class Judging:
    """What the rules of one decision read besides the candidate.

    Attributes:
        prompt_len: the prompt's tokens.
        views: instance name -> its `InstanceView` (prefill and decode instances).
        targets: the SLOs and preferences.
        hit: per view, the prompt's tokens believed in its prefix cache (`cached_tokens`).
        stalls: instance name -> (requests a prompt computed there takes past their TPOT slack,
            why) (`slack_breaks`); empty without a TPOT target.
        broken: instance name -> the first of its ``stalls``.
        bound: the TPOT bound the candidates are judged by (`tpot_bound`); None: none.
    """

    prompt_len: int
    views: Mapping[str, InstanceView]
    targets: Targets
    hit: Callable[[InstanceView], int]
    stalls: Mapping[str, tuple[float, str]]
    broken: Mapping[str, float]
    bound: float | None = None

    @classmethod
    def of(cls, prompt_len: int, prefills: list[InstanceView], decodes: list[InstanceView], targets: Targets,
           cached: Mapping[str, int] | None = None) -> Judging:
        """The judging of a prompt of ``prompt_len`` over these instances, before any candidate."""
        hit = cached_tokens(prompt_len, cached)
        stalls = slack_breaks(prefills + decodes, prompt_len, targets, hit)
        return cls(prompt_len, {v.name: v for v in prefills + decodes}, targets, hit, stalls,
                   {name: count for name, (count, _) in stalls.items()})


# ------------------------------------------------------------------ what the rules measure
def fits(cand: Prediction, views: Mapping[str, InstanceView], prompt_len: int) -> bool:
    """Whether ``cand``'s decode instance has the pages: for its prompt, and for a pushed one
    its whole answer too (the decode instance reserves that before the push; ``output_tokens``,
    when known, stands for the answer's length)."""
    d = views[cand.decode]
    answer = int(d.output_tokens or 0) if cand.path == "remote" else 0
    return d.fits(prompt_len + answer)


def stall_past_slack(d: InstanceView, prompt_len: int, bound_s: float, cached: int = 0, *,
                     incoming: int | None = None, push_rate: float | None = None) -> tuple[float, str]:
    """How many of the requests decoding on ``d`` (and on their way there) a prompt of
    ``prompt_len`` computed on ``d`` (``cached`` of its tokens found in its cache) takes past
    their TPOT (its chunks' stall, beyond the prompts queued there, exceeds their
    `InstanceView.tpot_slacks_s`), and why; (0, "") for none. With pushes decided to ``d`` at
    ``push_rate`` per second, those expected to arrive while more of the stall than their slack is
    ahead of them count too (``push_rate`` x (stall - slack), each a request of ``output_tokens``
    not yet started): else a long local prompt on a lone decode instance breaks every push
    decided while it runs. ``incoming``, ``push_rate``: those of ``d`` counted (None: its own; 0
    leaves them out). `stalls_past_slack` of ``d`` alone."""
    return stalls_past_slack([d], prompt_len, bound_s, [cached], incoming=incoming, push_rate=push_rate)[0]


def stalls_past_slack(views: Sequence[InstanceView], prompt_len: int, bound_s: float, cached: Sequence[int], *,
                      incoming: int | None = None, push_rate: float | None = None) -> list[tuple[float, str]]:
    """`stall_past_slack` of each of ``views`` (``cached``: the prompt's tokens in each one's
    cache), their decodes' slacks taken in one pass (`fleet_tpot_slacks_s`)."""
    slacks, owner = fleet_tpot_slacks_s(views, bound_s, incoming)
    num_slacks = np.bincount(owner, minlength=len(views)).tolist()
    rates = [d.push_rate if push_rate is None else push_rate for d in views]
    expected_slacks = [d.fresh_slack_s(bound_s) if rate else None for d, rate in zip(views, rates)]
    stalls = [0.0] * len(views)  # what the prompt's chunks stall each one's decodes, where anyone's slack is known
    for i, (d, hit) in enumerate(zip(views, cached)):
        if num_slacks[i] or expected_slacks[i] is not None:
            queued, pairs = d.queued_prompt_tokens, d.queued_prompt_pairs
            stalls[i] = (d.stall_s(queued + prompt_len - hit, pairs + prompt_pairs(hit, prompt_len - hit))
                         - d.stall_s(queued, pairs))
    num_broken = np.bincount(owner[slacks < np.array(stalls)[owner]], minlength=len(views)).tolist()
    out = []
    for i, (d, rate, expected_slack, stall, broken) in enumerate(zip(views, rates, expected_slacks, stalls,
                                                                    num_broken)):
        if not num_slacks[i] and expected_slack is None:
            out.append((0, ""))
            continue
        expected = rate * max(stall - max(expected_slack, 0.0), 0.0) if expected_slack is not None else 0.0
        if not broken and expected < 0.5:
            out.append((0, ""))
            continue
        known = (f"their TPOT slack {float(slacks[owner == i].min()) * 1e3:.1f} ms ({broken} of {num_slacks[i]})"
                 if broken else f"the slack of the pushes decided meanwhile, {max(expected_slack, 0.0) * 1e3:.1f} ms")
        more = f", {expected:.1f} pushes expected meanwhile" if expected >= 0.05 else ""
        out.append((broken + expected, f"its chunks stall {d.name}'s decodes {stall * 1e3:.1f} ms > {known}{more}"))
    return out


def slack_breaks(instances: list[InstanceView], prompt_len: int, targets: Targets,
                 hit: Callable[[InstanceView], int]) -> dict[str, tuple[float, str]]:
    """Per instance, the requests a prompt computed there takes past their TPOT slack
    (`stall_past_slack`), the pushes expected meanwhile left out (`spares_expected_pushes` counts
    them where they matter); empty without a TPOT target."""
    if targets.tpot_s is None:
        return {}
    stalls = stalls_past_slack(instances, prompt_len, targets.tpot_s, [hit(v) for v in instances], push_rate=0.0)
    return {v.name: stall for v, stall in zip(instances, stalls)}


def sparing_prefills(prefills: list[InstanceView], judging: Judging) -> set[str] | None:
    """The prefill instances whose kept requests the prompt's chunks leave within their slack
    (`predict`'s ``spare``: a push also goes through the fastest of them); None: no TPOT target."""
    return {p.name for p in prefills if not judging.broken[p.name]} if judging.stalls else None


def tpot_bound(candidates: Collection[Prediction], judging: Judging) -> float | None:
    """The TPOT bound the candidates are judged by: the target; without one, `TPOT_SLACK` x the
    least TPOT of a remote path that fits (None: no remote path fits)."""
    if judging.targets.tpot_s is not None:
        return judging.targets.tpot_s
    remote_steps = [c.tpot_s for c in candidates if c.path == "remote" and fits(c, judging.views, judging.prompt_len)]
    return TPOT_SLACK * min(remote_steps) if remote_steps else None


# ------------------------------------------------------------------ the admission rules
def pages_fit(cand: Prediction, judging: Judging) -> str:
    """The decode instance has the pages: the prompt's, and a push's expected answer (`fits`)."""
    if fits(cand, judging.views, judging.prompt_len):
        return ""
    return f"{cand.decode} has {judging.views[cand.decode].free_pages} free pages"


def ttft_within_target(cand: Prediction, judging: Judging) -> str:
    """The predicted TTFT holds the TTFT target (admitted without one)."""
    target = judging.targets.ttft_s
    if target is not None and cand.ttft_s > target:
        return f"TTFT {cand.ttft_s * 1e3:.1f} ms > target {target * 1e3:.1f} ms"
    return ""


def tpot_within_bound(cand: Prediction, judging: Judging) -> str:
    """The predicted TPOT holds the bound (`tpot_bound`). Without a TPOT target the bound is the
    remote paths' own step stretched by `TPOT_SLACK`: it limits what a local or kept prompt may
    slow the decodes beside it, and never refuses a push."""
    bound = judging.bound
    if bound is not None and cand.tpot_s > bound and (judging.targets.tpot_s is not None or cand.path != "remote"):
        return f"TPOT {cand.tpot_s * 1e3:.2f} ms > bound {bound * 1e3:.2f} ms"
    return ""


def spares_slack(cand: Prediction, judging: Judging) -> str:
    """The prompt's chunks leave every request decoding where it is computed (and on its way
    there) within its TPOT slack: D's for a local prompt, P's kept ones for a remote or kept one
    (`slack_breaks`; with a TPOT target only)."""
    return judging.stalls[cand.prefill][1] if judging.broken.get(cand.prefill) else ""


ADMISSION_RULES: tuple[Callable[[Prediction, Judging], str], ...] = (
    pages_fit, ttft_within_target, tpot_within_bound, spares_slack)


def admit(cand: Prediction, judging: Judging) -> Prediction:
    """``cand`` as judged by `ADMISSION_RULES`: unchanged if every rule admits it, else marked
    inadmissible with the first refusal as its ``why``."""
    for rule in ADMISSION_RULES:
        why = rule(cand, judging)
        if why:
            return cand.refused(why)
    return cand


def spares_expected_pushes(judged: list[Prediction], decodes: list[InstanceView],
                           judging: Judging) -> tuple[list[Prediction], Judging]:
    """The pushes decided to a decode instance while a local prompt stalls it arrive into that
    stall: where no other decode instance can take a push now (no admissible remote path decodes
    elsewhere), they count in the local prompt's breaks (`stall_past_slack` with the instance's
    ``push_rate``), and a local path they break is refused. Where one can, the pushes go there.

    Returns:
        The candidates so judged, and ``judging`` with those instances' ``stalls`` and ``broken``
        raised (the fallback counts them too).
    """
    if not judging.stalls:
        return judged, judging
    stalls, broken = dict(judging.stalls), dict(judging.broken)
    pushable = {c.decode for c in judged if c.admissible and c.path == "remote"}
    alone = [d for d in decodes if d.push_rate and not pushable - {d.name}]  # no push can go elsewhere
    with_pushes = stalls_past_slack(alone, judging.prompt_len, judging.targets.tpot_s, [judging.hit(d) for d in alone])
    for d, stall in zip(alone, with_pushes):
        if stall[0] > broken[d.name]:
            stalls[d.name], broken[d.name] = stall, stall[0]
            judged = [c.refused(stall[1]) if c.admissible and c.path == "local"
                      and c.decode == d.name else c for c in judged]
    return judged, replace(judging, stalls=stalls, broken=broken)
