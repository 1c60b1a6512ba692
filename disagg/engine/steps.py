"""The records of one forward: its shape (what it computed) and the launched / reserved steps.

`EngineCore` (core.py) creates them on its step pipeline; `StepShape` also leaves the engine, as
the input of the router's step-time model (`disagg.cluster.placement`, docs/ARCHITECTURE.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg.engine.request import Request
from disagg.engine.runner import PendingTokens
from disagg.plan import ForwardPlan


def prompt_pairs(num_computed: int, num_tokens: int) -> int:
    """The (query, key) pairs of a prompt chunk's attention: ``num_tokens`` prompt tokens after
    ``num_computed`` already in the cache attend to those and, causally, to each other:
    ``num_tokens * num_computed + num_tokens * (num_tokens + 1) / 2``."""
    return num_tokens * num_computed + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """What one forward computed, the inputs of the router's step-time model (`disagg.cluster.
    placement`): prompt tokens, decoding sequences, the context those sequences attend to, and
    the prompt tokens' attention pairs (`prompt_pairs` summed over the forward's prompt chunks:
    a chunk's attention over its prefix and itself)."""

    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    num_prompt_pairs: int

    @classmethod
    def of(cls, reqs: list[Request], counts: list[int]) -> StepShape:
        """The shape of a forward over ``reqs`` computing ``counts`` tokens each, taken before
        their ``num_computed`` advance."""
        chunks = [(r.num_computed, n) for r, n in zip(reqs, counts) if not r.decoding]
        decodes = [r for r in reqs if r.decoding]
        return cls(sum(n for _, n in chunks), len(decodes), sum(r.num_computed for r in decodes),
                   sum(prompt_pairs(done, n) for done, n in chunks))


@dataclass(frozen=True)
class InstanceLoad:
    """An engine's pages and batch after its last step (`EngineCore.load`; the router reads it)."""

    free_pages: int  # free and not promised to a reservation
    total_pages: int
    running: int
    waiting: int


@dataclass
class NextStep:
    """A pure-decode step reserved while the GPU ran the one before it (core.py's module docstring)."""

    requests: list[Request]
    plan: ForwardPlan
    device_ids: torch.Tensor | None = None


@dataclass
class Launched:
    """A launched forward whose sampled ids have not been read."""

    requests: list[Request]  # every row of the forward
    sampled: list[Request]
    pending: PendingTokens
    seq_ids: frozenset[int]
    num_pushed_tokens: int = 0
    start_s: float = 0.0
    shape: StepShape | None = None
    prompt_ids: tuple = ()  # requests whose prompt tokens it computes; filled only while tracing


def same_requests(a: list[Request], b: list[Request]) -> bool:
    """The same request objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
