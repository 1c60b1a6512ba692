"""Invariant checks of `PagedKVCache` (run by tests after every operation; cheap enough for debug runs).

`check_integrity(cache)` recomputes everything derived (reference counts, page ownership, cached
page tables, touched pages) from the block tree and compares; it raises `CacheIntegrityError`
naming the first broken invariant. Reads the cache's internals; mutates nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import numpy as np

from disagg.blocks import Block, BlockPool, Sequence
from disagg.copies import PendingCopies
from disagg.errors import CacheIntegrityError
from disagg.pages import PagePool, ceil_div


class CacheView(Protocol):
    """The parts of `disagg.cache.PagedKVCache` these checks read (a Protocol, so this module does
    not import the cache, which imports it)."""

    num_pages: int
    page_size: int
    _pool: PagePool
    _blocks: BlockPool
    _seqs: dict[int, Sequence]
    _windowed: set[int]
    _senders: dict[int, Sequence]
    _copies: PendingCopies
    _open: str | None

    def slots(self, seq_id: int, start: int = 0, end: int | None = None) -> np.ndarray: ...


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CacheIntegrityError(message)


def check_integrity(cache: CacheView) -> None:
    """Raise `CacheIntegrityError` if any invariant of `cache` is broken.

    Checked: reference counts equal children plus sequences; each sequence's last block is its
    own; every page is exactly one of free, parked or owned by one live block; block lengths,
    start positions and page counts agree; cached page tables and lengths equal the trace's;
    sliding-window fields are consistent; no slot is writable by two sequences; pending copies
    touch only owned or parked pages, and parked pages are touched while no forward is open.
    """
    live = _check_blocks(cache)
    owned = _check_pages(cache, live)
    for seq in cache._seqs.values():
        _check_sequence(cache, seq)
    _check_writers(cache)
    _check_copies(cache, owned)


def _check_blocks(cache: CacheView) -> dict[int, Block]:
    blocks = cache._blocks.blocks
    live: dict[int, Block] = {}
    for seq in cache._seqs.values():
        for block in cache._blocks.trace(seq.last_block_idx):
            live[block.index] = block
    free_idx = cache._blocks.free_idx
    _require(len(set(free_idx)) == len(free_idx), f"free block stack has duplicates: {free_idx}")
    _require(not set(free_idx) & set(live), f"blocks {sorted(set(free_idx) & set(live))} are free and live")
    _require(
        len(free_idx) + len(live) == len(blocks),
        f"{len(blocks)} blocks, {len(live)} live + {len(free_idx)} free: some block leaked",
    )
    refs = Counter(block.parent_idx for block in live.values() if block.parent_idx != -1)
    refs.update(seq.last_block_idx for seq in cache._seqs.values())
    for idx, block in live.items():
        _require(
            block.external_ref_cnt == refs[idx],
            f"block {idx}: external_ref_cnt {block.external_ref_cnt}, but {refs[idx]} children + "
            "sequences point at it",
        )
        if block.parent_idx != -1:
            parent = blocks[block.parent_idx]
            _require(
                block.start_pos == parent.start_pos + parent.seq_length,
                f"block {idx} starts at {block.start_pos}, its parent {parent.index} ends at "
                f"{parent.start_pos + parent.seq_length}",
            )
        else:
            _require(block.start_pos == 0, f"root block {idx} starts at {block.start_pos}, not 0")
        _require(
            len(block.page_ids) == ceil_div(block.num_used_slots, cache.page_size),
            f"block {idx} uses {block.num_used_slots} slots but has {len(block.page_ids)} pages",
        )
        if refs[idx] > 1 or any(b.parent_idx == idx for b in live.values()):
            _require(
                block.seq_length > 0 and block.seq_length % cache.page_size == 0 and not block.slid,
                f"block {idx} has children, so it must hold whole unslid pages; it holds "
                f"{block.seq_length} positions",
            )
    for seq in cache._seqs.values():
        _require(
            blocks[seq.last_block_idx].external_ref_cnt == 1,
            f"sequence {seq.seq_id}: its last block {seq.last_block_idx} is shared",
        )
    return live


def _check_pages(cache: CacheView, live: dict[int, Block]) -> set[int]:
    pool = cache._pool
    owned_list = [p for block in live.values() for p in block.page_ids]
    owned = set(owned_list)
    _require(len(owned) == len(owned_list), f"pages owned by two blocks: {_dups(owned_list)}")
    problems = pool.index_problems()
    _require(not problems, f"free page index broken: {'; '.join(problems)}")
    free = set(pool.free_pages())
    parked = set(pool.deferred)
    for name, group in (("owned", owned), ("free", free), ("parked", parked)):
        bad = [p for p in group if not 0 <= p < cache.num_pages]
        _require(not bad, f"{name} pages out of range [0, {cache.num_pages}): {bad[:8]}")
    _require(not owned & free, f"pages both owned and free: {sorted(owned & free)[:8]}")
    _require(not owned & parked, f"pages both owned and parked: {sorted(owned & parked)[:8]}")
    _require(not free & parked, f"pages both free and parked: {sorted(free & parked)[:8]}")
    total = len(owned) + len(free) + len(parked)
    _require(
        total == cache.num_pages,
        f"{total} pages accounted for, cache has {cache.num_pages}: some page leaked",
    )
    return owned


def _check_sequence(cache: CacheView, seq: Sequence) -> None:
    trace = cache._blocks.trace(seq.last_block_idx)
    last = trace[-1]
    length = sum(block.seq_length for block in trace)
    _require(
        seq.seq_length == length, f"sequence {seq.seq_id}: seq_length {seq.seq_length}, blocks hold {length}"
    )
    pages = cache._blocks.trace_pages(seq.last_block_idx)
    _require(
        np.array_equal(seq.table, pages),
        f"sequence {seq.seq_id}: cached page table {seq.table.tolist()[:8]}... differs from its "
        f"blocks' {pages.tolist()[:8]}...",
    )
    slots = cache.slots(seq.seq_id)
    _require(
        slots.size == seq.seq_length, f"sequence {seq.seq_id}: {slots.size} slots for {seq.seq_length} tokens"
    )
    _require(np.unique(slots).size == slots.size, f"sequence {seq.seq_id}: two positions share a slot")
    prefix = seq.seq_length - last.seq_length
    _require(
        last.sliding_window_offset >= last.sink_length,
        f"sequence {seq.seq_id}: window offset before its sinks",
    )
    if not seq.windowed:
        _require(not last.slid, f"sequence {seq.seq_id}: its last block slid without a window")
        _require(
            seq.send is None or seq.send.num_pending <= max(seq.seq_length - seq.send.begin, 0),
            f"sequence {seq.seq_id}: pending copies past its length",
        )
        return
    _require(
        seq.seq_id in cache._windowed, f"sequence {seq.seq_id} has a window but is not listed as windowed"
    )
    _require(
        seq.sliding_window_size > prefix,
        f"sequence {seq.seq_id}: window {seq.sliding_window_size} <= prefix {prefix}",
    )
    sinks = max(seq.attn_sink_size - prefix, 0)
    _require(
        seq.last_block_attn_sink_size == sinks,
        f"sequence {seq.seq_id}: last_block_attn_sink_size {seq.last_block_attn_sink_size}, expected {sinks}",
    )
    if last.slid:
        _require(
            last.sink_length == sinks,
            f"sequence {seq.seq_id}: pinned sinks {last.sink_length}, expected {sinks}",
        )
        _require(
            last.seq_length > last.sink_length, f"sequence {seq.seq_id}: slid block without window positions"
        )
    _require(seq.send is None, f"sequence {seq.seq_id} has a window and a send map")


def _check_writers(cache: CacheView) -> None:
    """No two live sequences can write one slot: their last blocks' pages are disjoint."""
    writable = [p for seq in cache._seqs.values() for p in cache._blocks.blocks[seq.last_block_idx].page_ids]
    _require(len(set(writable)) == len(writable), f"pages writable by two sequences: {_dups(writable)}")
    windowed = {s.seq_id for s in cache._seqs.values() if s.windowed}
    _require(windowed == cache._windowed, f"windowed set {sorted(cache._windowed)} != {sorted(windowed)}")
    senders = {s.seq_id for s in cache._seqs.values() if s.send is not None}
    _require(senders == set(cache._senders), f"senders {sorted(cache._senders)} != {sorted(senders)}")


def _check_copies(cache: CacheView, owned: set[int]) -> None:
    pool, page_size = cache._pool, cache.page_size
    usable = owned | set(pool.deferred)
    touched = set()
    for src, dst, length in cache._copies.fork:
        _require(0 < length < page_size, f"fork copy {src}->{dst} of {length} slots")
        _require(src in usable and dst in usable, f"fork copy {src}->{dst} touches a free page")
        touched.update((src, dst))
    for seq in cache._senders.values():
        local, _ = seq.send.pending_copies()
        pages = set((local // page_size).tolist())
        _require(
            pages <= usable,
            f"sequence {seq.seq_id}: pending send copies read free pages {sorted(pages - usable)}",
        )
        touched |= pages
    _require(
        touched == pool.touched, f"touched pages {sorted(pool.touched)} != pending copies' {sorted(touched)}"
    )
    if cache._open is None:
        stale = set(pool.deferred) - touched
        _require(not stale, f"parked pages {sorted(stale)} are touched by no pending copy")


def _dups(values: list[int]) -> list[int]:
    return sorted(v for v, k in Counter(values).items() if k > 1)[:8]
