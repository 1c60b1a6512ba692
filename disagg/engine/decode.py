"""`DecodeEngine`: receives prompts' KV from prefill workers and runs batched decode steps.

One per decode worker process; its KV tensor comes from the symmetric heap. The request path:

    reserve(request_id, prompt_len, params) -> RecvDest    pages (disagg_prepare_recv) + doorbell
        ... the prefill worker pushes the prompt's KV into those pages and rings the doorbell ...
    start(request_id, first_token_id)                       the first token, sampled by prefill
    step()                                                  polls doorbells; admits a request once
                                                            rung AND started; one decode forward

Pages: `reserve` commits the pages of the request's whole life (prompt + max_tokens, capped by
the context), so a decode step never runs out of pages and never preempts; when the commitment
does not fit, `reserve` raises `OutOfPages` and the caller queues. Until the doorbell rings the
pages belong to the sender (`disagg.engine.lease`): an abort quarantines them, a lease expiry
frees them and fails the request (finish_reason "error"). When the caller knows that no sender
will write them (the prefill side refused the request or never got it, or its abort reported
`PushState.QUIESCED`), `cancel_reservation(dest)` frees them at once, quarantined or not.

Host/GPU overlap of a step (CUDA): the decode forward is a CUDA-graph replay (`runner`), followed
by sampling; while the GPU runs them, the host polls the doorbells and leases (requests rung now
join the next step), then reserves the next step's slots and builds its plan (`begin_forward` +
`end_forward`, the plan arrays kept) for every request that surely continues (not at its length
limit). After the sync, if the batch is unchanged (nobody stopped, aborted or
was admitted), the next step reuses that plan and feeds the sampled ids, still on the device,
straight in as its input ids; otherwise the speculative slots are rolled back (`popn(seq, 1)`)
and the plan is rebuilt. Output bookkeeping (stop checks, TokenOutputs) stays after the sync.

`async_scheduling=True` (vLLM's name) also hides that bookkeeping: when the reserved next step
holds exactly this step's requests and nobody waits to join, it is launched before this step's
sync, its input ids the sampled ids still on the device; `step()` then returns this step's
outputs while the next one runs. A request that stops on this step's token (a stop id) wastes
its row of the step already launched: that token is discarded, and the pages of a request that
ends or is aborted are freed only once no launched step writes them. Seeded draws stay a function
of (seed, token index). On by default: without it the GPU idles between steps while the host
does the bookkeeping (`benchmarks/bench_engine.py`, row decode_idle_B64; figures in
benchmarks/records/tuning-notes.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np
import torch

from disagg.cache import PagedKVCache
from disagg.engine.lease import Lease, LeaseBook
from disagg.engine.request import (RecvDest, Request, RequestFactory, TokenOutput, check_engine_sizes,
                                   pages_for)
from disagg.engine.runner import ModelRunner, PendingTokens
from disagg.errors import OutOfPages
from disagg.plan import ForwardPlan
from disagg.sampling import SamplingParams
from disagg.transfer import DoorbellTable

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched decode step whose sampled ids have not been read."""

    batch: list[Request]
    pending: PendingTokens
    seq_ids: frozenset[int]


@dataclass
class _NextStep:
    """Slots reserved during a step for the step after it (see the module docstring)."""

    seq_ids: tuple[int, ...]
    plan: ForwardPlan
    device_ids: torch.Tensor | None = None


class DecodeEngine:
    """Doorbell admission, continuous batching of decode steps, leases.

    Args:
        model: a `disagg.model` Model.
        heap: this PE's symmetric heap (the KV tensor is allocated from it: collective).
        num_pages, page_size: this worker's KV cache (same geometry as the prefill workers').
        max_num_seqs: sequences per decode step.
        kv_dtype: KV dtype (default: the model's).
        lease_s: seconds a reservation waits for its doorbell before its pages are released.
        use_cuda_graphs: None = on CUDA; False = eager always.
        clock: monotonic clock for leases (tests pass a fake one).
        async_scheduling: launch the next step before reading this one's tokens (see the module
            docstring); False reads every step's tokens before the next launch.
    """

    def __init__(self, model, heap, *, num_pages: int, page_size: int, max_num_seqs: int,
                 kv_dtype: torch.dtype | None = None, lease_s: float = 60.0,
                 use_cuda_graphs: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 async_scheduling: bool = True) -> None:
        check_engine_sizes(num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs)
        self.model = model
        self.heap = heap
        self.max_model_len = int(model.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self.cache = PagedKVCache(num_pages, page_size)
        self.kv = heap.alloc(model.kv_shape(num_pages, page_size), kv_dtype or model.dtype)
        self.runner = ModelRunner(model, self.kv, max_num_seqs=max_num_seqs, use_cuda_graphs=use_cuda_graphs)
        self.leases = LeaseBook(DoorbellTable(heap), lease_s, clock)
        self.requests: dict[Hashable, Request] = {}
        self.running: list[Request] = []
        self.ready: list[Request] = []  # rung and started, waiting for a batch slot
        self._committed: dict[Hashable, int] = {}  # pages promised per reservation
        self._quarantined: dict[Hashable, Request] = {}
        self._next: _NextStep | None = None
        self.async_scheduling = bool(async_scheduling)
        self._inflight: _InFlight | None = None  # async scheduling: launched, tokens not read
        self._deferred: list[Request] = []  # ended requests whose pages a launched step still writes
        self.num_steps_ahead = 0
        self._factory = RequestFactory(tuple(model.config.eos_token_ids))
        self._outputs: list[TokenOutput] = []
        self.num_doorbells_rung = 0
        self.num_reservations_cancelled = 0
        self.doorbell_wait_s = 0.0  # reserve to ring seen, summed over rung reservations (lease clock)

    @property
    def num_committed_pages(self) -> int:
        return sum(self._committed.values())

    # ------------------------------------------------------------------ requests
    def reserve(self, request_id: Hashable, prompt_len: int, params: SamplingParams | None = None) -> RecvDest:
        """Reserve pages for a prompt's KV and arm its doorbell.

        Raises:
            ValueError / TypeError: bad id, length or params (nothing changes).
            OutOfPages: the request's pages do not fit now (nothing changes; queue and retry).
            HeapError: every doorbell word is armed (nothing changes).
        """
        params = SamplingParams() if params is None else params
        self._check_reserve(request_id, prompt_len, params)
        need = pages_for(min(prompt_len + params.max_tokens, self.max_model_len), self.cache.page_size)
        free = self.cache.num_pages - self.num_committed_pages
        if need > free:
            raise OutOfPages(f"reserve: request {request_id!r} needs {need} pages (prompt {prompt_len} + "
                             f"max_tokens {params.max_tokens}); {free} are not committed", num_needed=need,
                             num_free=free)
        req = self._factory.new(request_id, [0] * prompt_len, params)
        self.cache.add_sequence(req.seq_id)
        try:
            cmap = self.cache.disagg_prepare_recv(req.seq_id, prompt_len)
            self.cache.end_forward()
            ticket = self.leases.doorbells.arm(request_id)
        except BaseException:
            self.cache.remove_sequence(req.seq_id)
            raise
        self.leases.open(request_id, ticket)
        req.num_computed, req.in_cache = prompt_len, True
        self.requests[request_id] = req
        self._committed[request_id] = need
        return RecvDest(request_id, [int(x) for x in cmap], self.heap.rank, ticket)

    def _check_reserve(self, request_id: Hashable, prompt_len: object, params: object) -> None:
        try:
            known = request_id in self.requests or request_id in self._quarantined
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, got {type(request_id).__name__}") from None
        if known:
            raise ValueError(f"request_id: {request_id!r} is already in this engine; expected a new id")
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int):
            raise TypeError(f"prompt_len: expected an int, got {type(prompt_len).__name__}")
        if not 1 <= prompt_len < self.max_model_len:
            raise ValueError(f"prompt_len: request {request_id!r}: expected 1..{self.max_model_len - 1} "
                             f"(the model's context is {self.max_model_len}), got {prompt_len}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.validate(self.model.config.vocab_size)
        need = pages_for(min(prompt_len + params.max_tokens, self.max_model_len), self.cache.page_size)
        if need > self.cache.num_pages:
            raise ValueError(f"max_tokens: request {request_id!r} (prompt {prompt_len} + max_tokens "
                             f"{params.max_tokens}) needs {need} pages; expected at most the cache's "
                             f"{self.cache.num_pages}")

    def start(self, request_id: Hashable, first_token_id: int) -> None:
        """Hand over the first token (sampled by the prefill side); decoding starts once rung.

        A first token that already ends the request (stop id, max_tokens == 1) ends it here
        with no output of its own (the prefill side reported it); its pages are freed once safe.

        Raises:
            ValueError / TypeError: unknown or already started request, bad token id.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} has no reservation here; call reserve first")
        if req.num_output_tokens:
            raise ValueError(f"request_id: {request_id!r} was already started")
        vocab = self.model.config.vocab_size
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, (int, np.integer)):
            raise TypeError(f"first_token_id: expected an int, got {type(first_token_id).__name__}")
        if not 0 <= first_token_id < vocab:
            raise ValueError(f"first_token_id: expected an id in [0, {vocab}), got {first_token_id}")
        if req.append(int(first_token_id), self.max_model_len).finished:
            self._drop(req)
        elif request_id not in self.leases:
            self.ready.append(req)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request; pages a sender may still write are quarantined (until the ring, the
        lease expiry or `cancel_reservation`). False if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._drop(req)
        self._outputs.append(TokenOutput(request_id, None, True, "abort"))
        return True

    def cancel_reservation(self, dest: RecvDest) -> None:
        """Free a reservation at once: the caller asserts that no sender will write its pages.

        For a reservation whose KV will never land: the prefill side refused the request or never
        received ``dest``, or its `PrefillEngine.abort` returned `PushState.QUIESCED` (or its
        IN_FLIGHT abort's output came). Its lease closes and its pages go back to the free list:
        a live request ends with an ``"abort"`` output; a quarantined one (aborted earlier) just
        stops waiting for its ring or lease expiry. Calling it while a push may still land hands
        pages that are being written to the next reservation.

        Args:
            dest: what `reserve` returned for the request (its ticket names this reservation, not
                a later one under the same id).

        Raises:
            TypeError: ``dest`` is not a RecvDest.
            ValueError: no open reservation here matches ``dest`` (unknown id, already freed, or
                reserved again), or its doorbell has rung (the KV landed: use `abort`, which
                frees it at once). Nothing changes.
        """
        if not isinstance(dest, RecvDest):
            raise TypeError(f"dest: expected the RecvDest from reserve, got {type(dest).__name__}")
        request_id = dest.request_id
        lease = self.leases.get(request_id)
        if lease is None:
            if request_id in self.requests:
                raise ValueError(f"dest: the doorbell of request {request_id!r} has rung (its KV landed); "
                                 f"expected a reservation still waiting for it: call abort({request_id!r})")
            raise ValueError(f"dest: request {request_id!r} has no open reservation here (unknown, or freed "
                             f"already by its ring, lease expiry or an earlier cancel)")
        if lease.ticket != dest.ticket:
            raise ValueError(f"dest.ticket: request {request_id!r}'s open reservation waits on doorbell word "
                             f"{lease.ticket.index} epoch {lease.ticket.epoch}, got word {dest.ticket.index} "
                             f"epoch {dest.ticket.epoch} (an earlier reservation under the same id)")
        self.leases.cancel(request_id)
        req = self._quarantined.pop(request_id, None)
        if req is None:
            req = self.requests.pop(request_id)
            if req in self.ready:
                self.ready.remove(req)
            self._outputs.append(TokenOutput(request_id, None, True, "abort"))
        self.num_reservations_cancelled += 1
        self._free(req)

    def _drop(self, req: Request) -> None:
        """Forget ``req``; free its pages now, or once its lease closes when KV may be in flight."""
        del self.requests[req.request_id]
        if req in self.running:
            self.running.remove(req)
        if req in self.ready:
            self.ready.remove(req)
        if req.request_id in self.leases:
            self.leases.quarantine(req.request_id)
            self._quarantined[req.request_id] = req
        else:
            self._free(req)

    def _free(self, req: Request) -> None:
        if self._inflight is not None and req.seq_id in self._inflight.seq_ids:
            self._deferred.append(req)  # a launched step still appends to its pages
            return
        self.cache.remove_sequence(req.seq_id)
        req.in_cache = False
        self._committed.pop(req.request_id, None)

    def has_work(self) -> bool:
        return bool(self.running or self.ready or len(self.leases) or self._outputs
                    or self._inflight is not None or self._deferred)

    def stats(self) -> dict:
        """Pages, requests by state, leases, and doorbell totals: ``doorbell_wait_s`` is the time
        reservations waited for their KV (reserve to the ring seen by a step), summed over the
        ``num_doorbells_rung`` that rang; ``num_reservations_cancelled`` counts `cancel_reservation`."""
        return {"free_pages": self.cache.num_free_pages, "total_pages": self.cache.num_pages,
                "running": len(self.running), "waiting": len(self.requests) - len(self.running),
                "leases": len(self.leases), "quarantined": len(self._quarantined),
                "committed_pages": self.num_committed_pages, "num_forwards": self.runner.num_forwards,
                "num_graph_replays": self.runner.num_graph_replays,
                "num_preemptions": 0,  # reserve commits every page of a request's life: never preempted
                "num_doorbells_rung": self.num_doorbells_rung, "doorbell_wait_s": self.doorbell_wait_s,
                "num_reservations_cancelled": self.num_reservations_cancelled,
                "num_steps_ahead": self.num_steps_ahead}

    def warmup(self, max_kv_len: int | None = None) -> dict[str, float]:
        """Compile the decode kernels and capture the graphs before the first request (idle only)."""
        if self.requests or len(self.leases):
            raise RuntimeError("warmup: the engine has requests; call it before the first reserve")
        return self.runner.warmup(self.cache, prompt_len=1, prefill=False, max_kv_len=max_kv_len)

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenOutput]:
        """Admit rung requests, run one decode step; return this step's outputs."""
        outputs, self._outputs = self._outputs, []
        current, self._inflight = self._inflight, None
        if current is None:
            current = self._launch(outputs)
            if current is None:
                return outputs
            polled = True
        else:
            polled = False
        if self.async_scheduling:
            self._inflight = self._launch_ahead(current)
        for req, token in zip(current.batch, current.pending.result()):
            if self.requests.get(req.request_id) is not req:
                continue  # aborted, or ended on the previous token, since this step's launch
            req.num_computed += 1
            out = req.append(token, self.max_model_len)
            outputs.append(out)
            if out.finished:
                self._drop(req)
        self._release_deferred()
        ahead = self._inflight
        if ahead is not None:
            # While the step launched ahead runs: doorbells and leases, the step after it.
            if not polled:
                self._close_leases(outputs)
            if not (self.ready and len(self.running) < self.max_num_seqs):
                self._reserve_next([r for r in ahead.batch if self.requests.get(r.request_id) is r])
        elif self._next is not None and self._next.seq_ids == tuple(r.seq_id for r in current.batch):
            self._next.device_ids = current.pending.device_tokens
        return outputs

    def _launch(self, outputs: list[TokenOutput]) -> _InFlight | None:
        """Admit, plan and launch a step (None when nothing runs); while the GPU runs it, poll
        the doorbells and leases, then reserve the next step (not when a newly rung request
        joins it: that plan would be rebuilt)."""
        self._admit()
        if not self.running:
            self._rollback_next()
            self._close_leases(outputs)
            self._admit()
            if not self.running:
                return None
        batch = list(self.running)
        plan, ids = self._plan(batch)
        pending = self.runner.execute(plan, ids, np.arange(len(batch)), batch)
        self._close_leases(outputs)
        if not (self.ready and len(self.running) < self.max_num_seqs):
            self._reserve_next(batch)
        return _InFlight(batch, pending, frozenset(r.seq_id for r in batch))

    def _launch_ahead(self, current: _InFlight) -> _InFlight | None:
        """Launch the reserved next step before ``current``'s tokens are read, when it holds
        exactly ``current``'s requests (all continue by length, none aborted) and nobody waits
        to join; its input ids are ``current``'s sampled ids on the device."""
        nxt = self._next
        if nxt is None or nxt.seq_ids != tuple(r.seq_id for r in current.batch):
            return None
        if self.ready and len(self.running) < self.max_num_seqs:
            return None
        if any(self.requests.get(r.request_id) is not r for r in current.batch):
            return None
        self._next = None
        pending = self.runner.execute(nxt.plan, current.pending.device_tokens, np.arange(len(current.batch)),
                                      current.batch, step_offset=1)
        self.num_steps_ahead += 1
        return _InFlight(list(current.batch), pending, current.seq_ids)

    def _release_deferred(self) -> None:
        """Free the ended requests that no launched step writes any more."""
        waiting, self._deferred = self._deferred, []
        for req in waiting:
            self._free(req)  # defers again while the step launched ahead holds it

    def _admit(self) -> None:
        while self.ready and len(self.running) < self.max_num_seqs:
            self.running.append(self.ready.pop(0))

    def _close_leases(self, outputs: list[TokenOutput]) -> None:
        rung, expired = self.leases.poll()
        now = self.leases.clock()
        for lease in rung:
            self.num_doorbells_rung += 1
            self.doorbell_wait_s += max(0.0, now - (lease.deadline - self.leases.lease_s))
            req = self._quarantined.pop(lease.request_id, None)
            if req is not None:
                self._free(req)
            elif self.requests[lease.request_id].num_output_tokens:
                self.ready.append(self.requests[lease.request_id])
        for lease in expired:
            self._expire(lease, outputs)

    def _expire(self, lease: Lease, outputs: list[TokenOutput]) -> None:
        req = self._quarantined.pop(lease.request_id, None)
        if req is None:
            req = self.requests.pop(lease.request_id)
            message = (f"lease expired: the KV of request {lease.request_id!r} did not land within "
                       f"{self.leases.lease_s} s (doorbell word {lease.ticket.index} on PE {lease.ticket.pe})")
            logger.warning("%s", message)
            outputs.append(TokenOutput(lease.request_id, None, True, "error", message))
        self._free(req)

    def _plan(self, batch: list[Request]) -> tuple[ForwardPlan, torch.Tensor | list[int]]:
        """This step's plan: the one reserved during the last step if the batch is the same."""
        seq_ids = tuple(r.seq_id for r in batch)
        nxt, self._next = self._next, None
        if nxt is not None and nxt.seq_ids == seq_ids:
            ids = nxt.device_ids if nxt.device_ids is not None else [r.token_ids[-1] for r in batch]
            return nxt.plan, ids
        self._rollback(nxt)
        plan = self.cache.begin_forward(list(seq_ids), [1] * len(batch))
        self.cache.end_forward()
        return plan, [r.token_ids[-1] for r in batch]

    def _reserve_next(self, batch: list[Request]) -> None:
        """While the GPU runs this step: reserve and plan the next one (requests that continue)."""
        cont = [r for r in batch if r.num_output_tokens + 1 < r.params.max_tokens
                and len(r.token_ids) + 1 < self.max_model_len and r.request_id in self.requests]
        if not cont:
            return
        seq_ids = tuple(r.seq_id for r in cont)
        plan = self.cache.begin_forward(list(seq_ids), [1] * len(cont))
        self.cache.end_forward()
        self._next = _NextStep(seq_ids, plan)

    def _rollback_next(self) -> None:
        nxt, self._next = self._next, None
        self._rollback(nxt)

    def _rollback(self, nxt: _NextStep | None) -> None:
        """Give back the speculative slot of every request of ``nxt`` still in the cache."""
        if nxt is None:
            return
        for seq_id in nxt.seq_ids:
            if seq_id in self.cache:
                self.cache.popn(seq_id, 1)
