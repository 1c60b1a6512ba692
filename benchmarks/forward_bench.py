"""The engine benchmarks' timing kit: one model's forwards on a runner, timed back to back.

`Bench` holds a model, one KV tensor and a `ModelRunner`, and builds the page tables of each case;
`timed` is the mean seconds of a call (CUDA events on a GPU, the wall clock on the CPU). Used by
`bench_engine.py` (one GPU) and `bench_tensor_parallel.py` (every rank of a TP model, each in its
own process), and by the spikes beside them; imported by name, this folder on ``sys.path``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from disagg.cache import PagedKVCache
from disagg.engine.request import RequestFactory
from disagg.engine.runner import ModelRunner
from disagg.sampling import SamplingParams

GiB = 1 << 30
PAGE_SIZE = 16


def timed(fn, reps: int, device: torch.device) -> float:
    """Mean seconds per call of ``fn`` run ``reps`` times back to back (after one warm-up)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(model, kv_dtype: torch.dtype) -> int:
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * kv_dtype.itemsize


class Bench:
    """One model, one KV tensor, one runner; builds page tables per case (no KV is computed for
    the contexts of decode cases: their pages hold zeros, which costs the same to read)."""

    def __init__(self, model, num_pages: int, max_num_seqs: int) -> None:
        self.model, self.device = model, model.device
        self.num_pages = num_pages
        kv = torch.zeros(model.kv_shape(num_pages, PAGE_SIZE), dtype=model.dtype, device=self.device)
        self.runner = ModelRunner(model, kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                  mixed_graphs=True)
        self.mixed_graphs, self.runner.mixed_graphs = self.runner.mixed_graphs, None  # `short` rows only
        self.factory = RequestFactory(())

    def plan(self, contexts: list[int], new_tokens: list[int]):
        """A cache whose sequences hold ``contexts`` tokens, and the plan appending ``new_tokens``."""
        cache = PagedKVCache(self.num_pages, PAGE_SIZE)
        ids = list(range(len(contexts)))
        for i in ids:
            cache.add_sequence(i)
        have = [i for i in ids if contexts[i] > 0]
        if have:
            cache.begin_forward(have, [contexts[i] for i in have])
            cache.end_forward()
        plan = cache.begin_forward(ids, new_tokens)
        cache.end_forward()
        reqs = [self.factory.new(i, [1], SamplingParams()) for i in ids]
        return plan, reqs

    def forward(self, plan, reqs) -> None:
        rows = np.arange(plan.batch_size)
        self.runner.execute(plan, np.ones(plan.num_tokens, dtype=np.int64), rows, reqs)
