"""`ColocatedEngine`: prefill and decode of many requests on one worker (the strong baseline).

A plain object that one process owns (a test, a script, a Ray actor). Each `step` is one forward:
the scheduler (`disagg.engine.scheduler`) picks decodes first, then prompt chunks, under the
token and sequence budgets; the page tables come from `disagg.cache.PagedKVCache`; the forward,
sampling and CUDA graphs (pure-decode steps) are the model runner's (`disagg.engine.runner`), the
same as the disaggregated decode engine's. Requests whose pages run out are preempted and
recomputed, never failed.

Host/GPU overlap, as in `DecodeEngine`: while the GPU runs a pure-decode step over every running
request with none waiting, the next step's slots are reserved and its plan built; if after the
sync the batch is still the same (nobody ended, was aborted or arrived), the next step reuses
that plan and the sampled ids still on the device, skipping the scheduler (which would pick
exactly that batch); otherwise the reserved slots are rolled back and the scheduler runs.
`async_scheduling=True` launches that reserved step before this one's tokens are read, as
`DecodeEngine` does (a token sampled after a stop is discarded; the pages of a request that ends
or is aborted meanwhile are released once no launched step writes them). On by default, as on
the decode engine, so a comparison of the two runs both with the same host overlap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from disagg.cache import PagedKVCache
from disagg.engine.request import (Request, RequestFactory, TokenOutput, check_engine_sizes,
                                   check_fits, check_new_request)
from disagg.engine.runner import ModelRunner, PendingTokens
from disagg.engine.scheduler import ScheduledBatch, Scheduler
from disagg.errors import OutOfPages
from disagg.plan import ForwardPlan
from disagg.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _NextStep:
    """A pure-decode step reserved while the GPU ran the one before it (module docstring)."""

    requests: list[Request]
    plan: ForwardPlan
    device_ids: torch.Tensor | None = None


@dataclass
class _Launched:
    """A launched forward whose sampled ids have not been read."""

    requests: list[Request]  # every row of the forward
    sampled: list[Request]
    pending: PendingTokens
    seq_ids: frozenset[int]


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
        async_scheduling: launch a reserved decode-only step before reading the tokens of the
            one before it (see the module docstring).
    """

    def __init__(self, model, *, num_pages: int, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_dtype: torch.dtype | None = None,
                 use_cuda_graphs: bool | None = None, async_scheduling: bool = True) -> None:
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
        self._next: _NextStep | None = None
        self.num_reserved_steps = 0  # steps that ran a plan reserved during the step before
        self.async_scheduling = bool(async_scheduling)
        self._inflight: _Launched | None = None  # async scheduling: launched, ids not read
        self._deferred: list[Request] = []  # ended requests whose pages a launched step still writes
        self.num_steps_ahead = 0

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
        self._forget(req)
        self._outputs.append(TokenOutput(request_id, None, True, "abort"))
        return True

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self._outputs) or self._inflight is not None
                or bool(self._deferred))

    def stats(self) -> dict:
        return {"free_pages": self.cache.num_free_pages, "total_pages": self.cache.num_pages,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "num_forwards": self.runner.num_forwards,
                "num_graph_replays": self.runner.num_graph_replays,
                "num_reserved_steps": self.num_reserved_steps, "num_steps_ahead": self.num_steps_ahead}

    def warmup(self, prompt_len: int | None = None, max_kv_len: int | None = None) -> dict[str, float]:
        """Compile the kernels and capture the decode graphs before the first request (idle only).

        Returns:
            Seconds per phase (see `ModelRunner.warmup`).
        """
        if self.scheduler.has_work():
            raise RuntimeError("warmup: the engine has requests; call it before the first add")
        self._take_reserved()  # a step reserved before the last request ended: nothing to keep
        n = prompt_len or self.scheduler.max_num_batched_tokens
        return self.runner.warmup(self.cache, prompt_len=n, max_kv_len=max_kv_len)

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenOutput]:
        """Run one forward (if there is work); return this step's outputs."""
        outputs, self._outputs = self._outputs, []
        current, self._inflight = self._inflight, None
        if current is None:
            current = self._launch_next()
            if current is None:
                return outputs
            self._reserve_next(current.requests)  # while the GPU runs this step
        if self.async_scheduling:
            self._inflight = self._launch_ahead(current)
        for req, token in zip(current.sampled, current.pending.result()):
            if self.requests.get(req.request_id) is not req:
                continue  # aborted, or ended on the previous token, since this step's launch
            if not req.decoding:
                self.scheduler.finish_prompt(req)
            out = req.append(token, self.max_model_len)
            outputs.append(out)
            if out.finished:
                del self.requests[req.request_id]
                self._forget(req)
        self._release_deferred()
        ahead = self._inflight
        if ahead is not None:
            self._reserve_next([r for r in ahead.sampled if self.requests.get(r.request_id) is r])
        elif self._next is not None and _same(self._next.requests, current.sampled):
            self._next.device_ids = current.pending.device_tokens  # row i is request i's next input
        return outputs

    def _launch_next(self) -> _Launched | None:
        """Launch the reserved step if it is still what the scheduler would pick, else schedule."""
        reserved = self._take_reserved()
        if reserved is None:
            batch = self.scheduler.schedule()
            if not batch:
                return None
            return self._launch(batch)
        self.num_reserved_steps += 1
        return self._launch_reserved(reserved, reserved.device_ids, step_offset=0)

    def _launch_reserved(self, reserved: _NextStep, ids: torch.Tensor, step_offset: int) -> _Launched:
        reqs = list(reserved.requests)
        pending = self.runner.execute(reserved.plan, ids, np.arange(len(reqs)), reqs, step_offset=step_offset)
        for req in reqs:
            req.num_computed += 1
        return _Launched(reqs, reqs, pending, frozenset(r.seq_id for r in reqs))

    def _launch_ahead(self, current: _Launched) -> _Launched | None:
        """Launch the reserved next step before ``current``'s ids are read, when it holds exactly
        ``current``'s requests (all running, none waiting to join); its input ids are
        ``current``'s sampled ids on the device."""
        nxt = self._next
        if nxt is None or self.scheduler.waiting or not _same(nxt.requests, current.sampled):
            return None
        if not _same(nxt.requests, self.scheduler.running) or any(
                self.requests.get(r.request_id) is not r for r in nxt.requests):
            return None
        self._next = None
        self.num_steps_ahead += 1
        return self._launch_reserved(nxt, current.pending.device_tokens, step_offset=1)

    def _forget(self, req: Request) -> None:
        """Take ``req`` out of the scheduler; release its pages now, or once no launched step
        writes them."""
        self.scheduler.remove(req, release=False)
        self._release_when_safe(req)

    def _release_when_safe(self, req: Request) -> None:
        if self._inflight is not None and req.seq_id in self._inflight.seq_ids:
            self._deferred.append(req)  # a launched step still appends to its pages
        else:
            self.scheduler.release(req)

    def _release_deferred(self) -> None:
        """Release the ended requests that no launched step writes any more."""
        waiting, self._deferred = self._deferred, []
        for req in waiting:
            self._release_when_safe(req)

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        """Launch one forward over ``batch`` (the scheduler's)."""
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
        return _Launched(reqs, sampled, pending, frozenset(r.seq_id for r in reqs))

    def _reserve_next(self, reqs: list[Request]) -> None:
        """Reserve the next step's slots when it will surely be this pure-decode batch again:
        ``reqs`` are exactly the running requests (so decodes only, one token each: a prompt chunk
        belongs to a waiting request), none waiting, none at its length limit."""
        if (self.scheduler.waiting or not _same(reqs, self.scheduler.running)
                or any(r.num_output_tokens + 1 >= r.params.max_tokens
                       or len(r.token_ids) + 1 >= self.max_model_len for r in reqs)):
            return
        try:
            plan = self.cache.begin_forward([r.seq_id for r in reqs], [1] * len(reqs))
        except OutOfPages:
            return  # the scheduler will preempt at the next step
        self.cache.end_forward()
        self._next = _NextStep(list(reqs), plan)

    def _take_reserved(self) -> _NextStep | None:
        """The reserved step if the scheduler would pick exactly its batch now, else None (its
        slots rolled back)."""
        nxt, self._next = self._next, None
        if nxt is None:
            return None
        if (nxt.device_ids is not None and not self.scheduler.waiting and _same(nxt.requests, self.scheduler.running)
                and all(self.requests.get(r.request_id) is r for r in nxt.requests)):
            return nxt
        for req in nxt.requests:
            if req.in_cache and req.seq_id in self.cache:
                self.cache.popn(req.seq_id, 1)
        return None


def _same(a: list[Request], b: list[Request]) -> bool:
    """The same request objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
