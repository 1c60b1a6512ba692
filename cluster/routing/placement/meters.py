"""The meters behind an instance's view: recent stall factor, event rate and hop medians.

`FleetModel` keeps one of each per instance and reads them into its `InstanceView`
(``stall_factor``, ``push_rate``, ``reserve_extra_s``, ``relay_s``). Pure, no I/O.
"""

from __future__ import annotations

import collections
import math
import statistics

STALL_WINDOW_STEPS = 128  # `StallMeter`'s memory: about a second of an 8B decode instance's steps
HOP_WINDOW = 32  # `HopMeter`: the recent hops whose median stands for the next one
PUSH_RATE_WINDOW_S = 2.0  # `RateMeter`: the seconds of recent pushes whose rate stands for the next ones


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
    long prompt chunk must not price the next ones."""

    def __init__(self, window: int = HOP_WINDOW) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.median = 0.0

    def note(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.median = statistics.median(self.recent)
