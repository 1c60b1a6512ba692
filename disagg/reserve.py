"""Reserving a batch's slots (TVM's ReserveAppendLengthInSeq over a whole batch).

First the whole batch's page demand is counted against the free pages (raising `OutOfPages`
with nothing changed); then each sequence that needs pages takes them, right after its last page
when that is free (see `disagg.pages`). Without sliding windows in the batch this loops over only
the sequences that need a page (about 1 in page_size on the decode path); with windows it walks
the batch in order, since a slide frees pages that later sequences of the same batch may take.
Called by `disagg.cache`.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable

import numpy as np

from disagg import sliding
from disagg.blocks import Block, BlockPool, Sequence
from disagg.errors import OutOfPages
from disagg.pages import PagePool


class WindowedAppend:
    """What the plan builder needs about one sliding-window sequence of the batch.

    Attributes:
        index: its index in the batch.
        block: its last block, after the reservation.
        prefix_pages: pages of its prefix blocks.
        last_len_before: the last block's `seq_length` before the reservation.
    """

    __slots__ = ("index", "block", "prefix_pages", "last_len_before")

    def __init__(self, index: int, block: Block, prefix_pages: int, last_len_before: int) -> None:
        self.index = index
        self.block = block
        self.prefix_pages = prefix_pages
        self.last_len_before = last_len_before


MakeRoom = Callable[..., None]


def reserve_batch(
    blocks: BlockPool,
    pool: PagePool,
    seqs: list[Sequence],
    lens: np.ndarray,
    page_size: int,
    op: str,
    make_room: MakeRoom | None = None,
) -> tuple[np.ndarray, list[WindowedAppend]]:
    """Reserve ``lens[i]`` slots at the end of ``seqs[i]`` for every i, or raise with nothing changed.

    Args:
        seqs: the batch, B distinct sequences.
        lens: ``[B]`` int64 append lengths (>= 1).
        op: the caller's name, for the error message.
        make_room: ``make_room(num_pages, op, best_effort=False)`` frees pages (evicts cached
            ones) until ``num_pages`` are free, or raises `OutOfPages` changing nothing; None when
            nothing can be evicted.

    Returns:
        ``(len_before [B] int64, windowed)``: lengths before the append, and the sliding-window
        sequences of the batch.

    Raises:
        OutOfPages: the batch needs more pages than are free (at its peak, for windowed batches).
    """
    count = len(seqs)
    len_before = np.fromiter(map(_seq_length, seqs), dtype=np.int64, count=count)
    num_pages = np.fromiter(map(len, map(_table, seqs)), dtype=np.int64, count=count)
    # Without a window, a sequence's pages cover exactly ceil(seq_length / page_size).
    need = (len_before + lens + page_size - 1) // page_size - num_pages
    if count and max(map(_window_size, seqs)) > 0:  # a sliding window (off: -1)
        need_list = need.tolist()
        if make_room is not None:  # best effort: the in-order check below decides
            gross = sum(
                sliding.gross_need(blocks.blocks[s.last_block_idx], n, page_size) if s.windowed else k
                for s, n, k in zip(seqs, lens.tolist(), need_list)
            )
            make_room(gross, op, best_effort=True)
        _check_in_order(blocks, pool, seqs, lens.tolist(), need_list, page_size, op)
        return len_before, _reserve_in_order(blocks, pool, seqs, lens.tolist(), need_list, page_size)
    total = int(need.sum())
    if total > pool.num_free and make_room is not None:
        make_room(total, op)
    if total > pool.num_free:
        raise OutOfPages(
            f"{op}: the batch needs {total} new pages, {pool.num_free} are free",
            num_needed=total,
            num_free=pool.num_free,
        )
    # Each sequence first continues its own run where the next page is free; the rest of the
    # batch's demand is one `take`, split in batch order (`PagePool.take_many`).
    block_of = blocks.blocks
    rows = np.flatnonzero(need).tolist()
    if rows:
        needing = [seqs[i] for i in rows]
        taken = pool.take_many([_last_page(s, block_of) for s in needing], need[rows].tolist())
        for seq, pages in zip(needing, taken):
            block_of[seq.last_block_idx].page_ids.extend(pages)
            seq.extend_table(pages)
    for seq, length in zip(seqs, lens.tolist()):
        seq.seq_length += length
        block_of[seq.last_block_idx].seq_length += length
    return len_before, []


_seq_length, _table, _window_size = attrgetter("seq_length"), attrgetter("table"), attrgetter("sliding_window_size")


def _last_page(seq: Sequence, block_of: list[Block]) -> int | None:
    """The page a sequence's new pages should follow (`PagePool.take`'s ``after``)."""
    own = block_of[seq.last_block_idx].page_ids  # a list: cheaper to index than the table
    if own:
        return own[-1]
    return int(seq.table[-1]) if len(seq.table) else None


def _check_in_order(
    blocks: BlockPool,
    pool: PagePool,
    seqs: list[Sequence],
    lens: list[int],
    need: list[int],
    page_size: int,
    op: str,
) -> None:
    gross = sum(
        sliding.gross_need(blocks.blocks[s.last_block_idx], n, page_size) if s.windowed else k
        for s, n, k in zip(seqs, lens, need)
    )
    if gross <= pool.num_free:
        return  # every page comes straight off the stack; slides only give pages back
    free = lowest = pool.num_free
    for seq, length, k in zip(seqs, lens, need):
        if seq.windowed:
            block = blocks.blocks[seq.last_block_idx]
            low, free = sliding.simulate_reserve(seq, block, length, page_size, free, pool.touched)
            lowest = min(lowest, low)
        else:
            free -= k
            lowest = min(lowest, free)
    if lowest < 0:
        raise OutOfPages(
            f"{op}: the batch needs {pool.num_free - lowest} pages at its peak, {pool.num_free} are free",
            num_needed=pool.num_free - lowest,
            num_free=pool.num_free,
        )


def _reserve_in_order(
    blocks: BlockPool, pool: PagePool, seqs: list[Sequence], lens: list[int], need: list[int], page_size: int
) -> list[WindowedAppend]:
    windowed = []
    for i, (seq, length, k) in enumerate(zip(seqs, lens, need)):
        block = blocks.blocks[seq.last_block_idx]
        if not seq.windowed:
            pages = pool.take(k, _last_page(seq, blocks.blocks))
            block.page_ids.extend(pages)
            seq.extend_table(pages)
            seq.seq_length += length
            block.seq_length += length
            continue
        num_before = len(block.page_ids)
        prefix_pages = len(seq.table) - num_before
        windowed.append(WindowedAppend(i, block, prefix_pages, block.seq_length))
        if sliding.reserve(pool, seq, block, length, page_size):
            own = np.asarray(block.page_ids, dtype=np.int32)
            seq.set_table(np.concatenate((seq.table[:prefix_pages], own)))
        elif len(block.page_ids) > num_before:
            seq.extend_table(block.page_ids[num_before:])
    return windowed
