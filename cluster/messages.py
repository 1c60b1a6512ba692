"""The messages between instance actors and the router, as named types in one place.

Engine -> router, once per `next_outputs` call (`InstanceActor.next_outputs`): an `OutputBatch` of
`OutputRow`s (one per token or ending), the engine's fatal error if it failed, the `StepSample`s
of the steps run since the last batch (the router's step-time model learns from them,
`disagg.cluster.routing.placement`) and the instance's `InstanceLoad` after its last step. Router ->
decode engine: `RecvDest` (where a prompt's KV goes) and `PushState` (a prefill abort's answer)
and `InstanceLoad` are the engine's own types, re-exported here. Rows and samples are tuples on the wire (they
pickle far smaller than objects); the names make them readable at both ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from disagg.engine.request import PushState, RecvDest
from disagg.engine.steps import InstanceLoad

__all__ = ["InstanceLoad", "OutputBatch", "OutputRow", "PushState", "RecvDest", "StepSample"]


class OutputRow(NamedTuple):
    """One token of a request (``token_id`` None: the engine ended it without one)."""

    request_id: Any
    token_id: int | None
    finished: bool
    finish_reason: str | None
    error: str | None
    emit_time: float  # wall clock (time.time()) when the step that made it returned


class StepSample(NamedTuple):
    """One engine step: what it computed (`disagg.engine.steps.StepShape`) and how long it took."""

    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    num_prompt_pairs: int
    seconds: float
    # the GPU's idle time just before it, where it ran decodes (they waited: host time between
    # forwards), at most its own seconds; 0 where unknown (not timed on a GPU)
    gap_s: float = 0.0


@dataclass
class OutputBatch:
    """What one `next_outputs` call returns."""

    outputs: list[OutputRow] = field(default_factory=list)
    fatal: str | None = None  # the engine's traceback once it failed (the instance is dead)
    steps: list[StepSample] = field(default_factory=list)
    load: InstanceLoad | None = None
