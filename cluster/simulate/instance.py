"""One simulated instance: the real engine scheduler over real page tables, with no model.

`SimEngine` keeps the engine's request life cycle (`disagg.engine.core.EngineCore`,
docs/ARCHITECTURE.md §6) for the three kinds of request an instance holds, local, pushed and
received, with the same objects: `Request`s from a `RequestFactory`, the `Scheduler` that picks
every forward (decodes first, then prompt chunks, page budget, preemption by recompute,
committed pages) and a `PagedKVCache` whose pages each forward really takes
(`append_without_plan`: `begin_forward`'s reservation, no plan).
What it does not have is a model: a step's duration is the profile's `StepTimeModel` of the
step's `StepShape`, and sampled tokens are 0 (requests run to ``max_tokens``, EOS ignored, as
the bench's workloads do). A step is split in two at the virtual clock: `begin_step` schedules
and takes the pages (the launch), `finish_step` appends the tokens (after the forward's time),
as the engine does around its forward. With ``async_scheduling`` a pure-decode step of every
running request, with nobody waiting, is followed by the same batch launched ahead (the
engine's `_launch_ahead`): requests that arrive meanwhile join the step after it, so the next
step is scheduled with the queue hidden.

Prefix caching (``prefix_caching``, the engine's): the cache is the engine's `PagedKVCache` with
its prefix cache (page keys, LRU eviction) and requests carry their prompts' real ids, so a
waiting prompt enters forked from its longest cached prefix in the real `Scheduler._enter` and
only the rest is computed (and timed: the cached tokens stay its attention context); each
forward registers the prompt chunks it computed and a finished request its tokens, where
`EngineCore` does (`cache_tokens`). A reservation forks the decode side's cached whole pages
(`Scheduler.match_received`, the engine's `_reserve`), and its sender pushes only what follows
them. Used by `fleet.py` only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Hashable

from disagg.cache import PagedKVCache
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.engine.request import Request, RequestFactory, pages_for
from disagg.engine.scheduler import ScheduledBatch, Scheduler
from disagg.engine.steps import InstanceLoad, StepShape
from disagg.sampling import SamplingParams


@dataclass(frozen=True)
class SimDest:
    """`Request.dest` of a prompt whose KV is pushed (the engine's `RecvDest`; no heap here).

    Attributes:
        num_cached_tokens: prompt tokens the decode side already holds (its prefix cache, whole
            pages): not pushed.
    """

    num_cached_tokens: int = 0


@dataclass
class SimStep:
    """One launched forward: its rows, the rows sampled at its end, its shape and duration."""

    requests: list[Request]
    num_tokens: list[int]
    sampled: list[Request]
    shape: StepShape
    seconds: float
    num_pushed_tokens: int
    durations: list[float] = field(default_factory=list)  # per forward: more than one when fused
    end_times: list[float] = field(default_factory=list)  # per forward, on the fleet's clock

    @property
    def num_forwards(self) -> int:
        return len(self.durations)


class SimEngine:
    """A model-less engine of one instance (module docstring).

    Args:
        model: the step-time model (a profile's fit).
        num_pages, page_size: the KV cache.
        max_num_seqs, max_num_batched_tokens: the scheduler's budgets.
        max_model_len: the context limit.
        async_scheduling: the engine's step launched ahead (module docstring).
        prefix_caching: the engine's automatic prefix caching (module docstring).
    """

    def __init__(self, model: StepTimeModel, *, num_pages: int, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, async_scheduling: bool = False,
                 prefix_caching: bool = False) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.cache = PagedKVCache(num_pages, page_size, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[Hashable, Request] = {}
        self.ready: list[Request] = []  # received, started, waiting for a batch slot
        self._factory = RequestFactory(())
        self.current: SimStep | None = None  # the forward running now
        self.async_scheduling = async_scheduling
        self.step_gap_s = 0.0  # host time between two forwards (the served trace's step gap), added to each
        self._ahead = False  # the next step was launched with the last one (async scheduling)
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_pushed_tokens = 0  # KV tokens this instance pushed (the engine's pushed_bytes / token)
        self.min_free_pages = self.scheduler.free_pages()
        self.step_log: list[StepShape] | None = None  # shapes, when a test asks for them

    # ------------------------------------------------------------------ requests
    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether the request could ever fit this cache alone (the engine's `check_fits`)."""
        return pages_for(min(prompt_len + max_tokens, self.max_model_len), self.cache.page_size) <= self.cache.num_pages

    def add(self, request_id: Hashable, prompt_token_ids: list[int], max_tokens: int,
            dest: SimDest | None = None) -> None:
        """Queue a local request, or (``dest``) a prompt whose KV goes to a decode instance."""
        req = self._new(request_id, prompt_token_ids, max_tokens)
        if dest is not None:
            req.dest, req.committed_pages = dest, pages_for(len(prompt_token_ids), self.cache.page_size)
        self.scheduler.add(req)

    def reserve(self, request_id: Hashable, prompt_token_ids: list[int], max_tokens: int) -> SimDest | None:
        """Reserve pages for a pushed prompt and the whole answer, forked from the cached whole
        pages of its prompt (the engine's `_reserve`): where its sender pushes; None when the free,
        unpromised pages are too few (the engine's OutOfPages)."""
        prompt_len = len(prompt_token_ids)
        total = pages_for(min(prompt_len + max_tokens, self.max_model_len), self.cache.page_size)
        match, need = self.scheduler.match_received(prompt_token_ids, total)
        if need > self.scheduler.free_pages():
            return None
        hit = match.num_tokens
        req = self._new(request_id, prompt_token_ids, max_tokens)
        self.cache.add_sequence(req.seq_id, prefix=match)
        self.cache.disagg_prepare_recv(req.seq_id, prompt_len - hit)
        self.cache.end_forward()
        req.receive(prompt_len, hit, committed_pages=total, prompt_known=True)
        self.scheduler.commit(req)
        return SimDest(hit)

    def start(self, request_id: Hashable) -> bool:
        """The prompt's KV landed and its first token came (the engine's `_start` after the ring):
        it decodes here from the next step. True when that token already ended it."""
        req = self.requests[request_id]
        if req.append(0, self.max_model_len).finished:
            self._drop(req)
            return True
        self.ready.append(req)
        return False

    def release_pushed(self, req: Request) -> None:
        """A pushed prompt's pushes have landed: its pages go (the engine's `_drain`)."""
        self.scheduler.release(req)

    def _new(self, request_id: Hashable, prompt_token_ids: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = self._factory.new(request_id, list(prompt_token_ids), params)
        self.requests[request_id] = req
        return req

    def _drop(self, req: Request) -> None:
        """A request ended: its computed tokens stay in the prefix cache (the engine's `_drop`)."""
        if self.cache.prefix_caching and req.in_cache:
            self.cache.cache_tokens(req.seq_id, req.token_ids[:req.num_computed])
        del self.requests[req.request_id]
        self.scheduler.remove(req)

    # ------------------------------------------------------------------ steps
    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self.ready)

    def begin_step(self) -> SimStep | None:
        """Schedule and launch the next forward (its pages taken); None when nothing can run."""
        batch = self._launched_ahead() if self._ahead else None
        if batch is None:
            while self.ready and len(self.scheduler.running) < self.max_num_seqs:  # the engine's _admit_ready
                req = self.ready.pop(0)
                req.start_decoding()
                self.scheduler.running.append(req)
            batch = self.scheduler.schedule()
        if not batch:
            return None
        reqs, counts = batch.requests, batch.num_tokens
        shape = StepShape.of(reqs, counts)
        pushed = sum(_pushed_tokens(r, n) for r, n in zip(reqs, counts) if r.dest is not None)
        self.cache.append_without_plan([r.seq_id for r in reqs], counts)
        for req, n in zip(reqs, counts):
            req.num_computed += n
            if not req.decoding and self.cache.prefix_caching:  # a prompt chunk: its KV is written
                self.cache.cache_tokens(req.seq_id, req.token_ids[:req.num_computed])
        self._ahead = self.async_scheduling and self._will_launch_ahead(batch)
        sampled = [r for r in reqs if r.num_computed == len(r.token_ids)]
        self.num_pushed_tokens += pushed
        seconds = self._forward_s(shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_context_tokens,
                                  shape.num_prompt_pairs)
        self.min_free_pages = min(self.min_free_pages, self.scheduler.free_pages(), self.cache.num_free_pages)
        if self.step_log is not None:
            self.step_log.append(shape)
        self.current = SimStep(list(reqs), list(counts), sampled, shape, seconds, pushed, [seconds])
        self.num_steps += 1
        self.busy_s += seconds - self.step_gap_s
        return self.current

    def _forward_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
                   num_prompt_pairs: int) -> float:
        """How long a forward holds this instance: the model's time, then the gap to the next one."""
        return max(self.model.step_s(num_prefill_tokens, num_decode_seqs, num_context_tokens, num_prompt_pairs),
                   1e-6) + self.step_gap_s

    def fuse(self, start: float, horizon: float) -> None:
        """Run on the launched forward the pure-decode forwards that surely follow it, while each
        ends before ``horizon`` (no event can change them: the fleet's next event).

        Those forwards are what the scheduler would pick (every running request decodes, nobody
        waits, none ends before the last, their pages are free, so nobody is preempted): as the
        engine replays a reserved step without scheduling, their pages and tokens are taken in
        bulk. The last one's tokens come with `finish_step`; the durations are the model's, step
        by step, and their end times accumulate as the clock's would.
        """
        step, running = self.current, self.scheduler.running
        reqs = step.requests
        if (step.shape.num_prefill_tokens or step.num_pushed_tokens or self.scheduler.waiting or self.ready
                or len(reqs) != len(running) or any(not r.decoding for r in reqs)):
            return
        limit = min(min(r.params.max_tokens - r.num_output_tokens, self.max_model_len - len(r.token_ids))
                    for r in reqs) - 1  # the forward, after this one, whose token ends someone
        n, context = len(reqs), step.shape.num_context_tokens
        size, free = self.cache.page_size, self.scheduler.free_pages()
        lengths = [self.cache.seq_length(r.seq_id) for r in reqs if not r.committed_pages]
        end, extra = start + step.seconds, 0
        while extra < limit:
            context += n
            seconds = self._forward_s(0, n, context, 0)
            need = sum(pages_for(length + extra + 1, size) - pages_for(length, size) for length in lengths)
            if end + seconds >= horizon or need > free:
                break
            extra += 1
            end += seconds
            step.durations.append(seconds)
            if self.step_log is not None:
                self.step_log.append(StepShape(0, n, context, 0))
        if not extra:
            return
        for req in reqs:  # the tokens of every forward but the last, then the forwards' pages
            req.token_ids.extend([0] * extra)
            req.num_computed += extra
        self.cache.append_without_plan([r.seq_id for r in reqs], [extra] * n)
        step.seconds = sum(step.durations)
        self.busy_s += step.seconds - step.durations[0] - extra * self.step_gap_s
        self.num_steps += extra
        self.min_free_pages = min(self.min_free_pages, self.scheduler.free_pages(), self.cache.num_free_pages)
        self._ahead = self.async_scheduling and self._will_launch_ahead(ScheduledBatch(reqs, [1] * n))

    def _will_launch_ahead(self, batch) -> bool:
        """The engine launches the same batch ahead (`_reserve_next` + `_launch_ahead`, called once
        this batch's pages are taken): a pure decode of every running request, nobody waiting to
        join, none at its length limit, and the pages of one more token free."""
        running = self.scheduler.running
        if (not batch or len(batch) != len(running) or self.scheduler.waiting or self.ready
                or any(r is not q for r, q in zip(batch.requests, running))
                or any(r.num_output_tokens + 1 >= r.params.max_tokens
                       or len(r.token_ids) + 1 >= self.max_model_len for r in running)):
            return False
        size = self.cache.page_size
        lengths = [self.cache.seq_length(r.seq_id) for r in running if not r.committed_pages]
        return sum(pages_for(n + 1, size) - pages_for(n, size) for n in lengths) <= self.scheduler.free_pages()

    def _launched_ahead(self):
        """The step launched with the last one: the scheduler's pick with the queue hidden (the
        arrivals since came after its launch); None when its batch changed (someone ended)."""
        waiting, self.scheduler.waiting = self.scheduler.waiting, collections.deque()
        try:
            batch = self.scheduler.schedule()
        finally:
            self.scheduler.waiting = waiting
        return batch if batch and all(r.decoding for r in batch.requests) else None

    def finish_step(self) -> list[tuple[Request, bool, int]]:
        """End the running forward (forwards, when fused): append its sampled tokens. Returns
        ``(request, finished, tokens)`` per sampled request (tokens: one per forward run); a
        pushed prompt's first token ends its stay here (its pages wait for its pushes:
        `release_pushed`)."""
        step, self.current = self.current, None
        out = []
        for req in step.sampled:
            finished = req.append(0, self.max_model_len).finished
            out.append((req, finished, step.num_forwards))
            if req.dest is not None:
                del self.requests[req.request_id]
                self.scheduler.remove(req, release=False)
                continue
            if not req.decoding:
                self.scheduler.finish_prompt(req)
            if finished:
                self._drop(req)
        return out

    def load(self) -> InstanceLoad:
        return InstanceLoad(self.scheduler.free_pages(), self.cache.num_pages, len(self.scheduler.running),
                            len(self.scheduler.waiting))

    def stats(self) -> dict:
        """The engine's prefix-cache counters (`PagedKVCache.prefix_stats`) and the KV it pushed,
        in tokens (the engine's ``pushed_bytes`` over its bytes per token)."""
        return {**self.cache.prefix_stats(), "num_pushed_tokens": self.num_pushed_tokens}


def _pushed_tokens(req: Request, num_tokens: int) -> int:
    """KV tokens a forward computing ``num_tokens`` of the pushed prompt ``req`` sends (taken
    before its ``num_computed`` advances): the positions from the decode side's cached prefix on
    (``dest.num_cached_tokens``). Its first forward also sends what it found in its own cache
    past that prefix, page to page (the engine's `disagg_mark_send` when it enters a forward):

        [0 .... decode hit | .... prefill hit (cached here) | computed by this forward ....]
                           ^ first forward: sent from here  ^ later forwards: from here
    """
    begin = req.dest.num_cached_tokens
    start = begin if not req.sending else max(req.num_computed, begin)
    if not req.sending:
        req.start_sending()
    return max(0, req.num_computed + num_tokens - start)
