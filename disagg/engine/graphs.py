"""CUDA graphs of pure-decode forwards, one per batch-size bucket, replayed with padding.

Owned by the model runner on CUDA (colocated and decode engines). As nano-vllm's model runner:
a batch of B decodes runs the graph of the smallest bucket >= B (1, 2, 4, 8, ..., up to
``max_num_seqs``); rows B..bucket-1 are padding (no pages, append slot -1, token 0), so they
write nothing and their logits are ignored. Larger batches run eagerly.

Static inputs: every graph reads one static `AttentionBatch` (`Model.static_decode_batch`: one
packed index buffer and the token ids, filled per step by `copy_from_plan` with one
host-to-device copy from pinned staging); each bucket captures a prefix view of it with its own
attention output, split workspace and split count. The split count is fixed at capture and
follows the batch's longest context, so graphs are keyed by (bucket, split count for the
context class: the next power of two >= the longest sequence, at least `MIN_KV_CLASS`),
captured lazily on first use (or ahead of time by `capture_all`), all in one memory pool.
When the step's token ids are already on the device (the previous step's samples), they are
copied device to device into the static ids after the plan. Buckets of at most
`SMALL_BATCH_MAX_ROWS` sequences are captured as small-batch graphs (skinny GEMMs, layer kernels
under PDL; `disagg.kernels.dispatch.small_batch_graph`), so their kernel variants, like every
other, compile at capture, never mid-serving.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from disagg.kernels import choose_num_splits
from disagg.kernels.dispatch import device_sms, small_batch_graph
from disagg.model.batch import AttentionBatch
from disagg.plan import ForwardPlan

logger = logging.getLogger(__name__)

MIN_KV_CLASS = 256
# Buckets of at most this many sequences are captured under `small_batch_graph`: the skinny GEMM
# for every projection and the layer kernels under PDL (the next kernel's prologue and weight
# prefetch overlap this one's tail). That wins while a step is latency-bound; from 32 sequences
# cuBLASLt's GEMMs win (benchmarks/records/tuning-notes.md).
SMALL_BATCH_MAX_ROWS = 16


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_seqs]


def kv_class(max_kv_len: int) -> int:
    """The context class of a batch: next power of two >= its longest sequence (>= MIN_KV_CLASS)."""
    return max(MIN_KV_CLASS, 1 << max(0, int(max_kv_len) - 1).bit_length())


class _Graph:
    """One captured forward: the graph, the batch view it reads, its logits output."""

    def __init__(self, graph: torch.cuda.CUDAGraph, batch: AttentionBatch, logits: torch.Tensor) -> None:
        self.graph, self.batch, self.logits = graph, batch, logits


class DecodeGraphs:
    """Captures and replays decode graphs for one model and KV tensor.

    Args:
        model: the Model (its forward on a pure-decode batch is capturable).
        kv: ``[L, num_pages, 2, H_kv, P, D]`` on CUDA.
        max_num_seqs: the largest bucket.
        kv_scales: passed to ``model.forward`` (fp8 caches).
    """

    def __init__(self, model, kv: torch.Tensor, max_num_seqs: int, kv_scales=None) -> None:
        self.model, self.kv, self.kv_scales = model, kv, kv_scales
        self.device = kv.device
        self.page_size = int(kv.shape[4])
        self.buckets = batch_buckets(max_num_seqs)
        self.static = model.static_decode_batch(max_num_seqs, int(kv.shape[1]))
        self._num_kv_heads = int(kv.shape[3])
        self._num_sms = device_sms(self.device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self.capture_seconds = 0.0

    def can_run(self, plan: ForwardPlan) -> bool:
        """A pure-decode plan (one token per sequence) small enough for a bucket."""
        b = plan.batch_size
        return 0 < b <= self.buckets[-1] and plan.num_tokens == b

    def run(self, plan: ForwardPlan, ids: torch.Tensor | np.ndarray | list[int]) -> torch.Tensor:
        """Replay the bucket's graph for ``plan``; returns ``[B, vocab]`` logits (a view)."""
        b = plan.batch_size
        kv_lens = np.diff(plan.page_indptr).astype(np.int64) * self.page_size
        graph = self._get(next(x for x in self.buckets if x >= b), kv_class(int(kv_lens.max())))
        if isinstance(ids, torch.Tensor):
            self.static.copy_from_plan(plan, None)
            graph.batch.input_ids[:b].copy_(ids, non_blocking=True)
        else:
            self.static.copy_from_plan(plan, ids)
        graph.graph.replay()
        return graph.logits[:b]

    def capture_all(self, batch_sizes: list[int] | None = None, max_kv_len: int | None = None) -> float:
        """Capture the graphs of ``batch_sizes`` (default: every bucket) for every context class
        up to ``max_kv_len`` ahead of serving; return the seconds it took.

        Every class, not only the largest: a class of another split count captured on first use
        mid-serving (and compiled the decode kernel for it) stalled every running request.
        """
        start = time.perf_counter()
        top = kv_class(max_kv_len or MIN_KV_CLASS)
        classes = [MIN_KV_CLASS << i for i in range((top // MIN_KV_CLASS).bit_length())]
        for b in batch_sizes or self.buckets:
            for context_class in classes:
                self._get(next(x for x in self.buckets if x >= b), context_class)
        return time.perf_counter() - start

    def _get(self, bucket: int, context_class: int) -> _Graph:
        num_splits = choose_num_splits(bucket, self._num_kv_heads, context_class, self._num_sms)
        key = (bucket, num_splits)
        if key not in self._graphs:
            start = time.perf_counter()
            self._graphs[key] = self._capture(bucket, num_splits)
            seconds = time.perf_counter() - start
            self.capture_seconds += seconds
            logger.info("captured the decode graph of batch %d, %d splits (%.3f s)", bucket, num_splits, seconds)
        return self._graphs[key]

    def _capture(self, bucket: int, num_splits: int) -> _Graph:
        # The warm-up forwards below really run: over the last step's rows they would append that
        # step's tokens again, into pages that may since have been freed and handed to another
        # request (a capture mid-serving, before `capture_all` ran at start-up). All padding.
        self.static.clear_static()
        batch = self.static.view(bucket, num_splits)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with small_batch_graph(bucket <= SMALL_BATCH_MAX_ROWS):
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compile kernels, settle allocations
                    self.model.forward(batch.input_ids, batch, self.kv, kv_scales=self.kv_scales)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.model.forward(batch.input_ids, batch, self.kv, kv_scales=self.kv_scales)
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize(self.device)
        return _Graph(graph, batch, logits)
