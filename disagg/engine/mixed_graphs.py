"""Whole-forward CUDA graphs of short prompt and mixed steps (``scheduler.cuda_graphs: full``).

The piecewise prompt graphs (`disagg.engine.prompt_graphs`) leave each layer's attention eager:
~3 Triton launches per layer at ~50 us of Python each, so a step of a short prompt beside running
decodes stays host-bound (one H100, 8B model, 24 decodes at 1k context: 128 prompt tokens take
9.9 ms back to back and 11.8 ms of host time, against 7.6 ms for the decode graph of those 24;
`benchmarks/bench_engine.py --only short`). That is the step a prefix-cache hit, a short chat
turn or a request kept on a prefill instance costs, once per request, on its TTFT.

Here the whole forward, attention included, is captured per (token bucket T, decode bucket D),
as the decode graphs are per batch size: every kernel's grid depends only on those (and a fixed
`MAX_GRAPH_PROMPTS`): `paged_decode` over rows ``:D`` with a split count fixed per D, and
`paged_prefill`'s grid of ``cdiv(T - D, BLOCK_M) + MAX_GRAPH_PROMPTS`` programs, the ones past
the real query blocks returning at once. Layout and padding: `disagg.model.batch.MixedBuffers`.
The step replays the smallest bucket with D >= its decodes and T >= D + its prompt tokens.
Prefix-cache fork copies run eagerly before the replay (one launch). Forwards that push KV
(a prefill worker's) stay piecewise: their per-layer puts and waits are host calls.

Buckets: token buckets up to `MAX_FULL_TOKENS` or the token budget plus the decode padding (past ~512 tokens the GPU's work outlasts the
launches: 512 prompt tokens beside 24 decodes take 16.1 ms with 10.3 ms of host time), decode
buckets 0, 1, 2, 4, ... as the decode graphs'. All are captured at warm-up (`capture_all`), in
one memory pool; a plan that fits none runs piecewise. On CPU (``capture=False``) the same
buffers run eagerly, so the layout is testable without a GPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from disagg.engine.graphs import batch_buckets
from disagg.engine.prompt_graphs import prompt_buckets
from disagg.kernels import copy_slots
from disagg.model.batch import MixedBuffers
from disagg.plan import ForwardPlan

logger = logging.getLogger(__name__)

MAX_FULL_TOKENS = 512
MAX_GRAPH_PROMPTS = 16  # prompt sequences per graphed step (more: piecewise)


class MixedGraphs:
    """Captures and replays whole-forward graphs of prompt and mixed steps for one model and KV.

    Args:
        model: the Model.
        kv: ``[L, num_pages, 2, H_kv, P, D]``.
        max_num_seqs: the largest decode bucket.
        max_num_batched_tokens: the engine's token budget (caps the token buckets).
        max_kv_len: the longest sequence (the decode split count follows it; default: the
            model's context limit).
        kv_scales: passed to ``model.forward`` (fp8 caches).
        capture: capture CUDA graphs (False: run the forward eagerly over the static buffers).
    """

    def __init__(self, model, kv: torch.Tensor, max_num_seqs: int, max_num_batched_tokens: int, *,
                 max_kv_len: int | None = None, kv_scales=None, capture: bool = True) -> None:
        self.model, self.kv, self.kv_scales, self.capture = model, kv, kv_scales, capture
        self.device = kv.device
        # A step of the whole budget with its decodes padded to their bucket needs up to
        # budget + max_num_seqs - 1 rows.
        self.token_buckets = prompt_buckets(min(max_num_batched_tokens + max_num_seqs, MAX_FULL_TOKENS))
        top = self.token_buckets[-1]
        self.decode_buckets = [0] + [b for b in batch_buckets(max_num_seqs) if b < top]
        self.max_prompts = min(MAX_GRAPH_PROMPTS, max_num_seqs)
        c = model.config
        self.buffers = MixedBuffers(top, self.decode_buckets[-1], self.max_prompts, int(kv.shape[1]),
                                    num_qo_heads=c.num_qo_heads, num_kv_heads=c.num_kv_heads,
                                    head_dim=c.head_dim, dtype=model.dtype, device=self.device,
                                    max_kv_len=max_kv_len or c.max_position_embeddings)
        # Every graph writes its logits here (rows of decodes, then prompts): one buffer, not
        # one per graph (55 graphs of a 128k vocabulary would hold ~2 GB of logits).
        self.logits = torch.zeros(self.decode_buckets[-1] + self.max_prompts, c.vocab_size,
                                  dtype=torch.float32, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, object]] = {}
        self._pool = None
        self.capture_seconds = 0.0
        self.num_replays = 0

    def bucket(self, plan: ForwardPlan) -> tuple[int, int] | None:
        """(tokens, decodes) of the graph that runs ``plan``, or None (a pure-decode plan: the decode
        graphs'; too many prompts, tokens or decodes)."""
        d, p = MixedBuffers.shape_of(plan)
        if p == 0 or p > self.max_prompts:
            return None
        dec = next((b for b in self.decode_buckets if b >= d), None)
        if dec is None:
            return None
        need = dec + plan.num_tokens - d
        tokens = next((b for b in self.token_buckets if b >= need), None)
        return None if tokens is None else (tokens, dec)

    def run(self, plan: ForwardPlan, token_ids: np.ndarray, bucket: tuple[int, int], *,
            device_prefix: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``plan`` through the graph of ``bucket`` (from `bucket`); returns ``[B, vocab]``
        float32 logits (a view of the graph's output, valid until the next replay).
        ``device_prefix``: the ids of the plan's first k rows (decodes), on the device; their
        entries of ``token_ids`` are ignored."""
        if len(plan.fork_src_slots):
            src, dst = (torch.as_tensor(np.asarray(a, dtype=np.int64)).to(self.device, non_blocking=True)
                        for a in (plan.fork_src_slots, plan.fork_dst_slots))
            copy_slots(self.kv, src, self.kv, dst, check_indices=False if self.capture else None)
        graph, batch = self._get(bucket)
        self.buffers.fill(plan, token_ids, *bucket)
        if device_prefix is not None:  # after the fill's upload, on the same stream
            self.buffers.input_ids[:device_prefix.shape[0]].copy_(device_prefix, non_blocking=True)
        self.num_replays += 1
        if graph is None:
            self._forward(batch)
        else:
            graph.replay()
        return self.logits[:plan.batch_size]

    def capture_all(self, max_kv_len: int | None = None) -> float:
        """Capture every bucket ahead of serving (the largest first: the pool is sized once);
        return the seconds it took. ``max_kv_len``: the longest sequence the engine will hold
        (sets the decode split count, before the first capture only)."""
        start = time.perf_counter()
        if max_kv_len and not self._graphs:
            self.buffers.max_kv_len = int(max_kv_len)
        for tokens in reversed(self.token_buckets):
            for dec in reversed(self.decode_buckets):
                if dec < tokens:
                    self._get((tokens, dec))
        return time.perf_counter() - start

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _forward(self, batch) -> None:
        logits = self.model.forward(batch.input_ids, batch, self.kv, kv_scales=self.kv_scales)
        self.logits[:logits.shape[0]].copy_(logits)

    def _get(self, bucket: tuple[int, int]):
        if bucket not in self._graphs:
            start = time.perf_counter()
            self._graphs[bucket] = self._capture(*bucket)
            seconds = time.perf_counter() - start
            self.capture_seconds += seconds
            logger.info("captured the mixed graph of %d tokens, %d decodes (%.3f s)", *bucket, seconds)
        return self._graphs[bucket]

    def _capture(self, tokens: int, decodes: int):
        batch = self.buffers.bucket_view(tokens, decodes)
        if not self.capture:
            return None, batch
        # The warm-up forwards really run: every row padding, so they write no page.
        self.buffers.clear()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels, settle allocations
                self._forward(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(batch)
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize(self.device)
        return graph, batch
