"""`ColocatedEngine`: prefill and decode of many requests on one worker (the strong baseline).

A configuration of `EngineCore` (`core.py`) without a symmetric heap: every request is local,
computed in prompt chunks and decoded here. The scheduler picks decodes first, then prompt
chunks, under the token and sequence budgets; requests whose pages run out are preempted and
recomputed, never failed. Pure-decode steps replay CUDA graphs and, with ``async_scheduling``
(on by default, as on the decode engine, so a comparison of the two runs both with the same host
overlap), the next one is launched before this one's tokens are read.
"""

from __future__ import annotations

from typing import Hashable

from disagg.engine.core import EngineCore
from disagg.engine.options import EngineOptions
from disagg.sampling import SamplingParams


class ColocatedEngine(EngineCore):
    """Continuous batching with chunked prefill and preemption by recompute.

    Args:
        model: a `disagg.model` Model.
        num_pages: pages in this engine's KV cache.
        page_size: tokens per page.
        max_num_seqs: sequences per forward.
        max_num_batched_tokens: tokens per forward (the prefill chunk budget).
        options: everything else (`EngineOptions`: graphs, async scheduling, prefix caching, KV
            dtype); the sizes may be given there instead of as keywords. None: the defaults.
    """

    def __init__(self, model, *, num_pages: int | None = None, page_size: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 options: EngineOptions | None = None) -> None:
        options = (EngineOptions() if options is None else options).with_sizes(
            num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens)
        super().__init__(model, options)

    def add(self, request_id: Hashable, prompt_token_ids: list[int],
            params: SamplingParams | None = None) -> None:
        """Queue a request. Raises ValueError/TypeError (nothing changes) on bad input."""
        self._add(request_id, prompt_token_ids, params)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request and free its pages; the next step reports it ("abort"). False if unknown."""
        return self._abort(request_id) is not None

    def stats(self) -> dict:
        return self._core_stats()

    def warmup(self, prompt_len: int | None = None, max_kv_len: int | None = None) -> dict[str, float]:
        """Compile the kernels and capture the decode graphs before the first request (idle only).

        Returns:
            Seconds per phase (see `ModelRunner.warmup`).
        """
        return self._warmup(prompt_len=prompt_len or self.max_num_batched_tokens, decode=True,
                            max_kv_len=max_kv_len)
