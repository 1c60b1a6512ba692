"""`PrefillEngine`: computes prompts and pushes their KV, layer by layer, into decode workers' pages.

One per prefill worker process; its KV tensor comes from the symmetric heap. A request arrives
with the decode side's `RecvDest` (compressed map of the reserved slots, PE, doorbell ticket).
When it is admitted into the local cache, `disagg_mark_send(seq, 0, cmap, pe)` names where every
prompt token goes and the pusher gets its ticket; then each forward (prompts batched, long ones
chunked under ``max_num_batched_tokens``) runs

    plan = cache.begin_forward(...) -> pusher.begin_forward(plan) -> model.forward(..., pusher)
    -> pusher.end_forward()  (rings the doorbells of prompts this forward completed)

so the push of a chunked prompt continues across forwards. A completed prompt yields its first
sampled token (`TokenOutput`, ``finished`` only when that token already ends the request) and
leaves the local cache once its pushes and doorbell are done (the end_forward event on CUDA;
at once on CPU, where the push ran inline). A request is admitted only when its whole prompt
fits in the free pages, so a started push never waits for pages.

An abort says whether the decode pages may still be written (`PushState`): QUIESCED when no
forward pushed the request (still queued, or admitted but never scheduled) or every forward that
did has completed; IN_FLIGHT while the last such forward's transfers may run on (CUDA: a fence
event after them has not completed). An IN_FLIGHT abort's ``"abort"`` output comes from the step
that sees the fence complete: that output is the word that its decode reservation may be freed.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Hashable

import numpy as np
import torch

from disagg import posmap
from disagg.cache import PagedKVCache
from disagg.engine.request import (PushState, RecvDest, Request, RequestFactory, TokenOutput,
                                   check_engine_sizes, check_new_request, pages_for)
from disagg.engine.runner import ModelRunner
from disagg.sampling import SamplingParams
from disagg.transfer import KVPusher

logger = logging.getLogger(__name__)


class PrefillEngine:
    """Batched, chunked prefill with layer-wise KV push.

    Args:
        model: a `disagg.model` Model.
        heap: this PE's symmetric heap (the KV tensor is allocated from it: collective).
        num_pages, page_size: this worker's KV cache.
        max_num_seqs: prompts per forward.
        max_num_batched_tokens: tokens per forward.
        kv_dtype: KV dtype (default: the model's).
        force_segment_puts: push with segment puts even to load/store-reachable peers.
    """

    def __init__(self, model, heap, *, num_pages: int, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_dtype: torch.dtype | None = None,
                 force_segment_puts: bool = False) -> None:
        check_engine_sizes(num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens)
        self.model = model
        self.heap = heap
        self.max_model_len = int(model.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache = PagedKVCache(num_pages, page_size)
        self.kv = heap.alloc(model.kv_shape(num_pages, page_size), kv_dtype or model.dtype)
        self.pusher = KVPusher(heap, self.kv, force_segment_puts=force_segment_puts)
        self.runner = ModelRunner(model, self.kv, max_num_seqs=max_num_seqs, use_cuda_graphs=False)
        self.requests: dict[Hashable, Request] = {}
        self._dests: dict[Hashable, RecvDest] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.draining: list[tuple[Request, torch.cuda.Event | None]] = []
        # Aborted requests whose pushes may still land: request id -> fence event after them.
        self.quiescing: dict[Hashable, torch.cuda.Event] = {}
        self._factory = RequestFactory(tuple(model.config.eos_token_ids))
        self._outputs: list[TokenOutput] = []
        # Every prompt token is pushed: one token's K and V of every layer, bytes.
        self.token_bytes = self.kv.element_size() * self.kv.numel() // (num_pages * page_size)
        self.pushed_bytes = 0
        self.push_s = 0.0  # wall time of the forwards that pushed (compute included: the push overlaps it)

    # ------------------------------------------------------------------ requests
    def add(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams | None,
            dest: RecvDest) -> None:
        """Queue a prompt whose KV goes to ``dest``. Raises ValueError/TypeError (nothing changes)."""
        params = SamplingParams() if params is None else params
        prompt = check_new_request(request_id, prompt_token_ids, params, known=self.requests,
                                   vocab_size=self.model.config.vocab_size,
                                   max_model_len=self.max_model_len)
        if request_id in self.quiescing:  # its abort output must stay unambiguous
            raise ValueError(f"request_id: {request_id!r} was aborted and its pushes may still be in "
                             f"flight; expected a new id (or this one again after its abort output)")
        self._check_dest(request_id, len(prompt), dest)
        if pages_for(len(prompt), self.cache.page_size) > self.cache.num_pages:
            raise ValueError(f"prompt_token_ids: request {request_id!r} has {len(prompt)} tokens, "
                             f"more than this prefill cache holds ({self.cache.num_pages} pages of "
                             f"{self.cache.page_size})")
        req = self._factory.new(request_id, prompt, params)
        self.requests[request_id] = req
        self._dests[request_id] = dest
        self.waiting.append(req)

    def _check_dest(self, request_id: Hashable, prompt_len: int, dest: object) -> None:
        if not isinstance(dest, RecvDest):
            raise TypeError(f"dest: expected the RecvDest from DecodeEngine.reserve, got {type(dest).__name__}")
        if dest.request_id != request_id:
            raise ValueError(f"dest: reserved for request {dest.request_id!r}, got request {request_id!r}")
        if not 0 <= dest.pe < self.heap.world_size or dest.pe == self.heap.rank or dest.ticket.pe != dest.pe:
            raise ValueError(f"dest.pe: expected a receiver PE in [0, {self.heap.world_size}) other than "
                             f"this one ({self.heap.rank}) and equal to its ticket's, got {dest.pe} "
                             f"(ticket PE {dest.ticket.pe})")
        num_slots = len(posmap.decompress(dest.cmap))
        if num_slots != prompt_len:
            raise ValueError(f"dest.cmap: request {request_id!r} has {prompt_len} prompt tokens; "
                             f"expected a map of that many slots, got {num_slots}")

    def abort(self, request_id: Hashable) -> PushState | None:
        """Stop a prompt: it leaves the queue or the cache, its pushes stop, its doorbell never rings.

        Returns:
            None when the request is not here (unknown, or its prompt already completed: the
            doorbell rang or will, which ends the decode side's lease). Else whether a push of it
            may still land in its decode pages (`PushState`): QUIESCED, the ``"abort"`` output
            follows in the next step; IN_FLIGHT, the ``"abort"`` output comes from the step that
            sees the pushes complete, and the id cannot be added again before it.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._dests.pop(request_id, None)
        fence = None
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)
            self.pusher.detach_doorbell(req.seq_id)
            self.cache.remove_sequence(req.seq_id)
            req.in_cache = False
            if req.num_computed:  # some forward pushed part of it
                fence = self._fence_pushes()
        if fence is not None and not fence.query():
            self.quiescing[request_id] = fence
            return PushState.IN_FLIGHT
        self._outputs.append(TokenOutput(request_id, None, True, "abort"))
        return PushState.QUIESCED

    def _fence_pushes(self) -> torch.cuda.Event | None:
        """An event that completes once every push issued so far has landed, or None when all
        have (CPU: the shm heap's pushes ran inline).

        On CUDA the current stream already waits for each forward's transfer streams (`KVPusher.
        end_forward`); a quiet completes the segment puts to peers without load/store access.
        """
        if not self.kv.is_cuda:
            return None
        self.heap.quiet_async()
        event = torch.cuda.Event()
        event.record()
        return event

    def _poll_quiescing(self, outputs: list[TokenOutput]) -> None:
        """Report the aborts whose pushes have completed since the last step."""
        for request_id, fence in list(self.quiescing.items()):
            if fence.query():
                del self.quiescing[request_id]
                outputs.append(TokenOutput(request_id, None, True, "abort"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.draining or self.quiescing or self._outputs)

    def stats(self) -> dict:
        """Pages, queue lengths (``quiescing``: aborts whose pushes may still land) and push
        totals: ``pushed_bytes`` (KV sent to decode workers),
        ``push_s`` (seconds of the forwards that sent it) and ``push_gbps`` (their ratio, GB/s:
        the rate KV leaves this worker while it prefills, a lower bound of the link's)."""
        return {"free_pages": self.cache.num_free_pages, "total_pages": self.cache.num_pages,
                "running": len(self.prefilling), "waiting": len(self.waiting),
                "draining": len(self.draining), "quiescing": len(self.quiescing),
                "num_forwards": self.runner.num_forwards,
                "num_preemptions": 0,  # a prompt is admitted only when all of it fits: never preempted
                "pushed_bytes": self.pushed_bytes, "push_s": self.push_s,
                "push_gbps": self.pushed_bytes / self.push_s / 1e9 if self.push_s else 0.0}

    def warmup(self, prompt_len: int | None = None) -> dict[str, float]:
        """Compile the prefill kernels (attention, projections) before the first request (idle
        only); the push kernel compiles on the first push."""
        if self.has_work():
            raise RuntimeError("warmup: the engine has requests; call it before the first add")
        n = prompt_len or self.max_num_batched_tokens
        return self.runner.warmup(self.cache, prompt_len=n, decode=False)

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenOutput]:
        """Run one prefill forward (if there is work); return the first tokens it produced."""
        outputs, self._outputs = self._outputs, []
        self._poll_quiescing(outputs)
        self._drain()
        self._admit()
        reqs, counts = self._schedule()
        if not reqs:
            return outputs
        ids = np.concatenate([np.asarray(r.token_ids[r.num_computed: r.num_computed + n], dtype=np.int64)
                              for r, n in zip(reqs, counts)])
        rows = [i for i, (r, n) in enumerate(zip(reqs, counts)) if r.num_computed + n == len(r.token_ids)]
        done = [reqs[i] for i in rows]
        start = time.perf_counter()
        plan = self.cache.begin_forward([r.seq_id for r in reqs], counts)
        try:
            pending = self.runner.execute(plan, ids, np.asarray(rows, dtype=np.int64), done,
                                          pusher=self.pusher)
        finally:
            self.cache.end_forward()
        for r, n in zip(reqs, counts):
            r.num_computed += n
        tokens = pending.result()
        self.push_s += time.perf_counter() - start
        self.pushed_bytes += sum(counts) * self.token_bytes
        for req, token in zip(done, tokens):
            outputs.append(req.append(token, self.max_model_len))
            self.prefilling.remove(req)
            del self.requests[req.request_id]
            self._dests.pop(req.request_id, None)
            self.draining.append((req, pending.push_done))
        self._drain()
        return outputs

    def _admit(self) -> None:
        """Move queued prompts into the cache while their whole prompt fits in the free pages."""
        page_size = self.cache.page_size
        owed = sum(pages_for(len(r.token_ids), page_size) - pages_for(r.num_computed, page_size)
                   for r in self.prefilling)
        while self.waiting and len(self.prefilling) < self.max_num_seqs:
            req = self.waiting[0]
            need = pages_for(len(req.token_ids), page_size)
            if owed + need > self.cache.num_free_pages:
                return
            dest = self._dests[req.request_id]
            self.cache.add_sequence(req.seq_id)
            self.cache.disagg_mark_send(req.seq_id, 0, dest.cmap, dest.pe)
            self.pusher.attach_doorbell(req.seq_id, dest.ticket)
            req.in_cache = True
            owed += need
            self.prefilling.append(self.waiting.popleft())

    def _schedule(self) -> tuple[list[Request], list[int]]:
        reqs, counts, budget = [], [], self.max_num_batched_tokens
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.num_to_compute, budget)
            reqs.append(req)
            counts.append(n)
            budget -= n
        return reqs, counts

    def _drain(self) -> None:
        """Remove completed prompts whose pushes and doorbell are done from the local cache."""
        keep = []
        for req, event in self.draining:
            if event is None or event.query():
                self.cache.remove_sequence(req.seq_id)
                req.in_cache = False
            else:
                keep.append((req, event))
        self.draining = keep
