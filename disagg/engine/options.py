"""`EngineOptions`: every engine's sizes and knobs in one frozen, validated object.

`EngineCore` and its three roles (`ColocatedEngine`, `PrefillEngine`, `DecodeEngine`) take one
`EngineOptions` instead of a dozen keyword flags; the cache and batch sizes may also be given as
keywords (``ColocatedEngine(model, num_pages=..., page_size=..., max_num_seqs=...,
max_num_batched_tokens=...)``), which `with_sizes` merges in. Values are checked once, when the
object is built: a bad one raises ValueError/TypeError naming the field, expected and got.
Built by the cluster's engine builder from the YAML (`make_engine`), by tests and by benchmarks;
runs in the engine's process.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from disagg.errors import InvalidArgument, InvalidArgumentType

__all__ = ["EngineOptions", "PUSH_AFTER", "SIZE_FIELDS"]

# When a forward with receivers pushes its K/V (`ModelRunner._pushes_after`, `transfer.push_after`).
PUSH_AFTER = ("graphs", "never", "always")
SIZE_FIELDS = ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens")
_FLAGS = ("async_scheduling", "async_prompts", "prefix_caching", "force_segment_puts", "verify_transfers")
_TRISTATE = ("use_cuda_graphs", "prompt_graphs", "mixed_graphs")


@dataclass(frozen=True)
class EngineOptions:
    """An engine's cache, batch budgets and step-pipeline switches.

    Attributes:
        num_pages: pages in the engine's KV cache (None: given as the engine's keyword); with a
            ``peer_tensor_parallel`` other than its own, the fleet's pages of its widest side, of
            which a narrower rank views more (`disagg.transfer.heads.HeadLayout.num_pages_of`).
        page_size: tokens per page.
        max_num_seqs: sequences per forward (and decoding at once).
        max_num_batched_tokens: tokens per forward (the prefill chunk budget); a decode engine
            defaults it to ``max(max_num_seqs, 2048)``.
        kv_dtype: KV dtype (None: the model's).
        use_cuda_graphs: decode graphs per batch-size bucket; None = on CUDA; False = eager always.
        prompt_graphs: piecewise graphs of prompt and mixed forwards (`disagg.engine.prompt_graphs`);
            None = as ``use_cuda_graphs``.
        mixed_graphs: whole-forward CUDA graphs of short prompt and mixed steps (pushes after them)
            (`disagg.engine.mixed_graphs`; needs the decode graphs); None = as the decode graphs.
        async_scheduling: launch a reserved decode-only step before reading the tokens of the one
            before it (`EngineCore`'s docstring).
        async_prompts: with ``async_scheduling``, launch the step that starts waiting local prompts
            that way too; False: it waits for the tokens.
        prefix_caching: automatic prefix caching (`disagg.cache`): prompts fork from the longest
            cached prefix and compute only the rest.
        lease_s: seconds a reservation waits for its doorbell before its pages are released.
        clock: monotonic clock for leases (tests pass a fake one).
        force_segment_puts: push with segment puts even to load/store-reachable peers.
        push_after: when pushes run: "graphs" (after a whole-forward graph, else layer by layer),
            "never", "always" (`ModelRunner`; `transfer.push_after`).
        verify_transfers: digest every push and check it before a received request is admitted
            (`transfer.verify`, a debug mode of the KV connector).
        peer_tensor_parallel: the tensor parallelism of the instances on the other side of this
            engine's transfers (the decode instances' for a prefill engine, the prefill
            instances' for a decode engine); None: this instance's own. When it differs, pushes
            split each rank's heads over the other side's ranks (`disagg.transfer.heads`).
    """

    num_pages: int | None = None
    page_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_dtype: torch.dtype | None = None
    use_cuda_graphs: bool | None = None
    prompt_graphs: bool | None = None
    mixed_graphs: bool | None = None
    async_scheduling: bool = True
    async_prompts: bool = True
    prefix_caching: bool = True
    lease_s: float = 60.0
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)
    force_segment_puts: bool = False
    push_after: str = "graphs"
    verify_transfers: bool = False
    peer_tensor_parallel: int | None = None

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                _check_size(name, value)
        for name in _FLAGS:
            _check_type(name, getattr(self, name), bool, "a bool")
        for name in _TRISTATE:
            value = getattr(self, name)
            if value is not None:
                _check_type(name, value, bool, "a bool or None")
        if self.kv_dtype is not None:
            _check_type("kv_dtype", self.kv_dtype, torch.dtype, "a torch.dtype or None")
        if isinstance(self.lease_s, bool) or not isinstance(self.lease_s, (int, float)):
            raise InvalidArgumentType(f"lease_s: expected seconds > 0 (a float), got "
                                      f"{type(self.lease_s).__name__} {self.lease_s!r}", argument="lease_s")
        if not self.lease_s > 0:
            raise InvalidArgument(f"lease_s: expected seconds > 0, got {self.lease_s}", argument="lease_s")
        if not callable(self.clock):
            raise InvalidArgumentType(f"clock: expected a callable returning seconds, got "
                                      f"{type(self.clock).__name__}", argument="clock")
        if self.peer_tensor_parallel is not None:
            _check_size("peer_tensor_parallel", self.peer_tensor_parallel)
        if self.push_after not in PUSH_AFTER:
            raise InvalidArgument(f"push_after: expected one of {PUSH_AFTER}, got {self.push_after!r}",
                                  argument="push_after")

    def with_sizes(self, **sizes: int | None) -> EngineOptions:
        """These options with the sizes given as an engine's keywords filled in (None: not given).

        Raises:
            ValueError: a size given both here and as a keyword, with different values; an
                unknown size name.
        """
        updates = {}
        for name, value in sizes.items():
            if name not in SIZE_FIELDS:
                raise InvalidArgument(f"{name}: expected one of {SIZE_FIELDS}", argument=name)
            if value is None:
                continue
            mine = getattr(self, name)
            if mine is not None and mine != value:
                raise InvalidArgument(f"{name}: given as a keyword ({value!r}) and in options ({mine!r}); "
                                      f"expected one of them, or the same value", argument=name)
            updates[name] = value
        return dataclasses.replace(self, **updates) if updates else self

    def replace(self, **changes) -> EngineOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_sizes(self) -> None:
        """Every size is set: what an engine needs before it builds its cache.

        Raises:
            ValueError: a size left None, naming it.
        """
        for name in SIZE_FIELDS:
            if getattr(self, name) is None:
                raise InvalidArgument(f"{name}: expected an int >= 1 (as the engine's keyword or in its "
                                      f"EngineOptions), got None", argument=name)


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentType(f"{name}: expected an int >= 1, got {type(value).__name__} {value!r}",
                                  argument=name)
    if value < 1:
        raise InvalidArgument(f"{name}: expected an int >= 1, got {value}", argument=name)


def _check_type(name: str, value: object, kind: type, expected: str) -> None:
    if not isinstance(value, kind):
        raise InvalidArgumentType(f"{name}: expected {expected}, got {type(value).__name__} {value!r}",
                                  argument=name)
