"""The prefix tree of the paged KV cache: blocks, sequences and the block pool (TVM's structures).

A *block* (TVM's `Block`) is a node of the prefix tree, never a synonym for page: a run of pages
holding consecutive positions, shared by every sequence below it. A sequence points at its last
block; walking `parent_idx` links up to -1 gives its block trace, oldest first. Owned and mutated
only by `disagg.cache.PagedKVCache`, in whichever process holds that cache.

Invariants (checked by `disagg.integrity.check_integrity`):
- `external_ref_cnt` of a live block = child blocks pointing at it + sequences ending at it;
  a sequence's last block has exactly 1 (only its own sequence), so only it is ever written.
- every block that is not the last of its trace is non-empty and holds whole pages
  (`seq_length % page_size == 0`), so positions and page-table indices agree on the prefix.
- `Sequence.table` is the concatenation of `page_ids` along the trace, kept incrementally so that
  `begin_forward` never walks blocks on the decode path.
"""

from __future__ import annotations

import numpy as np

# TVM's kPagedKVCacheTempPageId: a page borrowed by a sliding-window sequence while its slid-off
# pages are not released yet (only inside one reservation; never visible outside it).
TEMP_PAGE_ID = -1


class Block:
    """A node of the prefix tree: `seq_length` positions starting at `start_pos`, in `page_ids`.

    With a sliding window (last blocks only), in-block position i lives at in-block slot offset
    ``i`` when ``i < sink_length`` and ``i - sink_length + sliding_window_offset`` otherwise.
    """

    __slots__ = (
        "index",
        "page_ids",
        "seq_length",
        "start_pos",
        "sink_length",
        "sliding_window_offset",
        "parent_idx",
        "external_ref_cnt",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.reset()

    def reset(self) -> None:
        """Return the block to its freshly allocated state (TVM's `Block::Reset`)."""
        self.page_ids: list[int] = []
        self.seq_length = 0
        self.start_pos = 0
        self.sink_length = 0
        self.sliding_window_offset = 0
        self.parent_idx = -1
        self.external_ref_cnt = 0

    @property
    def slid(self) -> bool:
        """Whether the window has slid in this block (its slot offsets are no longer identity)."""
        return self.sink_length > 0 or self.sliding_window_offset > 0

    @property
    def num_used_slots(self) -> int:
        """In-block slot offsets in use, holes included: pages hold ceil(this / page_size)."""
        return self.seq_length - self.sink_length + self.sliding_window_offset

    def state(self) -> tuple:
        """Every field, for snapshots and equality in tests."""
        return (
            self.index,
            tuple(self.page_ids),
            self.seq_length,
            self.start_pos,
            self.sink_length,
            self.sliding_window_offset,
            self.parent_idx,
            self.external_ref_cnt,
        )


class SendState:
    """Where a sequence's KV goes (set by `disagg_mark_send`): positions >= `begin` -> `remote_slots`.

    Attributes:
        begin: first position sent.
        remote_slots: ``[M]`` int32 receiver slots for positions ``begin .. begin + M - 1``.
        recver_pe: the receiver's PE.
        num_pending: positions ``begin .. begin + num_pending - 1`` existed at the call and still
            wait to be copied page to page (reported by the next `begin_forward`).
        pending_local_slots: ``[num_pending]`` int32 local slots of those positions.
    """

    __slots__ = ("begin", "remote_slots", "recver_pe", "num_pending", "pending_local_slots")

    def __init__(self, begin: int, remote_slots: np.ndarray, recver_pe: int, local_slots: np.ndarray) -> None:
        self.begin = begin
        self.remote_slots = remote_slots
        self.recver_pe = recver_pe
        self.num_pending = int(local_slots.size)
        self.pending_local_slots = local_slots

    def pending_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(local_slots, remote_slots)`` [K] int32 of the pending copies, -1 remotes dropped."""
        local = self.pending_local_slots[: self.num_pending]
        remote = self.remote_slots[: self.num_pending]
        keep = remote >= 0
        return local[keep], remote[keep]

    def trim(self, seq_length: int) -> None:
        """Forget pending copies of positions >= `seq_length` (they were popped; pushes redo them)."""
        self.num_pending = max(0, min(self.num_pending, seq_length - self.begin))

    def state(self) -> tuple:
        """Every field, for snapshots and equality in tests."""
        return (
            self.begin,
            tuple(self.remote_slots.tolist()),
            self.recver_pe,
            tuple(self.pending_local_slots[: self.num_pending].tolist()),
        )


class Sequence:
    """One sequence: its last block, length and window settings, plus its cached page table.

    Attributes:
        seq_id: the caller's id.
        last_block_idx: index of the block new tokens go to.
        seq_length: positions held in the cache (for a sliding window: at most the window).
        sliding_window_size: -1 when the window is off.
        attn_sink_size: the sink size asked for (kept to recompute the next field).
        last_block_attn_sink_size: sink positions inside the last block, always
            ``max(attn_sink_size - prefix_length, 0)`` (prefix blocks are natural sinks).
        table: ``[num_pages]`` int32 page ids along the trace (a view of a growing buffer).
        send: where this sequence's KV goes, or None.
    """

    __slots__ = (
        "seq_id",
        "last_block_idx",
        "seq_length",
        "sliding_window_size",
        "attn_sink_size",
        "last_block_attn_sink_size",
        "table",
        "_table_buf",
        "send",
    )

    def __init__(self, seq_id: int, last_block_idx: int, seq_length: int, table: np.ndarray) -> None:
        self.seq_id = seq_id
        self.last_block_idx = last_block_idx
        self.seq_length = seq_length
        self.sliding_window_size = -1
        self.attn_sink_size = 0
        self.last_block_attn_sink_size = 0
        self.send: SendState | None = None
        self.set_table(table)

    @property
    def windowed(self) -> bool:
        return self.sliding_window_size > 0

    def set_table(self, pages: np.ndarray) -> None:
        """Replace the cached page table with ``pages`` ([n] ints), keeping spare capacity."""
        n = len(pages)
        self._table_buf = np.empty(max(16, 2 * n), dtype=np.int32)
        self._table_buf[:n] = pages
        self.table = self._table_buf[:n]

    def extend_table(self, pages: list[int]) -> None:
        """Append ``pages`` to the cached page table (amortized O(len(pages)))."""
        n, k = len(self.table), len(pages)
        if n + k > len(self._table_buf):
            buf = np.empty(2 * (n + k), dtype=np.int32)
            buf[:n] = self.table
            self._table_buf = buf
        self._table_buf[n : n + k] = pages
        self.table = self._table_buf[: n + k]

    def state(self) -> tuple:
        """Every field, for snapshots and equality in tests."""
        return (
            self.seq_id,
            self.last_block_idx,
            self.seq_length,
            self.sliding_window_size,
            self.attn_sink_size,
            self.last_block_attn_sink_size,
            tuple(self.table.tolist()),
            None if self.send is None else self.send.state(),
        )


class BlockPool:
    """Every block ever allocated plus a stack of free indices (TVM's `GetFreeBlock` order)."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.free_idx: list[int] = []

    def get(self) -> Block:
        """Return a reset block: the most recently freed one, else a new one."""
        if self.free_idx:
            block = self.blocks[self.free_idx.pop()]
            block.reset()
            return block
        block = Block(len(self.blocks))
        self.blocks.append(block)
        return block

    def release(self, block: Block) -> None:
        """Put `block` back on the free stack (its pages must have been released already)."""
        self.free_idx.append(block.index)

    def trace(self, last_block_idx: int) -> list[Block]:
        """Blocks from the root down to `last_block_idx`."""
        out = []
        idx = last_block_idx
        while idx != -1:
            block = self.blocks[idx]
            out.append(block)
            idx = block.parent_idx
        out.reverse()
        return out

    def trace_pages(self, last_block_idx: int) -> np.ndarray:
        """``[num_pages]`` int32 page ids along the trace ending at `last_block_idx`."""
        pages = [p for block in self.trace(last_block_idx) for p in block.page_ids]
        return np.asarray(pages, dtype=np.int32)

    def state(self) -> tuple:
        """Every live and free block, for snapshots and equality in tests."""
        return (tuple(b.state() for b in self.blocks), tuple(self.free_idx))
