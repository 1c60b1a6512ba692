"""`ColocatedEngine`: prefill and decode of many requests on one worker (the strong baseline).

A plain object that one process owns (a test, a script, a Ray actor). Each `step` is one forward:
the scheduler (`disagg.engine.scheduler`) picks decodes first, then prompt chunks, under the
token and sequence budgets; the page tables come from `disagg.cache.PagedKVCache`; the forward,
sampling and CUDA graphs (pure-decode steps) are the model runner's (`disagg.engine.runner`), the
same as the disaggregated decode engine's. Requests whose pages run out are preempted and
recomputed, never failed.
"""

from __future__ import annotations

import logging
from typing import Hashable

import numpy as np
import torch

from disagg.cache import PagedKVCache
from disagg.engine.request import (Request, RequestFactory, TokenOutput, check_engine_sizes,
                                   check_fits, check_new_request)
from disagg.engine.runner import ModelRunner
from disagg.engine.scheduler import ScheduledBatch, Scheduler
from disagg.sampling import SamplingParams

logger = logging.getLogger(__name__)


class ColocatedEngine:
    """Continuous batching with chunked prefill and preemption by recompute.

    Args:
        model: a `disagg.model` Model.
        num_pages: pages in this engine's KV cache.
        page_size: tokens per page.
        max_num_seqs: sequences per forward.
        max_num_batched_tokens: tokens per forward (the prefill chunk budget).
        kv_dtype: KV dtype (default: the model's).
        use_cuda_graphs: None = on CUDA; False = eager always.
    """

    def __init__(self, model, *, num_pages: int, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_dtype: torch.dtype | None = None,
                 use_cuda_graphs: bool | None = None) -> None:
        check_engine_sizes(num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens)
        self.model = model
        self.max_model_len = int(model.config.max_position_embeddings)
        self.cache = PagedKVCache(num_pages, page_size)
        kv = torch.zeros(model.kv_shape(num_pages, page_size), dtype=kv_dtype or model.dtype,
                         device=model.device)
        self.runner = ModelRunner(model, kv, max_num_seqs=max_num_seqs, use_cuda_graphs=use_cuda_graphs)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[Hashable, Request] = {}
        self._factory = RequestFactory(tuple(model.config.eos_token_ids))
        self._outputs: list[TokenOutput] = []  # abort notices, returned by the next step

    # ------------------------------------------------------------------ requests
    def add(self, request_id: Hashable, prompt_token_ids: list[int],
            params: SamplingParams | None = None) -> None:
        """Queue a request. Raises ValueError/TypeError (nothing changes) on bad input."""
        params = SamplingParams() if params is None else params
        prompt = check_new_request(request_id, prompt_token_ids, params, known=self.requests,
                                   vocab_size=self.model.config.vocab_size,
                                   max_model_len=self.max_model_len)
        check_fits(request_id, len(prompt), params, max_model_len=self.max_model_len,
                   num_pages=self.cache.num_pages, page_size=self.cache.page_size)
        req = self._factory.new(request_id, prompt, params)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request and free its pages; the next step reports it ("abort"). False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        self._outputs.append(TokenOutput(request_id, None, True, "abort"))
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._outputs)

    def stats(self) -> dict:
        return {"free_pages": self.cache.num_free_pages, "total_pages": self.cache.num_pages,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "num_forwards": self.runner.num_forwards,
                "num_graph_replays": self.runner.num_graph_replays}

    def warmup(self, prompt_len: int | None = None, max_kv_len: int | None = None) -> dict[str, float]:
        """Compile the kernels and capture the decode graphs before the first request (idle only).

        Returns:
            Seconds per phase (see `ModelRunner.warmup`).
        """
        if self.scheduler.has_work():
            raise RuntimeError("warmup: the engine has requests; call it before the first add")
        n = prompt_len or self.scheduler.max_num_batched_tokens
        return self.runner.warmup(self.cache, prompt_len=n, max_kv_len=max_kv_len)

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenOutput]:
        """Run one forward (if there is work); return this step's outputs."""
        outputs, self._outputs = self._outputs, []
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        tokens, sampled = self._forward(batch)
        for req, token in zip(sampled, tokens):
            if not req.decoding:
                self.scheduler.finish_prompt(req)
            out = req.append(token, self.max_model_len)
            outputs.append(out)
            if out.finished:
                self.scheduler.remove(req)
                del self.requests[req.request_id]
        return outputs

    def _forward(self, batch: ScheduledBatch) -> tuple[list[int], list[Request]]:
        """One forward over ``batch``; returns the sampled ids and their requests."""
        reqs, counts = batch.requests, batch.num_tokens
        ids = np.concatenate([np.asarray(r.token_ids[r.num_computed: r.num_computed + n], dtype=np.int64)
                              for r, n in zip(reqs, counts)])
        rows = [i for i, (r, n) in enumerate(zip(reqs, counts)) if r.num_computed + n == len(r.token_ids)]
        sampled = [reqs[i] for i in rows]
        plan = self.cache.begin_forward([r.seq_id for r in reqs], counts)
        try:
            pending = self.runner.execute(plan, ids, np.asarray(rows, dtype=np.int64), sampled)
        finally:
            self.cache.end_forward()
        for r, n in zip(reqs, counts):
            r.num_computed += n
        return pending.result(), sampled
