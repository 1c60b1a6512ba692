"""`EngineCore`: the one step pipeline and request life cycle behind every engine role.

A plain object one process owns (a Ray actor, a test, a script). Prefill, decode and colocated
engines are configurations of it (`prefill.py`, `decode.py`, `colocated.py`), and any instance
holds requests in every state (docs/ARCHITECTURE.md §6):

    local       add(id, prompt, params)         computed here (chunked), decoded here
    pushed      add(id, prompt, params, dest)   computed here, KV pushed layer by layer into
                                                ``dest`` (a decode worker's pages); leaves once
                                                its first token is out and its pushes landed
    received    reserve(id, prompt_len, params) pages reserved for a sender's push; start(id,
                -> dest; start(id, first)       first) once rung, then decoded here

Each `step` is one forward: the scheduler (`scheduler.py`) picks decodes first, then prompt
chunks, under the token and sequence budgets; the runner (`runner.py`) runs the forward (a CUDA
graph replay for pure-decode steps), pushing the layers of pushed prompts through the KV
connector's sender, and samples. While the GPU runs a step the host polls the connector's
receiver (reservations whose KV landed or whose lease expired) and reserves the next
pure-decode step's slots and plan; if after the sync the batch is the same (nobody ended, was
aborted or arrived) the next step reuses that plan and the sampled ids still on the device.
``async_scheduling`` launches that reserved step before this one's tokens are read (a token
sampled after a stop is discarded; pages of requests that end meanwhile are released once no
launched step writes them). When prompts wait to join instead (``async_prompts``), the step
launched ahead is the mixed one: the running decodes, fed this step's sampled ids on the device,
plus the waiting prompts' chunks, as vLLM v1's async scheduling does; a new request then waits
for the step in flight to end on the GPU, not for its tokens to be read and a step scheduled
after it (docs/ARCHITECTURE.md §6).

Prefix caching (``prefix_caching``, `disagg.cache`): a prompt enters the cache forked from its
longest cached prefix (`Scheduler._enter`) and computes only the rest; KV known to be written is
registered (`PagedKVCache.cache_tokens`: prompt chunks as they are computed, the whole request when
it finishes) and stays cached after the request leaves, evicted least recently used when pages
run short. A reservation made with the prompt's ids receives only the positions past the decode
side's cached whole pages (`RecvDest.num_cached_tokens`), and its sender pushes only those.
"""

from __future__ import annotations

import logging
import time
from operator import attrgetter, is_
from typing import Callable, Hashable

import numpy as np
import torch

from disagg import trace
from disagg.cache import PagedKVCache
from disagg.engine.options import EngineOptions
from disagg.engine.request import (PushState, RecvDest, Request, RequestFactory, TokenOutput, check_dest, check_fits,
                                   check_new_request, check_reserve, pages_for)
from disagg.engine.ahead import StepsAhead
from disagg.engine.runner import ModelRunner, PendingTokens
from disagg.engine.scheduler import ScheduledBatch, Scheduler
from disagg.engine.steps import ForwardTimer, InstanceLoad, Launched, NextStep, StepShape, TimedForward, same_requests
from disagg.errors import InvalidArgument, InvalidArgumentType, OutOfPages
from disagg.plan import ForwardPlan
from disagg.sampling import SamplingParams
from disagg.transfer.connector import KVPoll, KVSender
from disagg.transfer.heads import layout_for
from disagg.transfer.registry import open_connector

logger = logging.getLogger(__name__)

_request_id = attrgetter("request_id")


class EngineCore(StepsAhead):
    """Continuous batching of local, pushed and received requests over one paged KV cache.

    Args:
        model: a `disagg.model` Model.
        options: the cache, budgets and step-pipeline switches (`EngineOptions`; every size set).
        heap: this PE's symmetric heap (what `open_heap` returned), or None. With a heap the
            engine's KV connector (`disagg.transfer.registry.open_connector`, by the heap's
            backend) allocates the KV tensor (collective), pushes prompts' KV through its sender
            and holds reservations in its receiver.
        runner: what runs each forward, ``runner(model, kv, options)`` -> an object with
            `ModelRunner`'s ``execute`` and counters (None: a `ModelRunner`; the simulator's
            runs no model: `disagg.cluster.simulate.instance`). One whose ``needs_plan`` is
            False gets ``execute(None, ..., shape=StepShape)`` for a forward that moves no KV.
        connector: a `KVConnector` to use instead of opening one over ``heap`` (the simulator's
            virtual one).
    """

    def __init__(self, model, options: EngineOptions, *, heap=None, runner=None, connector=None) -> None:
        if not isinstance(options, EngineOptions):
            raise InvalidArgumentType(f"options: expected EngineOptions, got {type(options).__name__}",
                                      argument="options")
        options.check_sizes()
        self.options = options
        num_pages, page_size = options.num_pages, options.page_size
        max_num_seqs, max_num_batched_tokens = options.max_num_seqs, options.max_num_batched_tokens
        self.model = model
        self.max_model_len = int(model.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Sides of different tensor parallelism: every PE allocates the widest side's pages, and a
        # rank with fewer heads per page views the same bytes as more pages.
        layout = layout_for(model, options.peer_tensor_parallel, num_pages) if heap is not None else None
        if layout is not None and layout.local_num_pages is not None:
            num_pages = layout.local_num_pages
        self.cache = PagedKVCache(num_pages, page_size, prefix_caching=options.prefix_caching)
        shape, dtype = model.kv_shape(num_pages, page_size), options.kv_dtype or model.dtype
        # The KV transport (None: local requests only): its receiver is built now, its sender on the
        # first pushed prompt (a receive-only instance never needs one).
        self.connector = connector if connector is not None or heap is None else open_connector(
            heap, lease_s=options.lease_s, clock=options.clock, force_segment_puts=options.force_segment_puts,
            verify=options.verify_transfers, group=getattr(model, "tp", None), layout=layout)
        self.kv = (self.connector.alloc_kv(shape, dtype) if self.connector is not None
                   else torch.zeros(shape, dtype=dtype, device=model.device))
        self.receiver = None if self.connector is None else self.connector.receiver
        self._sender: KVSender | None = None
        self.runner = runner(model, self.kv, options) if runner is not None else ModelRunner(
            model, self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            use_cuda_graphs=options.use_cuda_graphs, prompt_graphs=options.prompt_graphs,
            mixed_graphs=options.mixed_graphs, push_after=options.push_after)
        self._needs_plan = getattr(self.runner, "needs_plan", True)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[Hashable, Request] = {}
        self._factory = RequestFactory(tuple(model.config.eos_token_ids))
        self._outputs: list[TokenOutput] = []  # abort notices and the like, returned by the next step
        self.async_scheduling = options.async_scheduling
        self.async_prompts = options.async_prompts
        # Called inside `step` with a readiness poll while a launched forward's ids are on their
        # way (the step loop runs the calls that may run mid-step: `StepLoop.while_gpu_runs`).
        self.on_gpu_wait: Callable[[Callable[[], bool]], None] | None = None
        self._next: NextStep | None = None
        self._inflight: Launched | None = None  # async scheduling: launched, ids not read
        self._deferred: list[Request] = []  # ended requests whose pages a launched step still writes
        self.last_step_shape: StepShape | None = None  # of the forward whose tokens the last step() read
        self.last_step_prompts: tuple = ()  # that forward's prompts' request ids (only while tracing)
        # On the GPU, the forwards the last step() saw end, each with its span there (`ForwardTimer`);
        # None off the GPU, where the step's call times its forward.
        self.timer = ForwardTimer(model.device)
        self.last_step_forwards: list[TimedForward] | None = None
        self.num_reserved_steps = 0  # steps that ran a plan reserved during the step before
        self.num_steps_ahead = 0
        self.num_prompt_steps_ahead = 0  # of those: steps that started waiting prompts
        self.token_bytes = self.kv.element_size() * self.kv.numel() // (num_pages * page_size)
        self.pushed_bytes = 0
        self.push_s = 0.0  # wall time of the forwards that pushed (compute included: it overlaps)
        self.ready: list[Request] = []  # received: landed and started, waiting for a batch slot

    @property
    def running(self) -> list[Request]:
        """Requests decoding here (local, kept and received), oldest first."""
        return self.scheduler.running

    @property
    def num_committed_pages(self) -> int:
        return sum(r.committed_pages for r in self.requests.values() if r.received)

    # ------------------------------------------------------------------ local and pushed requests
    def _add(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams | None,
             dest: RecvDest | None = None) -> None:
        """Queue a request computed here; with ``dest`` its KV is pushed there and it leaves after
        its first token. Raises ValueError/TypeError (nothing changes) on bad input."""
        params = SamplingParams() if params is None else params
        prompt = check_new_request(request_id, prompt_token_ids, params, known=self._known_ids(),
                                   vocab_size=self.model.config.vocab_size, max_model_len=self.max_model_len)
        in_flight = self._sender is not None and self._sender.is_quiescing(request_id)
        if in_flight:  # its abort output must stay unambiguous
            raise InvalidArgument(f"request_id: {request_id!r} was aborted and its pushes may still be in "
                                  f"flight; expected a new id (or this one again after its abort output)",
                                  argument="request_id")
        size = self.cache.page_size
        if dest is not None:
            check_dest(request_id, len(prompt), dest, self.connector)
            if pages_for(len(prompt), size) > self.cache.num_pages:
                raise InvalidArgument(f"prompt_token_ids: request {request_id!r} has {len(prompt)} tokens, more than "
                                      f"this cache holds ({self.cache.num_pages} pages of {size})",
                                      argument="prompt_token_ids")
        else:
            check_fits(request_id, len(prompt), params, max_model_len=self.max_model_len,
                       num_pages=self.cache.num_pages, page_size=size)
        req = self._factory.new(request_id, prompt, params)
        if dest is not None:
            # this rank's receiver (rank i of a tensor-parallel instance sends its heads to rank i)
            req.dest, req.committed_pages = self.connector.local_dest(dest), pages_for(len(prompt), size)
        self.requests[request_id] = req
        self.scheduler.add(req)

    @property
    def sender(self) -> KVSender | None:
        """The connector's sending side (None without a connector), built on first use."""
        if self._sender is None and self.connector is not None:
            self._sender = self.connector.sender
        return self._sender

    def _known_ids(self) -> set:
        """Ids a new request may not take: live ones and open reservations, quarantined ones
        included (an id whose aborted pushes are quiescing gets its own error in `_add`)."""
        return self.requests.keys() | (self.receiver.reserved_ids() if self.receiver is not None else set())

    # ------------------------------------------------------------------ received requests
    def _reserve(self, request_id: Hashable, prompt_len: int, params: SamplingParams | None,
                 prompt_token_ids: list[int] | None = None) -> RecvDest:
        """Reserve pages for a prompt's KV and open its reservation (see `DecodeEngine.reserve`)."""
        if self.receiver is None:
            raise InvalidArgument(f"reserve: request {request_id!r}: this engine has no symmetric heap, so no "
                                  f"sender can push into it", argument="reserve")
        params = SamplingParams() if params is None else params
        check_reserve(request_id, prompt_len, params, prompt_token_ids, known=self._known_ids(),
                      vocab_size=self.model.config.vocab_size, max_model_len=self.max_model_len,
                      num_pages=self.cache.num_pages, page_size=self.cache.page_size)
        prompt = None if prompt_token_ids is None else [int(t) for t in prompt_token_ids]
        size = self.cache.page_size
        total = pages_for(min(prompt_len + params.max_tokens, self.max_model_len), size)
        match, need = self.scheduler.match_received(prompt, total)
        hit = match.num_tokens if match is not None else 0
        free = self.scheduler.free_pages()
        if need > free:
            raise OutOfPages(f"reserve: request {request_id!r} needs {need} pages (prompt {prompt_len} + "
                             f"max_tokens {params.max_tokens}, {hit} tokens cached); {free} are free and not "
                             f"committed", num_needed=need, num_free=free)
        req = self._factory.new(request_id, [0] * prompt_len if prompt is None else prompt, params)
        self.cache.add_sequence(req.seq_id, prefix=match)
        try:
            cmap = self.cache.disagg_prepare_recv(req.seq_id, prompt_len - hit)
            self.cache.end_forward()
            dest = self.receiver.reserve(request_id, cmap, num_cached_tokens=hit)
        except BaseException:
            self.cache.remove_sequence(req.seq_id)
            raise
        req.receive(prompt_len, hit, committed_pages=total, prompt_known=prompt is not None)
        self.scheduler.commit(req)
        self.requests[request_id] = req
        return dest

    def _start(self, request_id: Hashable, first_token_id: int) -> None:
        """Hand a received request its first token (see `DecodeEngine.start`)."""
        req = self.requests.get(request_id)
        if req is None or not req.received:
            raise InvalidArgument(f"request_id: {request_id!r} has no reservation here; call reserve first",
                                  argument="request_id")
        if req.num_output_tokens:
            raise InvalidArgument(f"request_id: {request_id!r} was already started", argument="request_id")
        vocab = self.model.config.vocab_size
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, (int, np.integer)):
            raise InvalidArgumentType(f"first_token_id: expected an int, got {type(first_token_id).__name__}",
                                      argument="first_token_id")
        if not 0 <= first_token_id < vocab:
            raise InvalidArgument(f"first_token_id: expected an id in [0, {vocab}), got {first_token_id}",
                                  argument="first_token_id")
        if req.append(int(first_token_id), self.max_model_len).finished:
            self._drop(req)
        elif request_id not in self.receiver:  # landed already
            self.ready.append(req)

    def _cancel_reservation(self, dest: RecvDest) -> None:
        """Free a reservation no sender will write (see `DecodeEngine.cancel_reservation`)."""
        if not isinstance(dest, RecvDest):
            raise InvalidArgumentType(f"dest: expected the RecvDest from reserve, got {type(dest).__name__}",
                                      argument="dest")
        request_id = dest.request_id
        if self.receiver is None or request_id not in self.receiver:
            if request_id in self.requests:
                raise InvalidArgument(f"dest: the doorbell of request {request_id!r} has rung (its KV landed); "
                                      f"expected a reservation still waiting for it: call abort({request_id!r})",
                                      argument="dest")
            raise InvalidArgument(f"dest: request {request_id!r} has no open reservation here (unknown, or freed "
                                  f"already by its ring, lease expiry or an earlier cancel)", argument="dest")
        req = self.receiver.cancel(dest)  # the quarantined request, or None (raises: another reservation's)
        if req is None:
            req = self.requests.pop(request_id)
            if req in self.ready:
                self.ready.remove(req)
            self._outputs.append(TokenOutput(request_id, None, True, "abort"))
        self._release_when_safe(req)

    def _poll_reservations(self, outputs: list[TokenOutput]) -> None:
        """Closed reservations: landed and started ones get ready to decode; expired ones fail;
        quarantined ones (aborted meanwhile) free their pages either way."""
        if self.receiver is None or not len(self.receiver):
            return
        for closed in self.receiver.poll():
            if closed.handle is not None:  # quarantined: only its pages waited
                self._release_when_safe(closed.handle)
            elif closed.state is KVPoll.LANDED:
                req = self.requests[closed.request_id]
                if req.num_output_tokens:
                    self.ready.append(req)
            else:
                req = self.requests.pop(closed.request_id)
                logger.warning("%s", closed.reason)
                outputs.append(TokenOutput(closed.request_id, None, True, "error", closed.reason))
                self._release_when_safe(req)

    def _admit_ready(self) -> None:
        """Rung and started requests join the running batch while there is room."""
        while self.ready and len(self.running) < self.max_num_seqs:
            req = self.ready.pop(0)
            req.start_decoding()
            self.running.append(req)

    def _all_live(self, reqs: list[Request]) -> bool:
        """Each of ``reqs`` is still this engine's (none aborted or ended since, its id then free)."""
        return all(map(is_, map(self.requests.get, map(_request_id, reqs)), reqs))

    def _joining(self) -> bool:
        """Someone waits to join the next step (so it will not be this step's batch again)."""
        return bool(self.scheduler.waiting) or bool(self.ready and len(self.running) < self.max_num_seqs)

    # ------------------------------------------------------------------ ending requests
    def _abort(self, request_id: Hashable) -> PushState | None:
        """Drop a request (the caller's answer per role); None when unknown.

        A pushed prompt in the cache stops pushing; its answer says whether a push may still land
        (`PushState`); the ``"abort"`` output comes now (QUIESCED) or from the step that sees its
        pushes complete (IN_FLIGHT). Every other request answers QUIESCED and ends with an
        ``"abort"`` output in the next step; a received one whose KV may still land is
        quarantined (pages kept until the ring, the lease expiry or `cancel_reservation`).
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.dest is not None:
            return self._abort_pushed(req)
        self._drop(req)
        self._outputs.append(TokenOutput(request_id, None, True, "abort"))
        return PushState.QUIESCED

    def _abort_pushed(self, req: Request) -> PushState:
        del self.requests[req.request_id]
        sending = req.sending  # (read before its pages go: that leaves the state)
        pushed = sending and req.num_computed > req.num_cached_tokens  # some forward pushed part of it
        self.scheduler.remove(req, release=False)
        self._release_when_safe(req)
        state = self.sender.abort(req.request_id, req.seq_id, pushed=pushed) if sending else PushState.QUIESCED
        if state is PushState.QUIESCED:
            self._outputs.append(TokenOutput(req.request_id, None, True, "abort"))
        return state

    def _poll_aborted(self, outputs: list[TokenOutput]) -> None:
        """Report the IN_FLIGHT aborts whose pushes have completed since the last step."""
        if self._sender is not None:
            outputs.extend(TokenOutput(rid, None, True, "abort") for rid in self._sender.poll_aborted())

    def _drop(self, req: Request) -> None:
        """Forget ``req``; free its pages now, once no launched step writes them, or (received,
        KV maybe in flight) once its lease closes. A finished request's KV stays in the prefix
        cache (not an aborted one's, nor a reservation's whose KV may not have landed)."""
        landing = self.receiver is not None and req.request_id in self.receiver  # its KV may be in flight
        if (req.finish_reason in ("stop", "length") and self.cache.prefix_caching and req.in_cache
                and req.prompt_known and not landing):
            self.cache.cache_tokens(req.seq_id, req.token_ids[:req.num_computed])
        del self.requests[req.request_id]
        if req in self.ready:
            self.ready.remove(req)
        self.scheduler.remove(req, release=False)
        if landing:
            self.scheduler.withdraw_promise(req)  # it will not decode: only the pages it holds stay taken
            self.receiver.quarantine(req.request_id, req)
        else:
            self._release_when_safe(req)

    def _leave_after_push(self, req: Request, push_done: torch.cuda.Event | None) -> None:
        """A pushed prompt is complete: it leaves; its pages go once its pushes have landed."""
        del self.requests[req.request_id]
        self.scheduler.remove(req, release=False)
        self.sender.retire(req, push_done)

    def _drain(self) -> None:
        """Free the pages of completed pushed prompts whose pushes and completion signal are done."""
        if self._sender is not None:
            for req in self._sender.poll_retired():
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

    # ------------------------------------------------------------------ queries
    def has_work(self) -> bool:
        sender = self._sender
        return bool(self.scheduler.has_work() or self._outputs or self._inflight is not None or self._deferred
                    or self.ready or (self.receiver is not None and len(self.receiver))
                    or (sender is not None and (sender.num_retiring or sender.num_quiescing)))

    def load(self) -> InstanceLoad:
        """Pages and batch now, as the router sees them."""
        return InstanceLoad(self.scheduler.free_pages(), self.cache.num_pages, len(self.running),
                            len(self.scheduler.waiting))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (`PagedKVCache.reset_prefix_cache`: running requests and
        their pages untouched); returns the pages freed. `disagg bench` calls it before each
        measured run, so no run hits on the prompts of the one before."""
        return self.cache.reset_prefix_cache()

    def _core_stats(self) -> dict:
        return {"free_pages": self.cache.num_free_pages, "total_pages": self.cache.num_pages,
                "running": len(self.running), "waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions, "num_forwards": self.runner.num_forwards,
                "num_graph_replays": self.runner.num_graph_replays,
                "num_prompt_graph_replays": self.runner.num_prompt_graph_replays,
                "num_mixed_graph_replays": self.runner.num_mixed_graph_replays,
                "num_pushes_after": self.runner.num_pushes_after,
                "num_reserved_steps": self.num_reserved_steps, "num_steps_ahead": self.num_steps_ahead,
                "num_prompt_steps_ahead": self.num_prompt_steps_ahead,
                **self.cache.prefix_stats()}

    def _warmup(self, *, prompt_len: int | None, decode: bool, max_kv_len: int | None) -> dict[str, float]:
        """Compile the kernels (and capture the decode graphs) while idle: see `ModelRunner.warmup`."""
        if self.requests or (self.receiver is not None and len(self.receiver)):
            raise RuntimeError("warmup: the engine has requests; call it before the first one")
        self._take_reserved()  # a step reserved before the last request ended: nothing to keep
        return self.runner.warmup(self.cache, prompt_len=prompt_len or 1, prefill=prompt_len is not None,
                                  decode=decode, max_kv_len=max_kv_len)

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenOutput]:
        """Run one forward (if there is work); return this step's outputs."""
        outputs, self._outputs = self._outputs, []
        self.last_step_shape, self.last_step_prompts = None, ()
        self.last_step_forwards = self.timer.done() if self.timer.enabled else None
        self._poll_aborted(outputs)
        self._drain()
        current, self._inflight = self._inflight, None
        polled = current is None
        if current is None:
            current = self._launch_next(outputs)
            if current is None:
                return outputs
            self._poll_reservations(outputs)  # while the GPU runs this step
            self._reserve_next(current.requests)
        if self.async_scheduling:
            self._inflight = self._launch_ahead(current)
        if self.on_gpu_wait is not None:  # while the GPU computes: the host runs what may run now
            self.on_gpu_wait(current.pending.is_ready)
        tokens = current.pending.result()
        self.last_step_shape, self.last_step_prompts = current.shape, current.prompt_ids
        if self.timer.enabled:
            self.last_step_forwards += self.timer.done()
        if current.num_pushed_tokens:
            self.push_s += time.perf_counter() - current.start_s
            self.pushed_bytes += current.num_pushed_tokens * self.token_bytes
        requests, max_model_len = self.requests, self.max_model_len
        for req, token in zip(current.sampled, tokens):
            if requests.get(req.request_id) is not req:
                continue  # aborted, or ended on the previous token, since this step's launch
            out = req.append(token, max_model_len)
            outputs.append(out)
            if not req.decoding:  # its prompt (or a preempted request's recompute) is computed
                if req.num_output_tokens == 1:
                    trace.event("first_emit", req.request_id)
                if req.dest is not None:
                    self._leave_after_push(req, current.pending.push_done)
                    continue
                self.scheduler.finish_prompt(req)
            if out.finished:
                self._drop(req)
        self._release_deferred()
        self._drain()
        ahead = self._inflight
        if ahead is not None:
            if not polled:
                self._poll_reservations(outputs)  # while the step launched ahead runs
            self._reserve_next([r for r in ahead.sampled if requests.get(r.request_id) is r])
        elif self._next is not None and same_requests(self._next.requests, current.sampled):
            self._next.device_ids = current.pending.device_tokens  # row i is request i's next input
        return outputs

    def _launch_next(self, outputs: list[TokenOutput]) -> Launched | None:
        """Launch the reserved step if it is still what the scheduler would pick, else schedule
        (None when nothing runs, even after polling the doorbells)."""
        self._admit_ready()
        reserved = self._take_reserved()
        if reserved is not None:
            self.num_reserved_steps += 1
            return self._launch_reserved(reserved, reserved.device_ids, step_offset=0)
        batch = self.scheduler.schedule()
        if not batch and self.receiver is not None and len(self.receiver):
            self._poll_reservations(outputs)
            self._admit_ready()
            batch = self.scheduler.schedule()
        return self._launch(batch) if batch else None

    def _launch(self, batch: ScheduledBatch, device_ids: torch.Tensor | None = None) -> Launched:
        """Launch one forward over ``batch`` (the scheduler's); pushed prompts push their layers.
        ``device_ids``: the ids of the batch's first k requests (decodes of the step in flight,
        which samples them), on the device."""
        reqs, counts = batch.requests, batch.num_tokens
        k = 0 if device_ids is None else int(device_ids.shape[0])
        for req in reqs:
            if req.dest is not None and not req.sending:  # entered the cache for this forward
                self.cache.disagg_mark_send(req.seq_id, req.dest.num_cached_tokens, req.dest.cmap, req.dest.pe)
                self.sender.attach(req.seq_id, req.dest)
                req.start_sending()
        tokens: list[int] = []
        for r, n in zip(reqs[k:], counts[k:]):
            tokens += r.token_ids[r.num_computed: r.num_computed + n]
        ids = np.array(tokens, dtype=np.int64)
        # (the first k decode rows compute the token the step in flight samples: not appended yet)
        rows = [i for i, (r, n) in enumerate(zip(reqs, counts)) if i < k or r.num_computed + n == len(r.token_ids)]
        sampled = [reqs[i] for i in rows]
        shape = StepShape.of(reqs, counts)
        prompt_ids: tuple = ()
        if trace.enabled():  # off: no walk over the batch on this path
            prompt_ids = tuple(r.request_id for r in reqs if not r.decoding)
            for r in reqs:
                if not r.decoding and r.num_computed == r.num_cached_tokens:  # its first prompt chunk
                    trace.event("prompt_start", r.request_id, cached=r.num_cached_tokens)
        start = time.perf_counter()
        seq_ids = [r.seq_id for r in reqs]
        plan = self._begin_forward(seq_ids, counts)
        num_pushed = 0 if plan is None else int(np.count_nonzero(plan.push_slots >= 0)) + len(plan.copy_remote_slots)
        timed = self.timer.begin()
        try:
            offsets = [1 if i < k else 0 for i in rows] if k else 0  # their tokens: not appended yet
            pending = self._execute(plan, shape, ids, np.asarray(rows, dtype=np.int64), sampled,
                                    sender=self.sender if plan is not None and plan.has_transfers else None,
                                    step_offset=offsets, device_prefix=device_ids)
        finally:
            if plan is not None:
                self.cache.end_forward()
        self.timer.end(timed, shape, prompt_ids)
        prefix_caching = self.cache.prefix_caching
        for r, n in zip(reqs, counts):
            r.num_computed += n
            if prefix_caching and not r.decoding:  # a prompt chunk: its KV is written
                self.cache.cache_tokens(r.seq_id, r.token_ids[:r.num_computed])
        return Launched(reqs, sampled, pending, frozenset(seq_ids), num_pushed, start, shape, prompt_ids)

    def _begin_forward(self, seq_ids: list[int], counts: list[int]) -> ForwardPlan | None:
        """Reserve a forward's slots: `PagedKVCache.begin_forward`'s plan (the forward left open),
        or None (the same pages taken, nothing left open: `append_without_plan`) for a runner that
        runs without plans (`ModelRunner.needs_plan`) while no KV is sent (a plan lists the sends)."""
        if self._needs_plan or self.cache.has_sends:
            return self.cache.begin_forward(seq_ids, counts)
        self.cache.append_without_plan(seq_ids, counts)
        return None

    def _execute(self, plan: ForwardPlan | None, shape: StepShape, *args, **kwargs) -> PendingTokens:
        """`runner.execute` of a forward: with its plan, or (None) with its shape instead."""
        if plan is None:
            return self.runner.execute(None, *args, shape=shape, **kwargs)
        return self.runner.execute(plan, *args, **kwargs)
