"""Automatic prefix caching, the pages: cached sequences, which of their pages are evictable, LRU eviction.

When a registered sequence is removed (`PagedKVCache.remove_sequence`), its registered positions
stay in the cache as a *cached sequence* (a negative id, invisible to callers) instead of being
freed: TVM's block tree keeps sharing their pages with any live sequence that forked from them,
and a new prompt forks from them (`disagg.prefix_index` finds which). Pages are then in one of:

    free       in the page pool
    live       on the block trace of a live sequence (running, draining, quarantined, ...):
               never evicted, whatever else shares them
    evictable  held only by cached sequences; counted as free (`PagedKVCache.num_free_pages`)
               and evicted, least recently used sequence first and its last pages first, when a
               reservation needs them (vLLM's free queue of cached blocks)

Pages that a pending copy still reads or writes are not counted as evictable (given back, they
would be parked, not freed). Used only by `disagg.cache`; mutates its block and page pools.
"""

from __future__ import annotations

from disagg import prefix
from disagg.blocks import BlockPool, Sequence
from disagg.pages import PagePool
from disagg.prefix_index import PrefixIndex


class CachedSequences:
    """The cached sequences of one cache (LRU order) and its prefix-cache counters.

    Attributes:
        enabled: whether removal keeps registered pages cached.
        index: the content index of every registered sequence (live and cached).
        lru: cached sequence ids, least recently used first.
        num_query_tokens, num_hit_tokens: prompt tokens of new requests looked up / found
            (vLLM's prefix_cache_queries / prefix_cache_hits).
        num_preempted_query_tokens, num_preempted_hit_tokens: the same for requests re-entering
            after a preemption (vLLM's preempted_queries / preempted_hits): their own KV, found
            again, not a prompt reused.
        num_evicted_pages: pages evicted so far.
    """

    def __init__(self, page_size: int, enabled: bool) -> None:
        self.enabled = enabled
        self.page_size = page_size
        self.index = PrefixIndex(page_size)
        self.lru: dict[int, None] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_preempted_query_tokens = 0
        self.num_preempted_hit_tokens = 0
        self.num_evicted_pages = 0
        self._next_id = -1
        # The pages only cached sequences reach: their number, the blocks holding them and the
        # pages' set, each None when stale. A change of the tree stales all three (a walk over the
        # blocks recounts them when next asked); an eviction only takes its pages off the number,
        # which every page budget reads; the set, built from the blocks, only a prefix hit reads.
        self._num_unpinned: int | None = 0
        self._unpinned_blocks: list[int] | None = []
        self._unpinned: set[int] | None = set()

    def count_lookup(self, num_query_tokens: int, num_hit_tokens: int, preempted: bool) -> None:
        """Count one `add_sequence(prefix=)` lookup (vLLM's ``PrefixCacheStats.record``)."""
        if preempted:
            self.num_preempted_query_tokens += num_query_tokens
            self.num_preempted_hit_tokens += num_hit_tokens
        else:
            self.num_query_tokens += num_query_tokens
            self.num_hit_tokens += num_hit_tokens

    def invalidate(self) -> None:
        """The block tree changed: recount the evictable pages when next asked."""
        self._num_unpinned = None
        self._unpinned_blocks = None
        self._unpinned = None

    def _forget_pages(self, num_pages: int) -> None:
        """``num_pages`` evictable pages left the cache (a cached sequence's private pages, evicted
        or dropped: no other sequence reaches them, so no other page changes state)."""
        if self._num_unpinned is not None:
            self._num_unpinned -= num_pages
        self._unpinned_blocks = None
        self._unpinned = None

    def new_id(self, seqs: dict[int, Sequence]) -> int:
        """A negative id no sequence has."""
        while self._next_id in seqs:
            self._next_id -= 1
        seq_id, self._next_id = self._next_id, self._next_id - 1
        return seq_id

    def touch(self, seq_id: int) -> None:
        """A hit on ``seq_id``: it becomes the most recently used."""
        if seq_id in self.lru:
            del self.lru[seq_id]
            self.lru[seq_id] = None

    def evictable_pages(self, blocks: BlockPool, seqs: dict[int, Sequence]) -> set[int]:
        """Pages of blocks that no live sequence's trace reaches (touched ones included)."""
        if not self.lru:
            return set()
        if self._unpinned_blocks is None:
            self._recount(blocks, seqs)
        if self._unpinned is None:
            self._unpinned = {p for idx in self._unpinned_blocks for p in blocks.blocks[idx].page_ids}
        return self._unpinned

    def num_evictable(self, blocks: BlockPool, pool: PagePool, seqs: dict[int, Sequence]) -> int:
        """Pages eviction can free now (not counting pages a pending copy touches)."""
        if not self.lru:
            return 0
        if self._num_unpinned is None:
            self._recount(blocks, seqs)
        if not pool.touched or not self._num_unpinned:
            return self._num_unpinned
        pages = self.evictable_pages(blocks, seqs)
        return len(pages) - len(pages & pool.touched)

    def _recount(self, blocks: BlockPool, seqs: dict[int, Sequence]) -> None:
        """Find the blocks only cached sequences reach and count their pages (a walk over blocks)."""
        self._unpinned_blocks = _unpinned_blocks(blocks, seqs, self.lru)
        self._num_unpinned = sum(len(blocks.blocks[idx].page_ids) for idx in self._unpinned_blocks)
        self._unpinned = None

    def can_free_one(self, blocks: BlockPool, pool: PagePool, seqs: dict[int, Sequence], protect: int) -> bool:
        """Whether `evict` can free a page without touching cached sequence ``protect``'s pages."""
        for seq_id in self.lru:
            if seq_id == protect:
                continue
            idx = seqs[seq_id].last_block_idx
            while idx != -1 and blocks.blocks[idx].external_ref_cnt == 1:
                if any(p not in pool.touched for p in blocks.blocks[idx].page_ids):
                    return True
                idx = blocks.blocks[idx].parent_idx
        return False

    def evict(self, blocks: BlockPool, pool: PagePool, seqs: dict[int, Sequence], num_free: int,
              protect: int | None = None) -> None:
        """Evict until ``pool.num_free >= num_free`` (the caller checked that it can).

        Least recently used cached sequence first (never ``protect``: a fork is about to share its
        pages); from it, its last pages first (a pop to a page boundary of its private blocks), the
        whole sequence once they do not suffice. Another sequence's private pages are never on
        ``protect``'s trace, so evicting them leaves its pages alone.
        """
        while pool.num_free < num_free:
            victim = next((i for i in self.lru if i != protect), None)
            assert victim is not None, f"evict: {num_free - pool.num_free} pages short with nothing cached left"
            seq = seqs[victim]
            chain_pages, top_start = _private_tail(blocks, seq)
            want = num_free - pool.num_free
            before = pool.num_free
            if want >= chain_pages:
                self.drop(blocks, pool, seqs, seq)
            else:
                keep = top_start + (chain_pages - want) * self.page_size
                steps = prefix.pop_steps(blocks, seq, seq.seq_length - keep, self.page_size)
                prefix.commit_pop(blocks, pool, [], seq, steps, self.page_size)
                self.index.truncate(seq.seq_id, keep)
                self._forget_pages(chain_pages - _private_tail(blocks, seq)[0])
            self.num_evicted_pages += pool.num_free - before

    def drop_all(self, blocks: BlockPool, pool: PagePool, seqs: dict[int, Sequence]) -> int:
        """Remove every cached sequence (pages a live sequence shares stay with it); returns the
        pages given back (freed, or parked while a pending copy touches them), counted as evicted."""
        before = pool.num_free + len(pool.deferred)
        for seq_id in list(self.lru):
            self.drop(blocks, pool, seqs, seqs[seq_id])
        freed = pool.num_free + len(pool.deferred) - before
        self.num_evicted_pages += freed
        return freed

    def drop(self, blocks: BlockPool, pool: PagePool, seqs: dict[int, Sequence], seq: Sequence) -> None:
        """Remove the cached sequence ``seq``: pages only it held are freed."""
        private_pages = _private_tail(blocks, seq)[0]
        prefix.release_sequence(blocks, pool, seq)
        del seqs[seq.seq_id]
        del self.lru[seq.seq_id]
        self.index.drop(seq.seq_id)
        self._forget_pages(private_pages)

    def problems(self, seqs: dict[int, Sequence]) -> list[str]:
        """Inconsistencies (for `disagg.integrity`)."""
        out = self.index.problems({i: s.seq_length for i, s in seqs.items()})
        for seq_id in self.lru:
            seq = seqs.get(seq_id)
            if seq is None:
                out.append(f"cached sequence {seq_id} is not in the cache")
            elif seq_id >= 0 or seq.send is not None or seq.windowed:
                out.append(f"cached sequence {seq_id} must have a negative id, no send map and no window")
            elif seq_id not in self.index:
                out.append(f"cached sequence {seq_id} registered no tokens")
        if not self.enabled and (self.lru or len(self.index)):
            out.append("prefix caching is off but sequences are registered or cached")
        return out

    def count_problems(self, blocks: BlockPool, seqs: dict[int, Sequence]) -> list[str]:
        """The kept count of evictable pages against a recount (for `PagedKVCache.check_integrity`)."""
        if not self.lru:
            return []
        fresh = _unpinned_blocks(blocks, seqs, self.lru)
        pages = sum(len(blocks.blocks[idx].page_ids) for idx in fresh)
        out = []
        if self._num_unpinned is not None and pages != self._num_unpinned:
            out.append(f"evictable pages kept as {self._num_unpinned}, recounted {pages}")
        if self._unpinned_blocks is not None and sorted(fresh) != sorted(self._unpinned_blocks):
            out.append(f"blocks only cached sequences reach kept as {sorted(self._unpinned_blocks)}, "
                       f"recounted {sorted(fresh)}")
        return out


def _unpinned_blocks(blocks: BlockPool, seqs: dict[int, Sequence], cached: dict[int, None]) -> list[int]:
    """The blocks on the traces of the ``cached`` sequences that no other sequence's trace reaches."""
    seen: set[int] = set()
    for seq_id, seq in seqs.items():
        if seq_id not in cached:
            _walk(blocks, seq.last_block_idx, seen, None)
    found: list[int] = []
    for seq_id in cached:
        _walk(blocks, seqs[seq_id].last_block_idx, seen, found)
    return found


def _walk(blocks: BlockPool, idx: int, seen: set[int], found: list[int] | None) -> None:
    """Mark the trace ending at block ``idx`` seen (stopping at a seen block: its ancestors are
    seen too); add the newly seen blocks to ``found``."""
    block_of = blocks.blocks
    while idx != -1 and idx not in seen:
        seen.add(idx)
        if found is not None:
            found.append(idx)
        idx = block_of[idx].parent_idx


def _private_tail(blocks: BlockPool, seq: Sequence) -> tuple[int, int]:
    """Pages of the blocks only ``seq`` holds (from its last block up), and where they start."""
    num_pages, start = 0, seq.seq_length
    idx = seq.last_block_idx
    while idx != -1 and blocks.blocks[idx].external_ref_cnt == 1:
        block = blocks.blocks[idx]
        num_pages += len(block.page_ids)
        start = block.start_pos
        idx = block.parent_idx
    return num_pages, start
