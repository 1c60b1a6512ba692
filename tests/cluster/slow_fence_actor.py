"""The actor of the early-release cluster tests: `hooked_actor.HookedInstanceActor`, except that
a prefill engine's pushes look in flight for ``FENCE_S`` seconds after an abort that finds some
pushed (what a GPU's transfer streams may do; on the CPU every push completes inline).

The engine is the production one (`disagg.cluster.launch.engines`); once it is built (and warmed up),
its fence is swapped for a timed one. Pickled by value, as `hooked_actor` is.
"""

from __future__ import annotations

import sys
import time

from hooked_actor import HookedInstanceActor
from ray import cloudpickle

__all__ = ["FENCE_S", "SlowFenceActor"]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FENCE_S = 1.5


class TimedFence:
    """A fence event that completes ``seconds`` after it was made."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.deadline


class SlowFenceActor(HookedInstanceActor):
    """A hooked actor whose prefill engine fences its pushes with a `TimedFence` of ``FENCE_S``."""

    async def build_engine(self, num_pages: int) -> dict:
        stats = await super().build_engine(num_pages)
        if self.role == "prefill":
            def slow_fence() -> None:
                self.loop.engine.sender.fence = lambda: TimedFence(FENCE_S)  # the KV connector's sender
            await self._run(slow_fence)
        return stats
