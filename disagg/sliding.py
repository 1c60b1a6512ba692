"""Sliding windows with attention sinks (TVM's `ReserveAppendLengthInSeq` / `SlideWindowForSequence`).

Only a sequence's last block slides. Its first `sink_length` positions stay (the sinks, on the
first ceil(sink_length / page_size) pages); the window's positions follow from in-block slot
offset `sliding_window_offset` on. When the sequence grows past its window, the oldest window
positions slide off, and pages that hold only slid-off positions go back to the free pages.
Between the sinks and the window the page table may hold a hole of dead slots (at most one page
and a bit); plans describe it with `sink_size` / `sliding_window_offset`.

Functions here mutate the block, sequence and page pool handed to them; `disagg.reserve` calls
them for every reservation (`begin_forward`, `disagg_prepare_recv`), `disagg.prefix` for `popn`,
and `disagg.forward` to place a windowed sequence's new tokens.
"""

from __future__ import annotations

import numpy as np

from disagg.blocks import TEMP_PAGE_ID, Block, Sequence
from disagg.pages import PagePool, ceil_div


def _slide_target(
    seq: Sequence, block: Block, new_seq_length: int, page_size: int
) -> tuple[int, int, int, int]:
    """Where a slide to `new_seq_length` would leave the block.

    Returns:
        ``(length_to_slide, sink_length, num_sink_pages, first_window_slot)``: positions that slide
        off, the block's sink length after the slide, pages kept for sinks, and the in-block slot
        offset where the window starts before whole pages are dropped (0 slide: no change).
    """
    sink, offset = block.sink_length, block.sliding_window_offset
    if not seq.windowed or new_seq_length <= seq.sliding_window_size:
        return 0, sink, ceil_div(sink, page_size), offset
    length_to_slide = new_seq_length - seq.sliding_window_size
    if seq.last_block_attn_sink_size > 0 and sink == 0:
        # First slide: pin the sinks where they are (TVM sets sink_length and the offset once).
        sink = offset = seq.last_block_attn_sink_size
    return length_to_slide, sink, ceil_div(sink, page_size), offset + length_to_slide


def simulate_reserve(
    seq: Sequence, block: Block, append_length: int, page_size: int, num_free: int, touched: set[int]
) -> tuple[int, int]:
    """Count what `reserve` would do to the free pages, without changing anything.

    Returns:
        ``(lowest, num_free_after)``: the lowest free-page count reached (negative: that many pages
        short) and the count afterwards.
    """
    cur = len(block.page_ids)
    need = max(ceil_div(block.num_used_slots + append_length, page_size) - cur, 0)
    real = min(need, max(num_free, 0))
    free = num_free - real
    lowest = free
    slide, _, num_sink_pages, window_slot = _slide_target(
        seq, block, seq.seq_length + append_length, page_size
    )
    erased_lo = num_sink_pages
    erased_hi = num_sink_pages + max(window_slot // page_size - num_sink_pages, 0) if slide else erased_lo
    # Page list after the append: [existing cur][real][temporary need - real]; erase [lo, hi).
    given_back = sum(1 for p in block.page_ids[erased_lo : min(erased_hi, cur)] if p not in touched)
    given_back += max(0, min(erased_hi, cur + real) - max(erased_lo, cur))
    erased_temp = max(0, min(erased_hi, cur + need) - max(erased_lo, cur + real))
    free += given_back - (need - real - erased_temp)
    return min(lowest, free), free


def gross_need(block: Block, append_length: int, page_size: int) -> int:
    """Pages a reservation takes before its slide gives any back (an upper bound of its demand)."""
    return max(ceil_div(block.num_used_slots + append_length, page_size) - len(block.page_ids), 0)


def reserve(pool: PagePool, seq: Sequence, block: Block, append_length: int, page_size: int) -> bool:
    """Grow a windowed sequence's last block by `append_length` positions, then slide (TVM order).

    New pages come from the free pages; when it is empty, temporary placeholders are borrowed and
    replaced after the slide gave pages back. The caller checked feasibility with `simulate_reserve`.

    Returns:
        Whether pages were removed from the block or borrowed (else new pages were only appended).
    """
    cur = len(block.page_ids)
    target = ceil_div(block.num_used_slots + append_length, page_size)
    borrowed = False
    for _ in range(cur, target):
        if pool.num_free == 0:
            block.page_ids.append(TEMP_PAGE_ID)
            borrowed = True
        else:
            block.page_ids.append(pool.take(1)[0])
    block.seq_length += append_length
    seq.seq_length += append_length
    erased = slide(pool, seq, block, page_size)
    if borrowed:
        for i, page in enumerate(block.page_ids):
            if page == TEMP_PAGE_ID:
                block.page_ids[i] = pool.take(1)[0]
    return borrowed or erased


def slide(pool: PagePool, seq: Sequence, block: Block, page_size: int) -> bool:
    """Slide `seq` back to its window size, freeing pages that hold only slid-off positions.

    Returns:
        Whether pages were removed from the block.
    """
    length_to_slide, sink, num_sink_pages, window_slot = _slide_target(seq, block, seq.seq_length, page_size)
    if length_to_slide == 0:
        return False
    if sink != block.sink_length:
        assert block.sliding_window_offset == 0, "a block's sinks are pinned only on its first slide"
        block.sink_length = block.sliding_window_offset = sink
    first_page, in_page = divmod(window_slot, page_size)
    erased = first_page > num_sink_pages
    if erased:
        pages = block.page_ids[num_sink_pages:first_page]
        del block.page_ids[num_sink_pages:first_page]
        pool.give(p for p in pages if p != TEMP_PAGE_ID)
        first_page = num_sink_pages
    assert first_page in (
        num_sink_pages - 1,
        num_sink_pages,
    ), "window starts in the last sink page or the next"
    seq.seq_length = seq.sliding_window_size
    block.seq_length -= length_to_slide
    block.sliding_window_offset = first_page * page_size + in_page
    assert block.seq_length >= block.sink_length, "a slide never eats into the sinks"
    assert ceil_div(block.num_used_slots, page_size) == len(block.page_ids), "pages cover used slots"
    return erased


def append_offsets(
    before: np.ndarray, pos_in_block: np.ndarray, sink: np.ndarray, window_start: np.ndarray
) -> np.ndarray:
    """In-block slot offsets of tokens just reserved, -1 for tokens that slid off unwritten.

    Args (all ``[T]`` int64, one entry per appended token of a windowed sequence):
        before: the token's in-block position counted before the slide (old length + j).
        pos_in_block: its in-block position after the slide (new length - append + j).
        sink: its block's `sink_length` after the reservation.
        window_start: its block's `sliding_window_offset` after the reservation.

    Returns:
        ``[T]`` int64 in-block slot offsets, TVM's three cases: written into the sinks (position
        still below the sinks), dropped (the window already slid past it), or in the window.
    """
    offsets = np.where(before < sink, before, pos_in_block - sink + window_start)
    return np.where((before >= sink) & (pos_in_block < sink), -1, offsets)


def position_offsets(positions: np.ndarray, prefix_length: int, block: Block) -> np.ndarray:
    """Page-table slot offsets (index into the sequence's pages * page_size) of in-cache positions."""
    if not block.slid:
        return positions
    cut = prefix_length + block.sink_length
    return np.where(positions < cut, positions, positions - block.sink_length + block.sliding_window_offset)


def truncated_used_slots(block: Block, new_length: int) -> int:
    """In-block slots a last block still uses once `popn` shrinks it to `new_length` positions.

    A slid block keeps its sinks and window offset while window positions remain; popped down to
    its sinks, it forgets that it slid (no hole left; the next slide pins the sinks again).
    """
    if block.slid and new_length > block.sink_length:
        return new_length - block.sink_length + block.sliding_window_offset
    return new_length


def truncate(block: Block, new_length: int) -> None:
    """Shrink the last block to `new_length` positions (its pages were trimmed by the caller)."""
    if block.slid and new_length <= block.sink_length:
        block.sink_length = block.sliding_window_offset = 0
    block.seq_length = new_length
