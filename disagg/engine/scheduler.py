"""The scheduler of every engine: which requests compute how many tokens in the next forward.

Owned by `EngineCore` (one per engine process, any role). Continuous batching with chunked prefill,
in vLLM v1's terms: every request has tokens to compute (a whole prompt, the rest of a chunked
prompt, or the one token of a decode); a step takes decodes first (one token each, oldest
first), then prompt chunks in arrival order, under ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences, all in ONE forward. Pages: a decode that needs a page and finds none
preempts the newest running request (recompute: its pages are freed and it goes back to the
front of the queue, its generated tokens appended to what it recomputes); a chunk takes only the
tokens that fit in the free pages. When nothing at all fits, partially computed prompts at the
back give their pages to the head of the queue. `add` refuses a request that could never fit the
cache alone, so the queue always makes progress and running out of pages is never a crash.

Committed requests (`Request.committed_pages` > 0) hold a promise of pages for their whole stay:
a prompt pushed to a decode worker (its whole prompt, so a started push never waits for pages)
and a request whose KV was received (prompt + max_tokens, so a decode never waits either). The
pages promised but not yet taken are kept out of everyone else's budget (`outstanding_pages`);
committed requests are never preempted and draw their pages from their own promise. A pushed
prompt enters the cache only when its whole promise fits, in arrival order.

With prefix caching a waiting request enters the cache forked from its longest cached prefix
(`_enter`), whose tokens then count as computed, when the pages the fork pins fit the budget;
otherwise it enters empty and its reservation evicts cached pages like any other.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass

from disagg.cache import PagedKVCache
from disagg.engine.request import Request, pages_for
from disagg.prefix_index import PrefixMatch

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What the next forward computes: ``num_tokens[i]`` tokens of ``requests[i]`` (decodes first)."""

    requests: list[Request]
    num_tokens: list[int]
    total_tokens: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    def append(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_tokens.append(n)
        self.total_tokens += n


class Scheduler:
    """Queues and page budget of a colocated engine.

    Args:
        cache: the engine's page tables (sequence ids are `Request.seq_id`).
        max_num_seqs: sequences per forward.
        max_num_batched_tokens: tokens per forward.
    """

    def __init__(self, cache: PagedKVCache, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.committed: dict[int, Request] = {}  # seq id -> committed request in the cache
        self.num_preemptions = 0
        self._outstanding: tuple[int, int] | None = None  # (cache version, pages) of the last count

    def commit(self, req: Request) -> None:
        """Count ``req`` (in the cache, ``committed_pages`` set) against everyone else's pages."""
        assert req.in_cache and req.committed_pages > 0, "commit: a committed request is in the cache"
        self.committed[req.seq_id] = req
        self._outstanding = None

    def withdraw_promise(self, req: Request) -> None:
        """``req`` will not decode here: it keeps the pages it holds and draws no more."""
        req.committed_pages = 0
        self._outstanding = None

    def outstanding_pages(self) -> int:
        """Pages promised to committed requests and not yet taken by them. Counted once per
        state of the cache (`PagedKVCache.version`) and of the promises: a decode instance's
        steps, reservations and load reports read it several times in between, and the count
        walks every committed request (hundreds on a busy decode instance)."""
        version = self.cache.version
        if self._outstanding is None or self._outstanding[0] != version:
            size = self.cache.page_size
            lengths = self.cache.seq_lengths(self.committed)
            # promise less pages held (`pages_for` inlined: this walks every committed request)
            pages = sum(max(0, r.committed_pages + (-n // size)) for r, n in zip(self.committed.values(), lengths))
            self._outstanding = (version, pages)
        return self._outstanding[1]

    def free_pages(self) -> int:
        """Free pages that no committed request has been promised."""
        return self.cache.num_free_pages - self.outstanding_pages()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request, release: bool = True) -> None:
        """Forget ``req`` (finished or aborted) and free its pages (``release=False``: the caller
        frees them later with `release`, once no launched forward writes them)."""
        if req.decoding:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if release:
            self._release(req)

    def release(self, req: Request) -> None:
        """Free the pages of a request `remove` kept them for."""
        self._release(req)

    def schedule(self) -> ScheduledBatch:
        """Pick the next forward's batch (possibly empty only when there is no work)."""
        batch = ScheduledBatch([], [])
        free = self._schedule_decodes(batch, self.free_pages())
        self._schedule_chunks(batch, free)
        if not batch and self.waiting and self._free_pages_for_head():
            self._schedule_chunks(batch, self.free_pages())
        return batch

    def schedule_behind(self, decodes: list[Request]) -> ScheduledBatch | None:
        """The batch of a step launched behind the one in flight: ``decodes`` (every running
        request, each at the token that step samples) one token each, then waiting prompts' chunks
        as `schedule` takes them. None, with nothing preempted, when a decode's page does not fit
        or no prompt chunk joins (the step is then scheduled as usual once the tokens are read)."""
        batch = ScheduledBatch([], [])
        free = self.free_pages()
        for req in decodes:
            if not req.committed_pages:
                need = self._pages_needed(req, 1)
                if need > free:
                    return None
                free -= need
            batch.append(req, 1)
        if len(batch) >= self.max_num_seqs:
            return None
        self._schedule_chunks(batch, free)
        return batch if len(batch) > len(decodes) else None

    def match_received(self, prompt_token_ids: list[int] | None, num_pages: int) -> tuple[PrefixMatch | None, int]:
        """The cached prefix a received request forks and the pages its reservation takes.

        Args:
            prompt_token_ids: the prompt (None: unknown, so nothing is matched).
            num_pages: the pages it is promised for its whole stay (prompt + max_tokens).

        Returns:
            ``(match, num_pages_needed)``: the longest cached prefix of whole pages
            (`PagedKVCache.match_prefix` page aligned: the sender writes whole pages after it),
            or None; and the pages of `free_pages` the reservation takes (its promise less the
            shared pages, plus the cached ones the fork pins).
        """
        if prompt_token_ids is None:
            return None, num_pages
        match = self.cache.match_prefix(prompt_token_ids, page_aligned=True)
        return match, num_pages - match.num_tokens // self.cache.page_size + match.num_pages

    def finish_prompt(self, req: Request) -> None:
        """``req`` sampled its first token after (re)computing its prompt: it decodes from now on."""
        self.waiting.remove(req)
        self.running.append(req)
        req.start_decoding()

    # ------------------------------------------------------------------ internals
    def _schedule_decodes(self, batch: ScheduledBatch, free: int) -> int:
        i = 0
        while i < len(self.running) and len(batch) < self.max_num_seqs and self._budget(batch) > 0:
            req = self.running[i]
            if req.committed_pages:  # its page comes out of its own promise
                batch.append(req, 1)
                i += 1
                continue
            need = self._pages_needed(req, 1)
            while need > free and self._newest_preemptible(after=i) is not None:
                free += self._preempt(self.running.pop(self._newest_preemptible(after=i)))
            if need > free:
                free += self._preempt(self.running.pop(i))
                break
            free -= need
            batch.append(req, 1)
            i += 1
        return free

    def _newest_preemptible(self, after: int) -> int | None:
        """Index of the newest running request behind ``after`` that may be preempted."""
        for j in range(len(self.running) - 1, after, -1):
            if self.running[j].preemptible:
                return j
        return None

    def _schedule_chunks(self, batch: ScheduledBatch, free: int) -> None:
        page_size = self.cache.page_size
        for req in self.waiting:
            budget = self._budget(batch)
            if len(batch) >= self.max_num_seqs or budget <= 0:
                return
            if not req.in_cache:  # a committed one enters only when its whole promise fits, in order
                taken = self._enter(req, free)
                if taken is None:
                    return
                free -= taken
            if req.committed_pages:
                batch.append(req, min(req.num_to_compute, budget))
                continue
            tail = (-req.num_computed) % page_size
            n = min(req.num_to_compute, budget, free * page_size + tail)
            if n <= 0:
                return
            free -= self._pages_needed(req, n)
            batch.append(req, n)

    def _enter(self, req: Request, free: int) -> int | None:
        """Put a waiting request's sequence in the cache, forked from its longest cached prefix
        (those tokens count as computed) when that fits ``free``. Returns the pages of ``free`` it
        took (a committed request: its whole promise), or None when it cannot enter now."""
        size = self.cache.page_size
        match = self.cache.match_prefix(req.token_ids)
        hit = match.num_tokens
        if req.committed_pages:
            taken = match.num_pages + req.committed_pages - pages_for(hit, size)
            if taken > free:
                return None
        else:
            if match.num_pages > free or (hit % size == 0 and match.num_pages >= free):
                match, hit = dataclasses.replace(match, seq_id=None, num_tokens=0, num_pages=0), 0
                if free <= 0:
                    return None  # not even one token would fit
            taken = match.num_pages
        # a preempted request finds its own KV again: counted apart from prompt reuse, as vLLM does
        self.cache.add_sequence(req.seq_id, prefix=match, preempted=req.num_preemptions > 0)
        req.enter_cache(hit)
        if req.committed_pages:
            self.commit(req)
        return taken

    def _free_pages_for_head(self) -> bool:
        """Nothing fits: partially computed prompts behind the head give back their pages (they
        keep their place in the queue and recompute). True if any did."""
        freed = False
        for req in list(self.waiting)[1:]:
            if req.in_cache and req.preemptible:
                self._release(req)
                self.num_preemptions += 1
                req.num_preemptions += 1
                freed = True
        return freed

    def _budget(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.total_tokens

    def _pages_needed(self, req: Request, n: int) -> int:
        size = self.cache.page_size
        if not req.in_cache:
            return pages_for(n, size)
        return pages_for(req.num_computed + n, size) - pages_for(req.num_computed, size)

    def _preempt(self, req: Request) -> int:
        """Free ``req``'s pages; it recomputes prompt + output later (from the prefix cache, where
        its pages are still there then). Returns the pages freed."""
        before = self.cache.num_free_pages
        if self.cache.prefix_caching:
            self.cache.cache_tokens(req.seq_id, req.token_ids[:req.num_computed])
        self._release(req)
        self.num_preemptions += 1
        req.num_preemptions += 1  # (released: WAITING again)
        self.waiting.appendleft(req)
        logger.debug("preempted request %s (%d tokens to recompute)", req.request_id, len(req.token_ids))
        return self.cache.num_free_pages - before

    def _release(self, req: Request) -> None:
        if req.in_cache:
            self.cache.remove_sequence(req.seq_id)
        self.committed.pop(req.seq_id, None)
        self._outstanding = None
        req.leave_cache()
