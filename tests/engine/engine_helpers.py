"""Helpers shared by the engine tests (and their spawned workers).

`reference_greedy` is the plain loop the engines must match: every step recomputes the whole
sequence in a fresh cache (no KV reuse, no chunking, batch of one); `reference_tokens` runs it for
named prompts with the kernels' torch references. `drain` steps an engine until it has no work and
collects every request's tokens and finish reason; `close_heaps` ends a test's heaps.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Iterator

import pytest
import torch

from disagg.cache import PagedKVCache


def plan_after_prefix(num_pages: int, page_size: int, lengths: list[int], prefix: list[int]):
    """The plan of one forward appending ``lengths`` tokens to sequences 0.. that already hold
    ``prefix`` tokens (their pages taken; no KV computed), in a fresh cache; returns (cache, plan)
    with the forward still open."""
    cache = PagedKVCache(num_pages, page_size)
    for i, n in enumerate(prefix):
        cache.add_sequence(i)
        if n:
            cache.begin_forward([i], [n])
            cache.end_forward()
    return cache, cache.begin_forward(list(range(len(lengths))), lengths)


def reference_greedy(model, prompt: list[int], num_tokens: int, page_size: int = 4) -> list[int]:
    """Greedy tokens of ``prompt``, each from a full recompute over ``model.forward``."""
    from disagg.model.batch import AttentionBatch

    tokens = list(prompt)
    length = len(prompt) + num_tokens
    num_pages = -(-length // page_size)
    kv = torch.zeros(model.kv_shape(num_pages, page_size), dtype=model.dtype, device=model.device)
    out = []
    for _ in range(num_tokens):
        cache = PagedKVCache(num_pages, page_size)
        cache.add_sequence(0)
        plan = cache.begin_forward([0], [len(tokens)])
        batch = AttentionBatch.from_plan(plan, model.device)
        ids = torch.tensor(tokens, dtype=torch.int64, device=model.device)
        logits = model.forward(ids, batch, kv)
        cache.end_forward()
        token = int(logits[-1].argmax())
        out.append(token)
        tokens.append(token)
    return out


@contextlib.contextmanager
def torch_kernels() -> Iterator[None]:
    """Run the kernels' torch references inside the block (TRITON_INTERPRET=0): the
    `torch_reference` fixture's switch, for module-scoped fixtures."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        yield


def reference_tokens(model, prompts: dict[Hashable, list[int]], num_tokens: int) -> dict[Hashable, list[int]]:
    """`reference_greedy` of every named prompt, with the kernels' torch references."""
    with torch_kernels():
        return {name: reference_greedy(model, prompt, num_tokens) for name, prompt in prompts.items()}


def close_heaps(uid: bytes, heaps) -> None:
    """Close a test's symmetric heaps, then check that no /dev/shm file of ``uid`` is left."""
    from disagg.transfer.shm_heap import shm_leftovers

    for heap in heaps:
        heap.close()
    assert shm_leftovers(uid) == []


def drain(engine, max_steps: int = 10_000, arrivals: dict[int, list[tuple]] | None = None) -> dict:
    """Step ``engine`` until it has no work; return {request_id: {"tokens", "reason", "error"}}.
    ``arrivals``: {i: [(request id, prompt, params), ...]} added just before step i."""
    results: dict = {}
    arrivals = arrivals or {}
    last = max(arrivals, default=-1)
    for i in range(max_steps):
        for rid, prompt, params in arrivals.get(i, ()):
            engine.add(rid, prompt, params)
        if not engine.has_work() and i > last:
            return results
        for out in engine.step():
            entry = results.setdefault(out.request_id, {"tokens": [], "reason": None, "error": None})
            assert entry["reason"] is None, f"output after the end of {out.request_id}: {out}"
            if out.token_id is not None:
                entry["tokens"].append(out.token_id)
            if out.finished:
                entry["reason"], entry["error"] = out.finish_reason, out.error
    raise AssertionError(f"engine still has work after {max_steps} steps: {engine.stats()}")


def assert_all_free(engine) -> None:
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"], stats
    engine.cache.check_integrity()


def collective(fns: list[Callable[[], object]], timeout_s: float = 60.0) -> list[object]:
    """Run one callable per PE concurrently (collective heap calls); results in order."""
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=timeout_s) for f in futures]


class FakeClock:
    """A settable clock for the decode engine's leases (``clock=``); ``now`` in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
