"""Where a prompt goes when no path is admissible: the fallbacks of `router.adaptive_overload`.

`FALLBACKS` maps each `router.adaptive_overload` value to a function of the candidates that
fit (the pages are there), every candidate judged, and the decision's `Judging`:
`least_violation` takes the smallest violation (`violation_cost`) among the paths that spare
saturated decode instances and prefill instances' kept requests (`avoid_breaking`); `no_push`
the same among the paths that push nothing, where one fits (`without_pushes`). Pure functions,
no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from disagg.cluster.routing.placement.admission import Judging, stalls_past_slack
from disagg.cluster.routing.placement.prediction import Prediction, Targets


def violation(cand: Prediction, targets: Targets, bound: float | None) -> float:
    """How far ``cand`` misses its targets, as the worst ratio of predicted over target: its TPOT
    counts the requests decoding where its prompt is computed (`Prediction.worst_tpot_s`)."""
    ratios = [cand.worst_tpot_s / bound if bound else 0.0]
    if targets.ttft_s is not None:
        ratios.append(cand.ttft_s / targets.ttft_s)
    return max(ratios) + 1e-9 * cand.ttft_s


def violation_cost(cand: Prediction, judging: Judging) -> float:
    """`violation`, plus one whole miss per request the prompt's chunks take past its slack where
    it is computed (on its way there included). By violation alone, a prompt in time itself may
    break every push on its way to its instance; by misses alone (its own, then those it
    causes), it would go where everything already misses."""
    return violation(cand, judging.targets, judging.bound) + judging.broken.get(cand.prefill, 0)


def saturated_decodes(judged: list[Prediction], judging: Judging) -> set[str]:
    """The decode instances with no spare compute for a prompt: whose own decodes already miss
    the TPOT bound (its remote candidate does), or whose running decodes' slack a prompt there
    breaks (pushes on their way, or expected, are not yet decoding there)."""
    bound, views = judging.bound, judging.views
    saturated = {c.decode for c in judged if c.path == "remote" and bound is not None and c.tpot_s > bound}
    broken = [views[name] for name, count in judging.broken.items() if count]
    saturated |= {v.name for v in broken if not (v.incoming or v.push_rate)}
    awaited = [v for v in broken if v.incoming or v.push_rate]  # would the running decodes alone break?
    running = stalls_past_slack(awaited, judging.prompt_len, judging.targets.tpot_s, [judging.hit(v) for v in awaited],
                                incoming=0, push_rate=0.0)
    saturated |= {v.name for v, (count, _) in zip(awaited, running) if count}
    return saturated


def avoid_breaking(fitting: list[Prediction], judged: list[Prediction], judging: Judging) -> list[Prediction]:
    """``fitting`` less a local prompt on a saturated decode instance (it would only slow every
    decode there further, however close its own prediction) and a prompt pushed or kept through
    a prefill instance whose kept requests it breaks (past the knee such pushes pile up and take
    the kept requests' TPOT with them); all of ``fitting`` where that leaves none."""
    saturated = saturated_decodes(judged, judging)
    return [c for c in fitting if not (c.path == "local" and c.decode in saturated)
            and not (c.path != "local" and judging.broken.get(c.prefill))] or fitting


def without_pushes(pool: list[Prediction]) -> list[Prediction]:
    """``pool`` less its remote paths, where another is left. Past the knee a push is work no
    other path does (the pushing step, the reservation's round trip), and its TTFT is the one
    predicted least well."""
    return [c for c in pool if c.path != "remote"] or pool


def least_violation(fitting: list[Prediction], judged: list[Prediction], judging: Judging) -> Prediction:
    """`router.adaptive_overload: least_violation` (the default): the least `violation_cost` of
    `avoid_breaking`'s paths."""
    return min(avoid_breaking(fitting, judged, judging), key=lambda c: violation_cost(c, judging))


def no_push(fitting: list[Prediction], judged: list[Prediction], judging: Judging) -> Prediction:
    """`router.adaptive_overload: no_push`: as `least_violation`, over the paths that push nothing
    where one is left (`without_pushes`), as a colocated fleet serves past its knee."""
    return min(without_pushes(avoid_breaking(fitting, judged, judging)), key=lambda c: violation_cost(c, judging))


FALLBACKS: dict[str, Callable[[list[Prediction], list[Prediction], Judging], Prediction]] = {
    "least_violation": least_violation, "no_push": no_push}
