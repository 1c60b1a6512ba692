"""Engine module of the early-release cluster tests: `disagg.cluster.engines`, except that the
prefill engine's pushes look in flight for ``FENCE_S`` seconds after an abort that finds some
pushed (what a GPU's transfer streams may do; on the CPU every push completes inline).

The actors import it by name (`Cluster.launch(engine_module="slow_fence_engines")`, with this
folder on their PYTHONPATH).
"""

from __future__ import annotations

import time
from typing import Any

from disagg.cluster import engines as default_engines
from disagg.cluster.engines import describe, load, tokenizer_of

__all__ = ["FENCE_S", "describe", "load", "make_engine", "tokenizer_of"]

FENCE_S = 1.5


class TimedFence:
    """A fence event that completes ``seconds`` after it was made."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.deadline


def make_engine(role: str, model: Any, heap: Any, num_pages: int, config: Any) -> Any:
    engine = default_engines.make_engine(role, model, heap, num_pages, config)
    if role == "prefill":
        engine._fence_pushes = lambda: TimedFence(FENCE_S)
    return engine
