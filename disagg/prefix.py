"""Prefix-tree surgery: TVM's RemoveSequence, ForkSequence and PopN on blocks and pages.

Functions here mutate the block pool, the page pool and one sequence; `disagg.cache` calls them
only after it has checked every argument and counted the pages needed, so they cannot fail
halfway. Partial-page copies that a fork needs are appended to the pending fork copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from disagg import sliding
from disagg.blocks import Block, BlockPool, Sequence
from disagg.pages import PagePool, ceil_div


def prefix_length(blocks: BlockPool, seq: Sequence) -> int:
    """Positions of `seq` held in blocks before its last one (all whole, unslid pages)."""
    return seq.seq_length - blocks.blocks[seq.last_block_idx].seq_length


def release_sequence(blocks: BlockPool, pool: PagePool, seq: Sequence) -> None:
    """Free the blocks and pages only `seq` holds; drop its reference on the first shared block."""
    idx = seq.last_block_idx
    while idx != -1 and blocks.blocks[idx].external_ref_cnt == 1:
        block = blocks.blocks[idx]
        pool.give(block.page_ids)
        blocks.release(block)
        idx = block.parent_idx
    if idx != -1:
        blocks.blocks[idx].external_ref_cnt -= 1


def fork_blocks(
    blocks: BlockPool,
    pool: PagePool,
    fork_copies: list[tuple[int, int, int]],
    parent: Sequence,
    fork_pos: int,
    page_size: int,
) -> Block:
    """TVM's ForkSequence on the block tree; returns the child's last block (reference count 1).

    Whole pages before `fork_pos` become shared (a block is split at a page boundary when the
    position falls inside it); the partial page at `fork_pos`, if any, is copied into one fresh
    page, recorded as ``(src_page, dst_page, num_slots)`` in `fork_copies`. The caller checked
    that a free page exists when ``fork_pos % page_size != 0``.
    """
    last = blocks.blocks[parent.last_block_idx]
    if fork_pos == parent.seq_length and fork_pos % page_size == 0 and last.seq_length > 0:
        # The parent keeps decoding into a new empty block; its full last block becomes shared.
        tail = blocks.get()
        tail.start_pos, tail.parent_idx, tail.external_ref_cnt = parent.seq_length, last.index, 1
        parent.last_block_idx = tail.index
    child = blocks.get()
    child.external_ref_cnt = 1
    trace = blocks.trace(parent.last_block_idx)
    offset = fork_pos
    for forked in trace:
        if forked is not trace[-1] and forked.seq_length <= offset:
            offset -= forked.seq_length
            continue
        in_page = offset % page_size
        moved = offset - in_page
        if moved == 0:
            if forked.parent_idx != -1:
                blocks.blocks[forked.parent_idx].external_ref_cnt += 1
            child.parent_idx = forked.parent_idx
        else:
            _split_block(blocks, forked, moved, child, page_size)
        child.start_pos = fork_pos - in_page
        child.seq_length = in_page
        if in_page:
            dst = pool.take(1)[0]
            child.page_ids.append(dst)
            fork_copies.append((forked.page_ids[0], dst, in_page))
        return child
    raise AssertionError("a fork position within the parent's length falls in one of its blocks")


def _split_block(blocks: BlockPool, forked: Block, moved: int, child: Block, page_size: int) -> None:
    """Move the first `moved` positions (whole pages) of `forked` into a new block shared with `child`."""
    head = blocks.get()
    num_moved_pages = moved // page_size
    head.parent_idx = forked.parent_idx
    forked.parent_idx = head.index
    child.parent_idx = head.index
    head.external_ref_cnt = 2
    head.page_ids = forked.page_ids[:num_moved_pages]
    del forked.page_ids[:num_moved_pages]
    head.start_pos = forked.start_pos
    forked.start_pos += moved
    head.seq_length = moved
    forked.seq_length -= moved
    if forked.slid:
        # Only a windowed parent's last block slides, and it forks within its sinks: the sinks
        # and the window start move with the positions (TVM leaves them in place).
        assert moved <= forked.sink_length, "a windowed parent forks within its sinks"
        forked.sink_length -= moved
        forked.sliding_window_offset -= moved


@dataclass
class PopSteps:
    """What `popn` will do, worked out before anything changes.

    Attributes:
        freed: blocks freed whole, last block first.
        truncated: the block the sequence ends in afterwards, when it is private.
        new_length: that block's length afterwards.
        kept_pages: that block's page count afterwards.
        remaining: positions still to pop inside a shared block (then a fork is needed).
    """

    freed: list[Block] = field(default_factory=list)
    truncated: Block | None = None
    new_length: int = 0
    kept_pages: int = 0
    remaining: int = 0

    def freed_pages(self) -> list[int]:
        """Pages the pop gives back, in the order they are given back."""
        pages = [p for block in self.freed for p in block.page_ids]
        if self.truncated is not None:
            pages += reversed(self.truncated.page_ids[self.kept_pages :])
        return pages


def pop_steps(blocks: BlockPool, seq: Sequence, n: int, page_size: int) -> PopSteps:
    """Walk up from the last block as TVM's PopN does, without changing anything."""
    steps = PopSteps(remaining=n)
    idx = seq.last_block_idx
    while idx != -1 and blocks.blocks[idx].external_ref_cnt == 1:
        block = blocks.blocks[idx]
        if steps.remaining > block.seq_length:
            steps.remaining -= block.seq_length
            steps.freed.append(block)
            idx = block.parent_idx
            continue
        steps.truncated = block
        steps.new_length = block.seq_length - steps.remaining
        steps.kept_pages = ceil_div(sliding.truncated_used_slots(block, steps.new_length), page_size)
        steps.remaining = 0
        break
    return steps


def commit_pop(
    blocks: BlockPool,
    pool: PagePool,
    fork_copies: list[tuple[int, int, int]],
    seq: Sequence,
    steps: PopSteps,
    page_size: int,
) -> None:
    """Carry out the `PopSteps`: free, truncate, or fork a private copy of a shared partial page."""
    old_table = seq.table
    for block in steps.freed:
        pool.give(block.page_ids)
        blocks.release(block)
        seq.seq_length -= block.seq_length
    num_kept = len(old_table) - sum(len(b.page_ids) for b in steps.freed)
    if steps.truncated is not None:
        block = steps.truncated
        pool.give(reversed(block.page_ids[steps.kept_pages :]))
        num_kept -= len(block.page_ids) - steps.kept_pages
        del block.page_ids[steps.kept_pages :]
        seq.seq_length -= block.seq_length - steps.new_length
        sliding.truncate(block, steps.new_length)
        seq.last_block_idx = block.index
        seq.set_table(old_table[:num_kept])
    elif steps.remaining:
        # TVM forks the shared prefix at the new length and removes the old sequence; the same
        # happens here in place: the child's block becomes the sequence's last block, and the
        # freed block's reference on the shared block goes away.
        shared = blocks.blocks[steps.freed[-1].parent_idx]
        seq.last_block_idx = shared.index
        fork_pos = seq.seq_length - steps.remaining
        child = fork_blocks(blocks, pool, fork_copies, seq, fork_pos, page_size)
        shared.external_ref_cnt -= 1
        seq.last_block_idx = child.index
        seq.seq_length = fork_pos
        own_pages = np.asarray(child.page_ids, dtype=np.int32)
        seq.set_table(np.concatenate((old_table[: fork_pos // page_size], own_pages)))
