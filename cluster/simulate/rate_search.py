"""The goodput search of `disagg plan`: the highest request rate whose SLO attainment holds the
target, as one generator (`rate_search`) that yields the rates to judge and is sent their
attainments, one at a time (`max_rate`) or in batches (the planner's worker processes), to the
same rate either way. Pure Python; `cluster/simulate/plan.py` calls it.
"""

from __future__ import annotations

import math
from typing import Callable, Generator

from disagg.cluster.bench.compare import TARGET_ATTAINMENT

MAX_DOUBLINGS = 12
BISECTIONS = 5
# A probed search (`rate_search`'s ``probe``) judges, right after its start, the midpoint its
# bisection would reach this many levels down where the knee is just past the start (held: the
# third of [start, 2 start], 1.125 start) or just below it (missed: the second of [start/2,
# start], 0.875 start).
PROBE_LEVELS = {True: 3, False: 2}
# A search whose start is at most this many doublings below its ceiling judges the ceiling's
# doubling first (`rate_search`): past the ceiling every run is one burst, its most expensive run.
CEILING_FIRST = 2


def rate_search(start: float, width: int = 1, target: float = TARGET_ATTAINMENT,
                max_doublings: int = MAX_DOUBLINGS, ceiling: float = math.inf, probe: bool = False
                ) -> Generator[list[float], list[float], float]:
    """The search for the highest rate whose attainment holds ``target`` (0.0 when even a rate
    2^-``max_doublings`` of ``start`` misses; the highest judged when every doubling held, up to
    2^``max_doublings`` of ``start`` or the first at or past ``ceiling``), ``width`` rates at a
    time: it yields the rates to judge next and is sent their attainments, in order; it returns
    the rate. Doubling (or halving) from ``start`` to a bracket, then `BISECTIONS` halvings of
    it. Wider batches judge the next rates of the doubling,
    and the next levels of the bisection (every midpoint it could visit, 2^d - 1 rates for d
    levels), ahead: the rates a one-at-a-time search visits are among them, and its verdicts
    decide the path, so the rate found is the one-at-a-time search's (`max_rate`) whatever the
    attainments; the extra rates are judged for nothing but time.

    Ceiling first: where the doubling would reach ``ceiling`` within `CEILING_FIRST` doublings of
    ``start``, the search judges that doubling alone first; if it holds, it is the rate (the
    doubling would have stopped there, the rates below it loading the fleet less); else its
    verdict is kept for when the doubling reaches it. A fleet whose knee is past the ceiling (the
    runs drain a burst within the TTFT SLO) is then judged in one run instead of three.

    Probed (``probe``: a start near the knee, such as a screened rate): right after the start,
    the search judges the rate its bisection reaches where the knee lies just past the start
    (`PROBE_LEVELS`: 1.125 x start when the start held) or just below it (0.875 x start when it
    missed), computed as the bisection computes it. Its verdict decides every rate the search
    would judge on its side, as an attainment that falls with the rate would: a miss there, every
    rate at or above it; a hold, every rate at or below it. With the knee within those rates of
    the start, the doublings (or the halving) and the bisection's first levels are not run: 4 or
    5 runs instead of 7; beyond them the probe is one run more. Where the attainment does fall
    with the rate, the rate found is the unprobed search's."""
    if width < 1:
        raise ValueError(f"rate_search: expected a width of at least 1, got {width}")
    known: dict[float, float] = {}
    top = next((start * 2 ** k for k in range(1, min(CEILING_FIRST, max_doublings) + 1)
                if start * 2 ** k >= ceiling > start), None)
    if top is not None:
        (at_top,) = yield [top]
        if at_top >= target:
            return top
        known[top] = at_top
    (first,) = yield [start]
    side: tuple[float, bool] | None = None  # the probe's rate and whether it held

    def implied(rate: float) -> float | None:
        """The attainment ``rate`` is taken to have without a run (the probe's side of it, or
        judged before); None: to be judged."""
        if side is not None and (rate >= side[0] if not side[1] else rate <= side[0]):
            return target if side[1] else -1.0
        return known.get(rate)

    def judge(rates: list[float]):
        """The attainments of ``rates``, those not `implied` judged (one batch)."""
        asked = [rate for rate in rates if implied(rate) is None]
        judged = iter((yield asked) if asked else [])
        return [a if (a := implied(rate)) is not None else next(judged) for rate in rates]

    if probe:
        at = _probe_rate(start, first >= target)
        if at < ceiling:
            (at_probe,) = yield [at]
            side = (at, at_probe >= target)
    low: float | None = None
    high: float | None = None
    if first >= target:
        low, done = start, 0
        while high is None and done < max_doublings and low < ceiling:
            batch = [low * 2 ** (i + 1) for i in range(min(width, max_doublings - done))]
            batch = batch[:next((i + 1 for i, rate in enumerate(batch) if rate >= ceiling), len(batch))]
            held = yield from judge(batch)
            done += len(batch)
            missed = next((i for i, a in enumerate(held) if a < target), None)
            if missed is None:
                low = batch[-1]
            else:
                high, low = batch[missed], batch[missed - 1] if missed else low
        if high is None:
            return low
    else:
        high, done = start, 0
        while low is None and done < max_doublings:
            batch = [high / 2 ** (i + 1) for i in range(min(width, max_doublings - done))]
            held = yield from judge(batch)
            done += len(batch)
            met = next((i for i, a in enumerate(held) if a >= target), None)
            if met is None:
                high = batch[-1]
            else:
                low, high = batch[met], batch[met - 1] if met else high
        if low is None:
            return 0.0
    levels = BISECTIONS
    while levels:
        mid = (low + high) / 2
        if (a := implied(mid)) is not None:  # a level the probe (or a verdict before) decides: no run
            low, high = (mid, high) if a >= target else (low, mid)
            levels -= 1
            continue
        depth = min(levels, max(1, (width + 1).bit_length() - 1))  # 2^depth - 1 <= width
        tree = _midpoints(low, high, depth)
        held = yield from judge([rate for rate, _ in tree])
        verdicts = {path: a >= target for (_, path), a in zip(tree, held)}
        path = ""
        for _ in range(depth):  # the one-at-a-time walk down the judged midpoints
            mid = (low + high) / 2
            if verdicts[path]:
                low, path = mid, path + "1"
            else:
                high, path = mid, path + "0"
        levels -= depth
    return low


def _probe_rate(start: float, held: bool) -> float:
    """The probe of a search from ``start`` (`PROBE_LEVELS`), as its bisection computes it: held,
    the midpoints of [start, 2 start] toward start; missed, those of [start / 2, start] toward
    start."""
    if held:
        low, high = start, start * 2
        for _ in range(PROBE_LEVELS[True]):
            high = (low + high) / 2
        return high
    low, high = start / 2, start
    for _ in range(PROBE_LEVELS[False]):
        low = (low + high) / 2
    return low


def _midpoints(low: float, high: float, depth: int) -> list[tuple[float, str]]:
    """Every midpoint a bisection of [low, high] can visit in ``depth`` levels, each with its path
    (its verdicts so far, "1" held), computed as the bisection computes them."""
    out: list[tuple[float, str]] = []
    level = [(low, high, "")]
    for _ in range(depth):
        nxt = []
        for lo, hi, path in level:
            mid = (lo + hi) / 2
            out.append((mid, path))
            nxt += [(lo, mid, path + "0"), (mid, hi, path + "1")]
        level = nxt
    return out


def max_rate(attainment: Callable[[float], float], start: float, target: float = TARGET_ATTAINMENT,
             max_doublings: int = MAX_DOUBLINGS, ceiling: float = math.inf, probe: bool = False) -> float:
    """`rate_search` one rate at a time: the highest rate whose ``attainment(rate)`` holds ``target``."""
    search = rate_search(start, 1, target, max_doublings, ceiling, probe)
    rates = next(search)
    while True:
        try:
            rates = search.send([attainment(rate) for rate in rates])
        except StopIteration as done:
            return done.value
