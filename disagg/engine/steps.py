"""The records of one forward: its shape (what it computed) and the launched / reserved steps.

`EngineCore` (core.py) creates them on its step pipeline; `StepShape` also leaves the engine, as
the input of the router's step-time model (`disagg.cluster.routing.placement`, docs/ARCHITECTURE.md §6).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import NamedTuple

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
        num_prefill = num_decodes = num_context = num_pairs = 0
        for r, n in zip(reqs, counts):
            if r.decoding:
                num_decodes += 1
                num_context += r.num_computed
            else:
                num_prefill += n
                num_pairs += prompt_pairs(r.num_computed, n)
        return cls(num_prefill, num_decodes, num_context, num_pairs)

    @classmethod
    def of_decodes(cls, reqs: list[Request]) -> StepShape:
        """`of` a pure-decode forward: every one of ``reqs`` decoding, one token each."""
        return cls(0, len(reqs), sum(map(_num_computed, reqs)), 0)


class TimedForward(NamedTuple):
    """A forward whose span on the GPU is known (`ForwardTimer.done`)."""

    shape: StepShape
    prompt_ids: tuple  # its prompts' request ids (only while tracing)
    seconds: float
    # The GPU's idle seconds between the forward before it and this one (None: the first): the
    # host's share of the gap between two tokens, which no span shows.
    idle_before: float | None = None


class ForwardTimer:
    """Each forward's span on the GPU, from CUDA events recorded on the stream before and after
    it (docs/ARCHITECTURE.md §6, "Step times"). The host's call of `EngineCore.step` cannot time a
    forward under async scheduling: a step whose forward samples no token (a prompt chunk that
    does not end its prompt) returns at once, and the step that reads the next token waits for
    both: timed by the host, 8192-token chunks read 17-35 ms and the chunk ending a prompt the
    whole prompt, and a step model fitted to those times misprices long prompts ~2x. The start
    event waits in the stream behind the forward before it, so a span is the forward's own even
    when it was launched ahead. Off the GPU (``enabled`` False) the caller times the call,
    which there waits for the forward. Between two forwards the end event of the one and the start
    event of the next give the GPU's idle time (``idle_before``): zero where the host launched the
    next one ahead, the host's scheduling and output work where it could not."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        self._pending: collections.deque = collections.deque()
        self._last_end: torch.cuda.Event | None = None  # the end event of the last forward reported

    def begin(self) -> torch.cuda.Event | None:
        """Before a forward's first kernel: its start event (None off the GPU)."""
        if not self.enabled:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))  # the model's device, whichever is current
        return start

    def end(self, start: torch.cuda.Event | None, shape: StepShape, prompt_ids: tuple) -> None:
        """After a forward's last kernel (``start``: its `begin`)."""
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._pending.append((start, end, shape, prompt_ids))

    def done(self) -> list[TimedForward]:
        """The forwards ended on the GPU since the last call, in launch order."""
        out = []
        while self._pending and self._pending[0][1].query():
            start, end, shape, prompt_ids = self._pending.popleft()
            idle = None if self._last_end is None else max(self._last_end.elapsed_time(start) / 1e3, 0.0)
            out.append(TimedForward(shape, prompt_ids, start.elapsed_time(end) / 1e3, idle))
            self._last_end = end
        return out


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
    plan: ForwardPlan | None  # None: its slots reserved without one (`ModelRunner.needs_plan`)
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
    return len(a) == len(b) and all(map(is_, a, b))


_num_computed = attrgetter("num_computed")
