"""`PagedKVCache`: page-table bookkeeping with TVM's `PagedAttentionKVCacheObj` semantics.

Pure Python + numpy. Every worker (prefill, decode, colocated) owns one per KV allocation, in its
own process; the router may keep one to plan. It decides which page and slot each token's K/V
occupies and returns `ForwardPlan`s; it never touches KV memory, so every copy it needs is
*reported* (in the next plan) and never assumed done. Prefix tree, page pool and windows live in
`disagg.blocks`, `disagg.pages` and `disagg.sliding`; plan arrays in `disagg.forward`.

Decisions where TVM and DESIGN.md are silent:
- Every call that changes state needs the forward closed (ForwardStateError otherwise), so pages
  that an open plan writes are never freed or handed out under it.
- A failed call changes nothing: each operation checks everything (ids, lengths, maps, pages)
  before it mutates. Page ids follow TVM's free stack exactly, except that a page touched by a
  pending copy is parked until that copy has run (see `disagg.pages`).
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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceLike

import numpy as np

from disagg import forward, posmap, sliding
from disagg.blocks import Block, BlockPool, Sequence, SendState
from disagg.errors import CacheError, ForwardStateError, OutOfPages, PositionMapError, SequenceExists, SequenceNotFound
from disagg.pages import PagePool
from disagg.plan import ForwardPlan

logger = logging.getLogger(__name__)


def _as_int(value: object, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CacheError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return int(value)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """Pages, prefix sharing, sliding windows and disaggregated sends for many sequences.

    Args:
        num_pages: pages in the KV allocation (>= 1).
        page_size: tokens per page (>= 1).

    Raises:
        CacheError: either argument is not a positive int.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
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
        self._fork_copies: list[tuple[int, int, int]] = []
        self._open: str | None = None

    # ---------------------------------------------------------------- queries

    @property
    def num_free_pages(self) -> int:
        """Pages that the next reservation can take (parked pages excluded)."""
        return self._pool.num_free

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_length(self, seq_id: int) -> int:
        """Tokens of `seq_id` held in the cache (for a sliding window, at most the window)."""
        return self._get(seq_id, "seq_length").seq_length

    def slots(self, seq_id: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Slots of positions ``start .. end - 1`` of `seq_id`.

        Returns:
            ``[end - start]`` int32, ``page_id * page_size + offset``.

        Raises:
            SequenceNotFound: unknown id. CacheError: not ``0 <= start <= end <= seq_length``.
        """
        seq = self._get(seq_id, "slots")
        end = seq.seq_length if end is None else _as_int(end, "end")
        start = _as_int(start, "start")
        if not 0 <= start <= end <= seq.seq_length:
            raise CacheError(
                f"slots: sequence {seq_id} holds {seq.seq_length} tokens; expected "
                f"0 <= start <= end <= {seq.seq_length}, got start={start}, end={end}"
            )
        return self._position_slots(seq, np.arange(start, end, dtype=np.int64))

    def check_integrity(self) -> None:
        """Raise `CacheIntegrityError` if any invariant is broken (see `disagg.integrity`)."""
        from disagg.integrity import check_integrity

        check_integrity(self)

    # ------------------------------------------------------ sequence management

    def add_sequence(self, seq_id: int) -> None:
        """Add an empty sequence. Raises SequenceExists, CacheError (bad id), ForwardStateError."""
        self._require_closed("add_sequence")
        seq_id = _as_int(seq_id, "seq_id")
        if seq_id in self._seqs:
            raise SequenceExists(f"add_sequence: sequence {seq_id} is already in the cache")
        block = self._blocks.get()
        block.external_ref_cnt = 1
        self._seqs[seq_id] = Sequence(seq_id, block.index, 0, np.empty(0, dtype=np.int32))

    def remove_sequence(self, seq_id: int) -> None:
        """Remove a sequence, free the pages only it held, and drop its unsent copies."""
        self._require_closed("remove_sequence")
        seq = self._get(seq_id, "remove_sequence")
        blocks = self._blocks.blocks
        idx = seq.last_block_idx
        while idx != -1 and blocks[idx].external_ref_cnt == 1:
            block = blocks[idx]
            self._pool.give(block.page_ids)
            self._blocks.release(block)
            idx = block.parent_idx
        if idx != -1:
            blocks[idx].external_ref_cnt -= 1
        del self._seqs[seq.seq_id]
        self._windowed.discard(seq.seq_id)
        self._senders.pop(seq.seq_id, None)
        self._copies_changed()

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
            raise OutOfPages(
                f"fork_sequence: forking {parent.seq_id} at {fork_pos} copies a partial page and "
                "needs 1 free page; none is free",
                num_needed=1,
                num_free=0,
            )
        table = parent.table[: fork_pos // self.page_size]
        child_block = self._fork_blocks(parent, fork_pos)
        child = Sequence(child_id, child_block.index, fork_pos, np.concatenate((table, child_block.page_ids)))
        self._seqs[child_id] = child
        self._refresh_sinks(parent)
        self._copies_changed()

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
        freed, truncated, remaining = self._plan_pop(seq, n)
        fork_pos = seq.seq_length - n
        if remaining and fork_pos % self.page_size:
            gone = [p for block in freed for p in block.page_ids]
            if truncated is not None:
                gone += truncated[0].page_ids[truncated[2] :]
            if self._pool.num_free + self._pool.num_untouched(gone) < 1:
                raise OutOfPages(
                    f"popn: sequence {seq.seq_id} pops into a shared page at position {fork_pos}, "
                    "which must be copied; it needs 1 free page and none is free",
                    num_needed=1,
                    num_free=self._pool.num_free,
                )
        self._commit_pop(seq, n, freed, truncated, remaining)
        if seq.send is not None:
            seq.send.trim(seq.seq_length)
        self._copies_changed()

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
        prefix = self._prefix_length(seq)
        if not 0 <= sink_size < window_size or window_size <= prefix:
            raise CacheError(
                f"enable_sliding_window: sequence {seq.seq_id} (shared prefix {prefix}); expected "
                f"0 <= sink_size < window_size and window_size > {prefix}, got "
                f"window_size={window_size}, sink_size={sink_size}"
            )
        if seq.windowed:
            raise CacheError(
                f"enable_sliding_window: sequence {seq.seq_id} already has a window of {seq.sliding_window_size}"
            )
        if seq.send is not None:
            raise CacheError(f"enable_sliding_window: sequence {seq.seq_id} is marked for sending")
        seq.sliding_window_size = window_size
        seq.attn_sink_size = sink_size
        seq.last_block_attn_sink_size = max(sink_size - prefix, 0)
        self._windowed.add(seq.seq_id)

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
        ids, lens = self._check_batch(seq_ids, append_lengths)
        seqs = [self._get(i, "begin_forward") for i in ids]
        self._check_send_room(seqs, lens)
        len_before, windowed = self._reserve(seqs, lens, "begin_forward")
        plan = self._build_plan(ids, seqs, lens, len_before, windowed, drain=True)
        self._open = "begin_forward"
        return plan

    def end_forward(self) -> None:
        """Close the open forward (or `disagg_prepare_recv`); parked pages whose copies ran are freed."""
        if self._open is None:
            raise ForwardStateError("end_forward: no forward is open; call begin_forward first")
        self._open = None
        self._pool.release_deferred()

    def disagg_prepare_recv(self, seq_id: int, append_length: int) -> list[int]:
        """Receiver: reserve `append_length` slots at the end of `seq_id` and return their map.

        A one-sequence `begin_forward` whose plan is not returned: close it with `end_forward`.
        Pending fork copies stay pending for the next `begin_forward`.

        Returns:
            The compressed map of the reserved slots (`disagg.posmap` format).

        Raises:
            ForwardStateError, SequenceNotFound, CacheError (bad length, the sequence is marked for
            sending, or a reserved slot is still read or written by a pending copy), OutOfPages.
        """
        self._require_closed("disagg_prepare_recv")
        seq = self._get(seq_id, "disagg_prepare_recv")
        length = _as_int(append_length, "append_length")
        if length < 1:
            raise CacheError(f"disagg_prepare_recv: sequence {seq.seq_id}: expected append_length >= 1, got {length}")
        if seq.send is not None:
            raise CacheError(f"disagg_prepare_recv: sequence {seq.seq_id} is marked for sending; it cannot receive")
        self._check_no_copy_overlap(seq)
        lens = np.array([length], dtype=np.int64)
        len_before, windowed = self._reserve([seq], lens, "disagg_prepare_recv")
        plan = self._build_plan([seq.seq_id], [seq], lens, len_before, windowed, drain=False)
        self._open = "disagg_prepare_recv"
        return posmap.compress(plan.append_slots)

    def disagg_mark_send(self, seq_id: int, begin: int, cmap: SequenceLike[int], recver_pe: int) -> None:
        """Sender: positions >= `begin` of `seq_id` go to the slots of `cmap` on PE `recver_pe`.

        Tokens that exist now (``begin .. seq_length - 1``) are copied page to page by the next
        plan (whether or not the sequence is in its batch); later tokens are pushed as appended.

        Raises:
            ForwardStateError, SequenceNotFound, CacheError (bad begin or PE, windowed sequence),
            PositionMapError (malformed or empty map, or shorter than the existing tokens).
        """
        self._require_closed("disagg_mark_send")
        seq = self._get(seq_id, "disagg_mark_send")
        begin = _as_int(begin, "begin")
        recver_pe = _as_int(recver_pe, "recver_pe")
        if begin < 0 or recver_pe < 0:
            raise CacheError(
                f"disagg_mark_send: sequence {seq.seq_id}: expected begin >= 0 and recver_pe >= 0, "
                f"got begin={begin}, recver_pe={recver_pe}"
            )
        if seq.windowed:
            raise CacheError(f"disagg_mark_send: sequence {seq.seq_id} has a sliding window; it cannot send")
        remote = posmap.decompress(cmap)
        existing = max(seq.seq_length - begin, 0)
        if remote.size == 0 or remote.size < existing:
            raise PositionMapError(
                f"disagg_mark_send: sequence {seq.seq_id} holds {seq.seq_length} tokens, {existing} "
                f"of them from begin={begin}; the map must cover at least max(that, 1) tokens, "
                f"got {remote.size}"
            )
        local = self._position_slots(seq, np.arange(begin, begin + existing, dtype=np.int64))
        self._senders.pop(seq.seq_id, None)
        seq.send = SendState(begin, remote, recver_pe, local)
        self._senders[seq.seq_id] = seq
        self._copies_changed()

    # ------------------------------------------------------------ internals

    def _require_closed(self, op: str) -> None:
        if self._open is not None:
            raise ForwardStateError(f"{op}: a forward ({self._open}) is still open; call end_forward first")

    def _get(self, seq_id: object, op: str) -> Sequence:
        seq = self._seqs.get(seq_id)  # type: ignore[arg-type]
        if seq is None:
            _as_int(seq_id, "seq_id")
            raise SequenceNotFound(f"{op}: sequence {seq_id} is not in the cache")
        return seq

    def _prefix_length(self, seq: Sequence) -> int:
        return seq.seq_length - self._blocks.blocks[seq.last_block_idx].seq_length

    def _position_slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        block = self._blocks.blocks[seq.last_block_idx]
        offsets = sliding.position_offsets(positions, self._prefix_length(seq), block)
        slots = seq.table[offsets // self.page_size].astype(np.int64) * self.page_size + offsets % self.page_size
        return slots.astype(np.int32)

    def _check_batch(self, seq_ids: SequenceLike[int], append_lengths: SequenceLike[int]) -> tuple[list[int], np.ndarray]:
        ids = np.asarray(seq_ids)
        lens = np.asarray(append_lengths)
        if ids.ndim != 1 or lens.ndim != 1 or ids.size != lens.size:
            raise CacheError(
                f"begin_forward: expected seq_ids and append_lengths of one equal length, got shapes "
                f"{ids.shape} and {lens.shape}"
            )
        if ids.size == 0:
            return [], np.zeros(0, dtype=np.int64)
        if ids.dtype.kind not in "iu" or lens.dtype.kind not in "iu":
            raise CacheError(f"begin_forward: expected integer ids and lengths, got dtypes {ids.dtype} and {lens.dtype}")
        lens = lens.astype(np.int64)
        if lens.min() < 1:
            i = int(np.argmin(lens))
            raise CacheError(f"begin_forward: sequence {ids[i]}: expected append length >= 1, got {lens[i]}")
        id_list = ids.tolist()
        if len(set(id_list)) != len(id_list):
            values, counts = np.unique(ids, return_counts=True)
            raise CacheError(f"begin_forward: a batch names each sequence once; {values[counts > 1].tolist()} repeat")
        return id_list, lens

    def _check_send_room(self, seqs: list[Sequence], lens: np.ndarray) -> None:
        if not self._senders:
            return
        for i, seq in enumerate(seqs):
            send = seq.send
            if send is not None and seq.seq_length + int(lens[i]) - send.begin > len(send.remote_slots):
                raise PositionMapError(
                    f"begin_forward: sequence {seq.seq_id} would push positions up to "
                    f"{seq.seq_length + int(lens[i]) - 1}, but its map (begin={send.begin}) covers "
                    f"{len(send.remote_slots)} tokens, up to position {send.begin + len(send.remote_slots) - 1}"
                )

    def _reserve(self, seqs: list[Sequence], lens: np.ndarray, op: str) -> tuple[np.ndarray, list[forward.WindowedAppend]]:
        """Check pages for the whole batch, then reserve (TVM order). Returns lengths before and windows."""
        page_size, blocks, pool = self.page_size, self._blocks.blocks, self._pool
        len_before = np.fromiter((s.seq_length for s in seqs), dtype=np.int64, count=len(seqs))
        num_pages = np.fromiter((len(s.table) for s in seqs), dtype=np.int64, count=len(seqs))
        need = (len_before + lens + page_size - 1) // page_size - num_pages
        lens_list = lens.tolist()
        if not (self._windowed and any(s.windowed for s in seqs)):
            total = int(need.sum())
            if total > pool.num_free:
                raise OutOfPages(
                    f"{op}: the batch needs {total} new pages, {pool.num_free} are free",
                    num_needed=total,
                    num_free=pool.num_free,
                )
            taken = pool.take(total)
            at = 0
            for i in np.flatnonzero(need).tolist():
                seq, k = seqs[i], int(need[i])
                blocks[seq.last_block_idx].page_ids.extend(taken[at : at + k])
                seq.extend_table(taken[at : at + k])
                at += k
            for seq, length in zip(seqs, lens_list):
                seq.seq_length += length
                blocks[seq.last_block_idx].seq_length += length
            return len_before, []
        self._check_windowed_pages(seqs, lens_list, need.tolist(), op)
        return len_before, self._reserve_in_order(seqs, lens_list, need.tolist())

    def _check_windowed_pages(self, seqs: list[Sequence], lens: list[int], need: list[int], op: str) -> None:
        free = lowest = self._pool.num_free
        for seq, length, k in zip(seqs, lens, need):
            if seq.windowed:
                block = self._blocks.blocks[seq.last_block_idx]
                low, free = sliding.simulate_reserve(seq, block, length, self.page_size, free, self._pool.touched)
                lowest = min(lowest, low)
            else:
                free -= k
                lowest = min(lowest, free)
        if lowest < 0:
            raise OutOfPages(
                f"{op}: the batch needs {self._pool.num_free - lowest} pages at its peak, "
                f"{self._pool.num_free} are free",
                num_needed=self._pool.num_free - lowest,
                num_free=self._pool.num_free,
            )

    def _reserve_in_order(self, seqs: list[Sequence], lens: list[int], need: list[int]) -> list[forward.WindowedAppend]:
        windowed = []
        blocks = self._blocks.blocks
        for i, (seq, length, k) in enumerate(zip(seqs, lens, need)):
            block = blocks[seq.last_block_idx]
            if not seq.windowed:
                pages = self._pool.take(k)
                block.page_ids.extend(pages)
                seq.extend_table(pages)
                seq.seq_length += length
                block.seq_length += length
                continue
            prefix_pages = len(seq.table) - len(block.page_ids)
            windowed.append(forward.WindowedAppend(i, block, prefix_pages, block.seq_length))
            sliding.reserve(self._pool, seq, block, length, self.page_size)
            seq.set_table(np.concatenate((seq.table[:prefix_pages], np.asarray(block.page_ids, dtype=np.int32))))
        return windowed

    def _build_plan(
        self,
        ids: list[int],
        seqs: list[Sequence],
        lens: np.ndarray,
        len_before: np.ndarray,
        windowed: list[forward.WindowedAppend],
        drain: bool,
    ) -> ForwardPlan:
        page_size, batch = self.page_size, len(seqs)
        qo_indptr = np.zeros(batch + 1, dtype=np.int32)
        np.cumsum(lens, out=qo_indptr[1:])
        page_indptr, page_indices, last_page_len = forward.page_tables(seqs, len_before + lens, page_size)
        slots, positions = forward.append_slots(qo_indptr, lens, len_before, page_indptr, page_indices, page_size)
        sink_size = np.zeros(batch, dtype=np.int32)
        window_offset = np.zeros(batch, dtype=np.int32)
        if windowed:
            forward.fix_windowed(windowed, seqs, qo_indptr, page_size, slots, last_page_len, sink_size, window_offset)
        num_tokens = int(qo_indptr[-1])
        push_slots = np.full(num_tokens, -1, dtype=np.int32)
        push_pes = np.full(num_tokens, -1, dtype=np.int32)
        pushed = {}
        if self._senders:
            send_index = {sid: i for i, sid in enumerate(ids) if sid in self._senders}
            pushed = forward.push_targets(send_index, self._senders, qo_indptr, positions, push_slots, push_pes)
        copies = self._drain_copies(pushed) if drain else _empty_copies(pushed)
        return ForwardPlan(
            seq_ids=tuple(ids),
            qo_indptr=qo_indptr,
            page_indptr=page_indptr,
            page_indices=page_indices,
            last_page_len=last_page_len,
            append_slots=slots,
            positions=positions,
            push_slots=push_slots,
            push_pes=push_pes,
            sink_size=sink_size,
            sliding_window_offset=window_offset,
            **copies,
        )

    def _drain_copies(self, pushed: dict[int, bool]) -> dict[str, np.ndarray]:
        """Move every pending copy into plan arrays and forget it (its pages stay parked until end_forward)."""
        fork_src, fork_dst = forward.fork_copy_slots(self._fork_copies, self.page_size)
        self._fork_copies = []
        local, remote, pes = [], [], []
        send_ids, send_pes, complete = [], [], []
        for seq_id, seq in self._senders.items():
            send = seq.send
            copied = send.num_pending > 0
            if copied:
                loc, rem = send.pending_copies()
                local.append(loc)
                remote.append(rem)
                pes.append(np.full(loc.size, send.recver_pe, dtype=np.int32))
            if copied or seq_id in pushed:
                send_ids.append(seq_id)
                send_pes.append(send.recver_pe)
                complete.append(pushed.get(seq_id, False) or send.num_pending == len(send.remote_slots))
            send.num_pending = 0
        self._pool.touched = set()
        return {
            "copy_local_slots": _cat(local),
            "copy_remote_slots": _cat(remote),
            "copy_pes": _cat(pes),
            "fork_src_slots": fork_src,
            "fork_dst_slots": fork_dst,
            "send_seq_ids": np.asarray(send_ids, dtype=np.int64),
            "send_pes": np.asarray(send_pes, dtype=np.int32),
            "send_complete": np.asarray(complete, dtype=bool),
        }

    def _copies_changed(self) -> None:
        """Drop copies nobody can observe, recompute the touched pages, free unparked pages."""
        deferred = self._pool.deferred
        kept, read = [], set()
        for src, dst, length in reversed(self._fork_copies):
            if dst not in deferred or dst in read:
                kept.append((src, dst, length))
                read.add(src)
        kept.reverse()
        if len(kept) != len(self._fork_copies):
            logger.debug("dropped %d fork copies into freed pages", len(self._fork_copies) - len(kept))
        self._fork_copies = kept
        touched = {page for src, dst, _ in kept for page in (src, dst)}
        for seq in self._senders.values():
            local, _ = seq.send.pending_copies()
            touched.update((local // self.page_size).tolist())
        self._pool.touched = touched
        self._pool.release_deferred()

    def _check_no_copy_overlap(self, seq: Sequence) -> None:
        """Refuse to let a receiver write a slot that a pending copy still reads or writes."""
        if not self._pool.touched or not len(seq.table):
            return
        block = self._blocks.blocks[seq.last_block_idx]
        used = (len(seq.table) - len(block.page_ids)) * self.page_size + block.num_used_slots
        last_page = int(seq.table[-1])
        if used % self.page_size == 0 or last_page not in self._pool.touched:
            return
        open_slots = set(range(last_page * self.page_size + used % self.page_size, (last_page + 1) * self.page_size))
        fork_src, fork_dst = forward.fork_copy_slots(self._fork_copies, self.page_size)
        busy = set(fork_src.tolist()) | set(fork_dst.tolist())
        for other in self._senders.values():
            busy.update(other.send.pending_copies()[0].tolist())
        clash = sorted(open_slots & busy)
        if clash:
            raise CacheError(
                f"disagg_prepare_recv: sequence {seq.seq_id} would receive into slots {clash[:4]}"
                f"{'...' if len(clash) > 4 else ''} that a pending copy still uses; run a "
                "begin_forward first to drain it"
            )

    def _plan_pop(self, seq: Sequence, n: int) -> tuple[list[Block], tuple[Block, int, int] | None, int]:
        """Dry run of `popn`: blocks freed whole, (block, new length, pages kept) truncated, tokens left."""
        blocks, page_size = self._blocks.blocks, self.page_size
        freed, remaining, idx = [], n, seq.last_block_idx
        while idx != -1 and blocks[idx].external_ref_cnt == 1:
            block = blocks[idx]
            if remaining > block.seq_length:
                remaining -= block.seq_length
                freed.append(block)
                idx = block.parent_idx
                continue
            new_length = block.seq_length - remaining
            used = sliding.truncated_used_slots(block, new_length)
            return freed, (block, new_length, _ceil_div(used, page_size)), 0
        return freed, None, remaining

    def _commit_pop(self, seq: Sequence, n: int, freed: list[Block], truncated: tuple | None, remaining: int) -> None:
        old_table = seq.table
        for block in freed:
            self._pool.give(block.page_ids)
            self._blocks.release(block)
            seq.seq_length -= block.seq_length
        if truncated is not None:
            block, new_length, keep = truncated
            self._pool.give(reversed(block.page_ids[keep:]))
            dropped = len(block.page_ids) - keep
            del block.page_ids[keep:]
            seq.seq_length -= block.seq_length - new_length
            sliding.truncate(block, new_length)
            seq.last_block_idx = block.index
            num_kept = len(old_table) - sum(len(b.page_ids) for b in freed) - dropped
            seq.set_table(old_table[:num_kept])
        elif remaining:
            shared = self._blocks.blocks[freed[-1].parent_idx]
            seq.last_block_idx = shared.index
            fork_pos = seq.seq_length - remaining
            child = self._fork_blocks(seq, fork_pos)
            shared.external_ref_cnt -= 1  # the freed child block's reference, as TVM's RemoveSequence
            seq.last_block_idx = child.index
            seq.seq_length = fork_pos
            seq.set_table(np.concatenate((old_table[: fork_pos // self.page_size], child.page_ids)))
        self._refresh_sinks(seq)

    def _refresh_sinks(self, seq: Sequence) -> None:
        """Prefix blocks are natural sinks: the last block pins only the sinks they leave over."""
        if seq.windowed:
            seq.last_block_attn_sink_size = max(seq.attn_sink_size - self._prefix_length(seq), 0)

    def _fork_blocks(self, parent: Sequence, fork_pos: int) -> Block:
        """TVM's ForkSequence on the block tree; returns the child's block (reference count 1)."""
        blocks, page_size = self._blocks.blocks, self.page_size
        last = blocks[parent.last_block_idx]
        if fork_pos == parent.seq_length and fork_pos % page_size == 0 and last.seq_length > 0:
            # The parent keeps decoding into a new empty block; the full one becomes shared.
            tail = self._blocks.get()
            tail.start_pos, tail.parent_idx, tail.external_ref_cnt = parent.seq_length, last.index, 1
            parent.last_block_idx = tail.index
        child = self._blocks.get()
        child.external_ref_cnt = 1
        trace = self._blocks.trace(parent.last_block_idx)
        offset = fork_pos
        for forked in trace:
            if forked is not trace[-1] and forked.seq_length <= offset:
                offset -= forked.seq_length
                continue
            in_page = offset % page_size
            moved = offset - in_page
            if moved == 0:
                if forked.parent_idx != -1:
                    blocks[forked.parent_idx].external_ref_cnt += 1
                child.parent_idx = forked.parent_idx
            else:
                self._split_block(parent, forked, moved, child)
            child.start_pos = fork_pos - in_page
            child.seq_length = in_page
            if in_page:
                dst = self._pool.take(1)[0]
                child.page_ids.append(dst)
                self._fork_copies.append((forked.page_ids[0], dst, in_page))
            return child
        raise AssertionError("a fork position within the parent's length falls in one of its blocks")

    def _split_block(self, parent: Sequence, forked: Block, moved: int, child: Block) -> None:
        """Move the first `moved` positions (whole pages) of `forked` into a new shared parent block."""
        head = self._blocks.get()
        num_moved_pages = moved // self.page_size
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


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, dtype=np.int32)


def _empty_copies(pushed: dict[int, bool]) -> dict[str, np.ndarray]:
    empty = np.empty(0, dtype=np.int32)
    return {
        "copy_local_slots": empty,
        "copy_remote_slots": empty,
        "copy_pes": empty,
        "fork_src_slots": empty,
        "fork_dst_slots": empty,
        "send_seq_ids": np.empty(0, dtype=np.int64),
        "send_pes": empty,
        "send_complete": np.empty(0, dtype=bool),
    }
