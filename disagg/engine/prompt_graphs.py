"""Piecewise CUDA graphs of prompt and mixed forwards: everything between two attentions.

A step with prompt tokens cannot replay a whole-forward graph (its attention depends on the
chunk layout). Run eagerly, an 8B model's ~300 kernel launches per forward cost ~40 ms of host
time on an H100 whatever the chunk: an 8-token prompt beside 24 decodes took as long as a
512-token one (benchmarks/records/prompt-graphs-2026-11-27). As vLLM's piecewise graphs do, the
parts between attentions are captured per token bucket and replayed, and only attention (RoPE +
KV append, paged prefill / decode, the pushes of a prefill worker) runs eagerly between them: per
forward, `L + 1` replays and ~3 eager launches per layer.

The pieces are the model's own (`Model.piece_embed`, `Model.piece_between`), so the graphed and
the eager forward run the same code. A forward of T tokens takes the smallest bucket >= T
(`prompt_buckets`: 16 ... `MAX_GRAPH_TOKENS`); its pieces read and write static buffers
(``ids``, ``qkv``, ``o``, ``residual``, ``hidden``), rows T.. of which are padding: every piece
works row by row (GEMMs, norms, SwiGLU), so padded rows never reach a real one, and attention,
the KV writes and the logits see rows :T only. Larger forwards run eagerly: from ~1-2k tokens
the GPU's work outlasts the launches anyway. All buckets share one memory pool; each is
captured on first use, or at warm-up by `capture_all`. Pure-decode steps keep their
whole-forward graphs (`disagg.engine.graphs`). Owned by the model runner, on CUDA.

With ``capture=False`` (CPU tests) the pieces run eagerly over the same static buffers, so the
padding and buffer plumbing is testable without a GPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from disagg.model.layers import preferred_blas
from disagg.settings import active

logger = logging.getLogger(__name__)

MAX_GRAPH_TOKENS = 2048
# Padding costs GEMM work that grows with the bucket, so the steps narrow as the buckets grow.
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def prompt_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token buckets up to min(``max_num_batched_tokens``, `MAX_GRAPH_TOKENS`); the cap itself
    ends the list when it falls between two buckets."""
    cap = min(int(max_num_batched_tokens), MAX_GRAPH_TOKENS)
    buckets = [b for b in BUCKETS if b <= cap]
    return buckets if buckets and buckets[-1] == cap else buckets + [cap]


class _Piece:
    """One piece of one bucket: its graph (None without capture) and the function it runs."""

    def __init__(self, fn: Callable[[], None], graph: torch.cuda.CUDAGraph | None) -> None:
        self.fn, self.graph = fn, graph

    def replay(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class PromptGraphs:
    """The piecewise graphs of one model, per token bucket.

    Args:
        model: the Model (`piece_embed`, `piece_between`).
        max_num_batched_tokens: the engine's token budget (caps the buckets).
        capture: capture CUDA graphs (False: run the pieces eagerly over the static buffers).
    """

    def __init__(self, model, max_num_batched_tokens: int, *, capture: bool = True) -> None:
        self.model = model
        self.device = model.device
        self.buckets = prompt_buckets(max_num_batched_tokens)
        self.capture = capture
        c = model.config
        top = self.buckets[-1]
        qkv_size = c.q_size + 2 * c.kv_size
        new = dict(dtype=model.dtype, device=self.device)
        self.ids = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.qkv = torch.zeros(top, qkv_size, **new)
        self.o = torch.zeros(top, c.q_size, **new)
        self.residual = torch.zeros(top, c.hidden_size, **new)
        self.hidden = torch.zeros(top, c.hidden_size, **new)
        self._pieces: dict[int, list[_Piece]] = {}
        self._pool = None
        self.capture_seconds = 0.0
        self.num_replays = 0  # forwards run through the pieces

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket >= ``num_tokens``; None when the forward is larger (eager)."""
        return next((b for b in self.buckets if b >= num_tokens), None) if num_tokens > 0 else None

    def pieces(self, num_tokens: int) -> GraphPieces | None:
        """The pieces for a forward of ``num_tokens`` tokens (captured now if new), or None."""
        bucket = self.bucket(num_tokens)
        if bucket is None:
            return None
        self.num_replays += 1
        return GraphPieces(self, self._get(bucket), num_tokens)

    def capture_all(self) -> float:
        """Capture every bucket ahead of serving; return the seconds it took."""
        start = time.perf_counter()
        for bucket in reversed(self.buckets):  # the largest first: the pool is sized once
            self._get(bucket)
        return time.perf_counter() - start

    def _get(self, bucket: int) -> list[_Piece]:
        if bucket not in self._pieces:
            start = time.perf_counter()
            self._pieces[bucket] = self._build(bucket)
            seconds = time.perf_counter() - start
            self.capture_seconds += seconds
            logger.info("captured the prompt graphs of %d tokens (%.3f s)", bucket, seconds)
        return self._pieces[bucket]

    def _functions(self, bucket: int) -> list[Callable[[], None]]:
        """Piece 0 (embedding, layer 0's norm and qkv) and piece l + 1 (layer l after its
        attention), each over rows :bucket of the static buffers."""
        ids, qkv, o, res, hidden = (t[:bucket] for t in (self.ids, self.qkv, self.o, self.residual, self.hidden))
        model, last = self.model, self.model.config.num_layers - 1

        def embed() -> None:
            out, residual = model.piece_embed(ids)
            qkv.copy_(out)
            _store(res, residual)

        def between(index: int) -> Callable[[], None]:
            def run() -> None:
                out, residual = model.piece_between(index, o, res)
                (hidden if index == last else qkv).copy_(out)
                _store(res, residual)
            return run
        return [embed] + [between(index) for index in range(last + 1)]

    def _build(self, bucket: int) -> list[_Piece]:
        functions = self._functions(bucket)
        if not self.capture:
            return [_Piece(fn, None) for fn in functions]
        pieces = []
        with torch.inference_mode(), active(self.model.settings), preferred_blas(self.device, bucket):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for fn in functions:  # warm-up: compile kernels, settle allocations
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for fn in functions:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    fn()
                if self._pool is None:
                    self._pool = graph.pool()
                pieces.append(_Piece(fn, graph))
        torch.cuda.synchronize(self.device)
        return pieces


def _store(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a piece's residual stream into the static one (the fused norm updated it in place)."""
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)


class GraphPieces:
    """One forward of ``num_tokens`` tokens through a bucket's pieces; `Model._forward` drives it
    as it drives `disagg.model.llama.EagerPieces` (same interface)."""

    def __init__(self, graphs: PromptGraphs, pieces: list[_Piece], num_tokens: int) -> None:
        self.graphs, self._pieces, self.num_tokens = graphs, pieces, num_tokens

    @property
    def residual(self) -> torch.Tensor:
        return self.graphs.residual[:self.num_tokens]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.graphs.ids[:self.num_tokens].copy_(input_ids, non_blocking=True)
        self._pieces[0].replay()
        return self.graphs.qkv[:self.num_tokens]

    def attention_out(self, index: int, batch: Any) -> torch.Tensor:
        return self.graphs.o[:self.num_tokens]

    def between(self, index: int, o: torch.Tensor) -> torch.Tensor:
        self._pieces[index + 1].replay()
        last = index + 1 == len(self._pieces) - 1
        return (self.graphs.hidden if last else self.graphs.qkv)[:self.num_tokens]
