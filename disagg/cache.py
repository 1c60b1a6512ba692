"""`PagedKVCache`: page-table bookkeeping with TVM's `PagedAttentionKVCacheObj` semantics.

Pure Python + numpy. Every worker (prefill, decode, colocated) owns one per KV allocation, in its
own process; the router may keep one to plan. It decides which page and slot each token's K/V
occupies and returns `ForwardPlan`s; it never touches KV memory, so every copy it needs is
*reported* (in the next plan) and never assumed done. Prefix tree, page pool and windows live in
`disagg.blocks` / `disagg.prefix`, `disagg.pages` and `disagg.sliding`; reservation in
`disagg.reserve`, plan arrays in `disagg.forward`, pending copies in `disagg.copies`, the
disaggregated receive and send (`disagg_prepare_recv`, `disagg_mark_send`) in `disagg.cache_sends`.

Decisions where TVM is silent (the bookkeeping as a whole: docs/ARCHITECTURE.md §3):
- Every call that changes state needs the forward closed (ForwardStateError otherwise), so pages
  that an open plan writes are never freed or handed out under it.
- A failed call changes nothing: each operation checks everything (ids, lengths, maps, pages)
  before it mutates. Page ids do not follow TVM's free stack: free pages are handed out so
  that runs stay long (the page after a growing sequence's last one, else the best-fitting free
  extent, ascending; see `disagg.pages`); a page touched by a pending copy is parked until that
  copy has run.
- Fork copies are pending until the next `begin_forward`, whose plan lists them (in order) to run
  for every layer before that forward's appends. `disagg_prepare_recv` does not drain them (its
  plan is not returned), and refuses to reserve a slot that a pending copy reads or writes.
  Copies whose result nobody can see any more (destination page freed and not read by a later
  copy) are dropped.
- `popn` into a shared prefix keeps the sequence's sliding window and send map (TVM's fork+remove
  drops both); a windowed sequence can be popped (TVM miscounts its pages).
- A sliding window needs `window_size` > the shared prefix (prefix blocks cannot slide). Forking a
  windowed parent fixes the sink offsets of a split block (TVM only fixes the sink size).
- Positions of a windowed sequence are in-cache positions (TVM's RoPE positions, which restart
  inside the window); a token that slides off before it is written gets slot -1.
- `disagg_mark_send`: not on a windowed sequence (its positions shift as it slides); a map must
  cover at least the tokens that already exist from `begin` (TVM wants one more); a second call
  replaces the first and drops its unsent copies; `remove_sequence` drops them too (an abort);
  `popn` drops those of popped positions (later pushes resend them). Send records in a plan come
  in the order of the `disagg_mark_send` calls. `begin_forward([], [])` is allowed (it drains
  pending copies).

Automatic prefix caching (``prefix_caching=True``; vLLM's, on TVM's forks; `disagg.prefix_index`,
`disagg.prefix_cache`): `cache_tokens(seq, token_ids)` says which tokens a sequence's written KV
holds; `remove_sequence` then keeps those positions as a cached sequence (negative id, invisible
to callers) instead of freeing them. `match_prefix(token_ids)` finds the longest cached prefix
(whole pages, then token by token into the next page; never the whole prompt: one token is always
computed) and `add_sequence(seq, prefix=match)` forks from it (a mid-page hit copies that page, by
the fork rule). `num_free_pages` counts free plus evictable pages (held only by cached
sequences); reservations evict them least recently used first; pages on a live sequence's trace
are never evicted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence as SequenceLike

import numpy as np

from disagg import forward, integrity, prefix, sliding
from disagg.blocks import BlockPool, Sequence
from disagg.cache_sends import DisaggSends, as_int as _as_int
from disagg.copies import PendingCopies
from disagg.errors import (
    CacheError,
    CacheIntegrityError,
    ForwardStateError,
    OutOfPages,
    SequenceExists,
    SequenceNotFound,
)
from disagg.pages import PagePool
from disagg.plan import ForwardPlan
from disagg.prefix_cache import CachedSequences
from disagg.prefix_index import PrefixMatch
from disagg.reserve import reserve_batch

logger = logging.getLogger(__name__)


class PagedKVCache(DisaggSends):
    """Pages, prefix sharing, sliding windows and disaggregated sends for many sequences.

    Args:
        num_pages: pages in the KV allocation (>= 1).
        page_size: tokens per page (>= 1).
        prefix_caching: keep the registered positions of removed sequences cached for
            `match_prefix` (module docstring).

    Raises:
        CacheError: either argument is not a positive int.
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if _as_int(value, name) < 1:
                raise CacheError(f"{name}: expected an int >= 1, got {value}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._pool = PagePool(self.num_pages)
        self._blocks = BlockPool()
        self._seqs: dict[int, Sequence] = {}
        self._windowed: set[int] = set()
        self._senders: dict[int, Sequence] = {}
        self._copies = PendingCopies(self._pool, self.page_size)
        self._open: str | None = None
        self._cached = CachedSequences(self.page_size, bool(prefix_caching))
        self._epoch = 0  # bumped by every call that changes state (stale PrefixMatch check)

    # ---------------------------------------------------------------- queries

    @property
    def num_free_pages(self) -> int:
        """Pages that the next reservation can take: free plus evictable (held only by cached
        sequences; parked pages and pages a pending copy touches excluded)."""
        return self._pool.num_free + self._num_evictable()

    @property
    def version(self) -> int:
        """A count bumped by every call that may change the cache's state (before it changes
        anything): a value computed from the cache between two calls holds while it is unchanged."""
        return self._epoch

    @property
    def has_sends(self) -> bool:
        """Some sequence is marked for sending (`disagg_mark_send`): plans carry its pushes and copies."""
        return bool(self._senders)

    @property
    def prefix_caching(self) -> bool:
        return self._cached.enabled

    @property
    def num_cached_pages(self) -> int:
        """Evictable pages: held only by cached sequences (part of `num_free_pages`)."""
        return self._num_evictable()

    def prefix_stats(self) -> dict[str, int]:
        """Prompt tokens looked up and found by `add_sequence(prefix=)` (a new request's, and apart
        a preempted one's re-entering: ``prefix_preempted_*``), cached and evicted pages."""
        return {"prefix_query_tokens": self._cached.num_query_tokens,
                "prefix_hit_tokens": self._cached.num_hit_tokens,
                "prefix_preempted_query_tokens": self._cached.num_preempted_query_tokens,
                "prefix_preempted_hit_tokens": self._cached.num_preempted_hit_tokens,
                "prefix_cached_pages": self._num_evictable(),
                "prefix_evicted_pages": self._cached.num_evicted_pages}

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``, SGLang's ``flush_cache``):
        pages held only by cached sequences go back to the pool; live sequences and the pages they
        share are untouched and stay matchable while they live (removed later, they are cached
        again). Safe between any two calls, an open forward included: a forward reads and writes
        only live sequences' pages. Counters keep counting. Returns the pages given back."""
        if not self._cached.lru:
            return 0
        freed = self._cached.drop_all(self._blocks, self._pool, self._seqs)
        self._epoch += 1  # a PrefixMatch taken before may name a dropped sequence
        return freed

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs and seq_id not in self._cached.lru

    def seq_length(self, seq_id: int) -> int:
        """Tokens of `seq_id` held in the cache (for a sliding window, at most the window)."""
        return self._get(seq_id, "seq_length").seq_length

    def seq_lengths(self, seq_ids: Iterable[int]) -> list[int]:
        """`seq_length` of each of ``seq_ids``, in order (raises as `seq_length` does)."""
        return [seq.seq_length for seq in self._get_many(seq_ids, "seq_lengths")]

    def slots(self, seq_id: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Slots of positions ``start .. end - 1`` of `seq_id`.

        Returns:
            ``[end - start]`` int32, ``page_id * page_size + offset``.

        Raises:
            SequenceNotFound: unknown id. CacheError: not ``0 <= start <= end <= seq_length``.
        """
        seq = self._get(seq_id, "slots", cached_ok=True)
        end = seq.seq_length if end is None else _as_int(end, "end")
        start = _as_int(start, "start")
        if not 0 <= start <= end <= seq.seq_length:
            raise CacheError(
                f"slots: sequence {seq_id} holds {seq.seq_length} tokens; expected "
                f"0 <= start <= end <= {seq.seq_length}, got start={start}, end={end}"
            )
        return self._position_slots(seq, np.arange(start, end, dtype=np.int64))

    def check_integrity(self) -> None:
        """Raise `CacheIntegrityError` if any invariant is broken (see `disagg.integrity`), or the
        prefix cache's index or cached sequences disagree with the sequences."""
        integrity.check_integrity(self)
        problems = self._cached.problems(self._seqs) + self._cached.count_problems(self._blocks, self._seqs)
        if problems:
            raise CacheIntegrityError("; ".join(problems))

    # ------------------------------------------------------ sequence management

    def add_sequence(self, seq_id: int, prefix: PrefixMatch | None = None, *, preempted: bool = False) -> None:
        """Add a sequence: empty, or holding the cached prefix ``prefix`` (from `match_prefix`,
        with no state change since; counted in `prefix_stats`: apart when ``preempted``, a
        request re-entering to recompute its own tokens, whose hits are not prompt reuse).

        Raises:
            SequenceExists, CacheError (bad id, stale match), ForwardStateError.
        """
        if prefix is not None and prefix.epoch != self._epoch:
            raise CacheError(f"add_sequence: sequence {seq_id}: the prefix match is stale (the cache "
                             "changed since match_prefix); match again")
        self._require_closed("add_sequence")
        seq_id = _as_int(seq_id, "seq_id")
        if seq_id in self._seqs:
            raise SequenceExists(f"add_sequence: sequence {seq_id} is already in the cache")
        if prefix is not None and prefix.seq_id is not None and prefix.num_tokens:
            self._fork(self._seqs[prefix.seq_id], seq_id, prefix.num_tokens)
            self._cached.touch(prefix.seq_id)
        else:  # a new root block without pages: what only cached sequences reach is unchanged
            block = self._blocks.get()
            block.external_ref_cnt = 1
            self._seqs[seq_id] = Sequence(seq_id, block.index, 0, np.empty(0, dtype=np.int32))
        if prefix is not None and self._cached.enabled:
            self._cached.count_lookup(prefix.num_query_tokens, prefix.num_tokens, preempted)

    def match_prefix(self, token_ids: SequenceLike[int], *, page_aligned: bool = False) -> PrefixMatch:
        """The longest cached prefix of a prompt (registered positions of live or cached sequences).

        At most ``len(token_ids) - 1`` tokens (one is always computed). A hit that ends mid page
        forks by copying that page; it is cut to the page boundary when ``page_aligned`` or when no
        page is free for the copy. Changes nothing.

        Returns:
            A `PrefixMatch` for `add_sequence` (``seq_id`` None and 0 tokens on a miss or with
            prefix caching off).
        """
        query = len(token_ids)
        parent_id, num = (None, 0)
        if self._cached.enabled and query > self.page_size:
            parent_id, num = self._cached.index.match(token_ids, query - 1)
        if num % self.page_size and (page_aligned or (self._pool.num_free < 1 and not self._cached.can_free_one(
                self._blocks, self._pool, self._seqs, parent_id))):
            num -= num % self.page_size  # no page to copy the partial one into
        if not num:
            return PrefixMatch(None, 0, query, 0, self._epoch)
        parent = self._seqs[parent_id]
        partial = num % self.page_size > 0
        cost = int(partial)
        evictable = self._cached.evictable_pages(self._blocks, self._seqs)
        if evictable:
            # The fork pins the shared whole pages; a mid-page hit's copy also reads the parent's
            # partial page, which counts as free no more until the copy has run (touched).
            touched = self._pool.touched
            cost += sum(1 for p in parent.table[: num // self.page_size + partial].tolist()
                        if p in evictable and p not in touched)
        return PrefixMatch(parent_id, num, query, cost, self._epoch)

    def cache_tokens(self, seq_id: int, token_ids: SequenceLike[int]) -> None:
        """The written KV of `seq_id`'s first ``len(token_ids)`` positions holds these tokens.

        With prefix caching on, its full pages become matchable, and `remove_sequence` keeps these
        positions cached. Call it only once the KV is written (or ordered before any later
        forward); a no-op with prefix caching off.

        Raises:
            SequenceNotFound, ForwardStateError, CacheError: more tokens than the sequence holds,
            a windowed sequence, or tokens that disagree with those registered before.
        """
        self._require_closed("cache_tokens")
        seq = self._get(seq_id, "cache_tokens")
        if not self._cached.enabled:
            return
        if len(token_ids) > seq.seq_length or seq.windowed:
            raise CacheError(f"cache_tokens: sequence {seq.seq_id} holds {seq.seq_length} tokens"
                             f"{' in a sliding window' if seq.windowed else ''}; expected at most that "
                             f"many tokens of a windowless sequence, got {len(token_ids)}")
        if not self._cached.index.register(seq.seq_id, token_ids):
            raise CacheError(f"cache_tokens: sequence {seq.seq_id}: the tokens disagree with those "
                             "registered before")

    def remove_sequence(self, seq_id: int) -> None:
        """Remove a sequence, free the pages only it held, and drop its unsent copies."""
        self._require_closed("remove_sequence")
        seq = self._get(seq_id, "remove_sequence")
        self._windowed.discard(seq.seq_id)
        self._senders.pop(seq.seq_id, None)
        self._cached.invalidate()
        if self._cached.index.length(seq.seq_id) >= self.page_size:
            self._keep_cached(seq)
        else:
            self._cached.index.drop(seq.seq_id)
            prefix.release_sequence(self._blocks, self._pool, seq)
            del self._seqs[seq.seq_id]
        self._copies.refresh(self._senders)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        """Make `child_id` share the first `fork_pos` tokens of `parent_id` (-1: all of them).

        Whole pages are shared; a partially filled page is copied into a fresh page for the child,
        reported in the next plan's `fork_src_slots` / `fork_dst_slots`.

        Raises:
            SequenceNotFound, SequenceExists, CacheError (position past the length or outside a
            windowed parent's sinks), OutOfPages (the copy needs a page), ForwardStateError.
        """
        self._require_closed("fork_sequence")
        parent = self._get(parent_id, "fork_sequence")
        self._fork(parent, child_id, fork_pos)

    def _fork(self, parent: Sequence, child_id: int, fork_pos: int) -> None:
        child_id = _as_int(child_id, "child_id")
        if child_id in self._seqs:
            raise SequenceExists(f"fork_sequence: child sequence {child_id} is already in the cache")
        fork_pos = _as_int(fork_pos, "fork_pos")
        if fork_pos == -1:
            fork_pos = parent.seq_length
        if not 0 <= fork_pos <= parent.seq_length:
            raise CacheError(
                f"fork_sequence: parent {parent.seq_id} holds {parent.seq_length} tokens; expected "
                f"fork_pos in [0, {parent.seq_length}] or -1, got {fork_pos}"
            )
        if parent.windowed:
            sinks = self._prefix_length(parent) + parent.last_block_attn_sink_size
            if fork_pos > sinks:
                raise CacheError(
                    f"fork_sequence: parent {parent.seq_id} has a sliding window, so it forks only "
                    f"within its {sinks} sink tokens; got fork_pos={fork_pos}"
                )
        if fork_pos % self.page_size and self._pool.num_free < 1:
            if not self._cached.can_free_one(self._blocks, self._pool, self._seqs, parent.seq_id):
                raise OutOfPages(
                    f"fork_sequence: forking {parent.seq_id} at {fork_pos} copies a partial page and "
                    "needs 1 free page; none is free",
                    num_needed=1,
                    num_free=0,
                )
            self._cached.evict(self._blocks, self._pool, self._seqs, 1, protect=parent.seq_id)
        self._cached.invalidate()
        table = parent.table[: fork_pos // self.page_size]
        child_block = prefix.fork_blocks(
            self._blocks, self._pool, self._copies.fork, parent, fork_pos, self.page_size
        )
        own_pages = np.asarray(child_block.page_ids, dtype=np.int32)
        child = Sequence(child_id, child_block.index, fork_pos, np.concatenate((table, own_pages)))
        self._seqs[child_id] = child
        self._cached.index.copy_prefix(parent.seq_id, child_id, fork_pos)
        self._refresh_sinks(parent)
        self._copies.refresh(self._senders)

    def popn(self, seq_id: int, n: int) -> None:
        """Roll `seq_id` back by `n` tokens; into a shared prefix this forks a private copy (TVM).

        Raises:
            SequenceNotFound, CacheError (n < 0 or past the length), OutOfPages (the partial page
            at the new end is shared and must be copied, and no page is free), ForwardStateError.
        """
        self._require_closed("popn")
        seq = self._get(seq_id, "popn")
        n = _as_int(n, "n")
        if not 0 <= n <= seq.seq_length:
            raise CacheError(
                f"popn: sequence {seq.seq_id} holds {seq.seq_length} tokens; expected 0 <= n <= "
                f"{seq.seq_length}, got n={n}"
            )
        if n == 0:
            return
        steps = prefix.pop_steps(self._blocks, seq, n, self.page_size)
        fork_pos = seq.seq_length - n
        if steps.remaining and fork_pos % self.page_size:
            if self._pool.num_free + self._pool.num_untouched(steps.freed_pages()) < 1:
                raise OutOfPages(
                    f"popn: sequence {seq.seq_id} pops into a shared page at position {fork_pos}, "
                    "which must be copied; it needs 1 free page and none is free",
                    num_needed=1,
                    num_free=self._pool.num_free,
                )
        self._cached.invalidate()
        prefix.commit_pop(self._blocks, self._pool, self._copies.fork, seq, steps, self.page_size)
        self._cached.index.truncate(seq.seq_id, seq.seq_length)
        self._refresh_sinks(seq)
        if seq.send is not None:
            seq.send.trim(seq.seq_length)
        self._copies.refresh(self._senders)

    def enable_sliding_window(self, seq_id: int, window_size: int, sink_size: int) -> None:
        """Keep only the first `sink_size` and the last tokens of `seq_id`, `window_size` in all.

        Raises:
            SequenceNotFound, ForwardStateError, CacheError: sizes out of range
            (``0 <= sink_size < window_size``, ``window_size`` > shared prefix), window already on,
            or the sequence is marked for sending.
        """
        self._require_closed("enable_sliding_window")
        seq = self._get(seq_id, "enable_sliding_window")
        window_size = _as_int(window_size, "window_size")
        sink_size = _as_int(sink_size, "sink_size")
        prefix_len = self._prefix_length(seq)
        if not 0 <= sink_size < window_size or window_size <= prefix_len:
            raise CacheError(
                f"enable_sliding_window: sequence {seq.seq_id} (shared prefix {prefix_len}); expected "
                f"0 <= sink_size < window_size and window_size > {prefix_len}, got "
                f"window_size={window_size}, sink_size={sink_size}"
            )
        if seq.windowed:
            raise CacheError(
                f"enable_sliding_window: sequence {seq.seq_id} already has a window of "
                f"{seq.sliding_window_size}"
            )
        if seq.send is not None:
            raise CacheError(f"enable_sliding_window: sequence {seq.seq_id} is marked for sending")
        seq.sliding_window_size = window_size
        seq.attn_sink_size = sink_size
        seq.last_block_attn_sink_size = max(sink_size - prefix_len, 0)
        self._windowed.add(seq.seq_id)
        self._cached.index.drop(seq.seq_id)

    # ----------------------------------------------------------------- forward

    def begin_forward(self, seq_ids: SequenceLike[int], append_lengths: SequenceLike[int]) -> ForwardPlan:
        """Reserve slots for a batch and return its plan (page tables after the append).

        Args:
            seq_ids: ``[B]`` distinct sequence ids.
            append_lengths: ``[B]`` tokens appended to each (>= 1).

        Returns:
            The `ForwardPlan`; it also drains every pending fork copy and page-to-page send.

        Raises:
            ForwardStateError (a forward is open), SequenceNotFound, CacheError (bad batch),
            PositionMapError (a push past a send map's end), OutOfPages. State unchanged.
        """
        self._require_closed("begin_forward")
        ids, lens = forward.check_batch(seq_ids, append_lengths)
        seqs = self._get_many(ids, "begin_forward")
        if self._senders:
            forward.check_send_room(seqs, lens)
        len_before, windowed = reserve_batch(
            self._blocks, self._pool, seqs, lens, self.page_size, "begin_forward", self._room()
        )
        plan = forward.build_plan(
            ids, seqs, lens, len_before, windowed, self.page_size, self._senders, self._copies
        )
        self._open = "begin_forward"
        return plan

    def append_without_plan(self, seq_ids: SequenceLike[int], append_lengths: SequenceLike[int]) -> None:
        """`begin_forward` + `end_forward` for a forward that computes nothing: the batch's slots
        are reserved (pages taken exactly as `begin_forward` takes them) and no plan is built.
        The simulator's forward (`disagg.cluster.simulate`). Pending fork copies (a prefix-cache
        hit that ends mid page) count as run by it, as `begin_forward`'s plan would run them;
        refused while sends are pending (the simulator marks none).

        Raises:
            ForwardStateError, SequenceNotFound, CacheError (bad batch, pending sends),
            OutOfPages. State unchanged.
        """
        self._require_closed("append_without_plan")
        if self._senders:
            raise CacheError("append_without_plan: sends are pending; they need begin_forward's plan")
        ids, lens = forward.check_batch(seq_ids, append_lengths)
        seqs = self._get_many(ids, "append_without_plan")
        reserve_batch(self._blocks, self._pool, seqs, lens, self.page_size, "append_without_plan", self._room())
        if self._copies.fork:
            self._copies.drain(self._senders, {})  # the forward runs them before its appends
        self._epoch += 1
        self._pool.release_deferred()

    def end_forward(self) -> None:
        """Close the open forward (or `disagg_prepare_recv`); parked pages whose copies ran are freed."""
        if self._open is None:
            raise ForwardStateError("end_forward: no forward is open; call begin_forward first")
        self._open = None
        self._epoch += 1
        self._pool.release_deferred()

    # ------------------------------------------------------------ internals

    def _require_closed(self, op: str) -> None:
        if self._open is not None:
            raise ForwardStateError(f"{op}: a forward ({self._open}) is still open; call end_forward first")
        self._epoch += 1

    def _get(self, seq_id: object, op: str, cached_ok: bool = False) -> Sequence:
        """The live sequence ``seq_id`` (or a cached one, when ``cached_ok``: read-only uses)."""
        try:
            seq = self._seqs.get(seq_id)  # type: ignore[arg-type]
        except TypeError:
            seq = None
        if seq is None or (not cached_ok and seq_id in self._cached.lru):
            _as_int(seq_id, "seq_id")
            raise SequenceNotFound(f"{op}: sequence {seq_id} is not in the cache")
        return seq

    def _get_many(self, seq_ids: Iterable[object], op: str) -> list[Sequence]:
        """`_get` of each of ``seq_ids`` (live ones only), in one pass over a batch when all are."""
        ids = list(seq_ids)
        try:
            seqs = list(map(self._seqs.get, ids))
        except TypeError:  # an unhashable id: `_get` names it
            seqs = [None]
        if None in seqs or (self._cached.lru and not self._cached.lru.keys().isdisjoint(ids)):
            return [self._get(i, op) for i in ids]  # raises for the first id that is not live
        return seqs

    def _num_evictable(self) -> int:
        return self._cached.num_evictable(self._blocks, self._pool, self._seqs) if self._cached.lru else 0

    def _room(self):
        """What `reserve_batch` calls when the free pool is short: evict cached pages, or None."""
        return self._make_room if self._cached.lru else None

    def _make_room(self, num_pages: int, op: str, best_effort: bool = False) -> None:
        """Evict cached pages until ``num_pages`` are free; raise `OutOfPages` (nothing changed)
        when even evicting all of them would not do, unless ``best_effort``."""
        short = num_pages - self._pool.num_free
        if short <= 0:
            return
        evictable = self._num_evictable()
        if short > evictable:
            if not best_effort:
                raise OutOfPages(f"{op}: needs {num_pages} new pages, {self._pool.num_free + evictable} are "
                                 f"free ({evictable} of them cached)", num_needed=num_pages,
                                 num_free=self._pool.num_free + evictable)
            short = evictable
        self._cached.evict(self._blocks, self._pool, self._seqs, self._pool.num_free + short)

    def _keep_cached(self, seq: Sequence) -> None:
        """`remove_sequence` of a registered sequence: its registered positions stay cached (popped
        to them; to a page boundary when they end inside a shared block), under a new id."""
        keep = self._cached.index.length(seq.seq_id)
        if keep < self._prefix_length(seq):
            keep -= keep % self.page_size
        seq.send = None
        if keep < seq.seq_length:
            steps = prefix.pop_steps(self._blocks, seq, seq.seq_length - keep, self.page_size)
            prefix.commit_pop(self._blocks, self._pool, self._copies.fork, seq, steps, self.page_size)
            self._cached.index.truncate(seq.seq_id, keep)
        new_id = self._cached.new_id(self._seqs)
        del self._seqs[seq.seq_id]
        self._cached.index.rename(seq.seq_id, new_id)
        seq.seq_id = new_id
        self._seqs[new_id] = seq
        self._cached.lru[new_id] = None

    def _prefix_length(self, seq: Sequence) -> int:
        return prefix.prefix_length(self._blocks, seq)

    def _refresh_sinks(self, seq: Sequence) -> None:
        """Prefix blocks are natural sinks: the last block pins only the sinks they leave over."""
        if seq.windowed:
            seq.last_block_attn_sink_size = max(seq.attn_sink_size - self._prefix_length(seq), 0)

    def _position_slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        block = self._blocks.blocks[seq.last_block_idx]
        offsets = sliding.position_offsets(positions, self._prefix_length(seq), block)
        slots = (
            seq.table[offsets // self.page_size].astype(np.int64) * self.page_size + offsets % self.page_size
        )
        return slots.astype(np.int32)
