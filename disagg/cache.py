"""`PagedKVCache`: page-table bookkeeping with TVM's `PagedAttentionKVCacheObj` semantics.

Pure Python + numpy. Every worker (prefill, decode, colocated) owns one per KV allocation, in its
own process; the router may keep one to plan. It decides which page and slot each token's K/V
occupies and returns `ForwardPlan`s; it never touches KV memory, so every copy it needs is
*reported* (in the next plan) and never assumed done. Prefix tree, page pool and windows live in
`disagg.blocks` / `disagg.prefix`, `disagg.pages` and `disagg.sliding`; reservation in
`disagg.reserve`, plan arrays in `disagg.forward`, pending copies in `disagg.copies`.

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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceLike

import numpy as np

from disagg import forward, integrity, posmap, prefix, sliding
from disagg.blocks import BlockPool, Sequence, SendState
from disagg.copies import PendingCopies
from disagg.errors import (
    CacheError,
    ForwardStateError,
    OutOfPages,
    PositionMapError,
    SequenceExists,
    SequenceNotFound,
)
from disagg.pages import PagePool
from disagg.plan import ForwardPlan
from disagg.reserve import reserve_batch

logger = logging.getLogger(__name__)


def _as_int(value: object, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CacheError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return int(value)


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
        self._copies = PendingCopies(self._pool, self.page_size)
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
        integrity.check_integrity(self)

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
        prefix.release_sequence(self._blocks, self._pool, seq)
        del self._seqs[seq.seq_id]
        self._windowed.discard(seq.seq_id)
        self._senders.pop(seq.seq_id, None)
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
        child_block = prefix.fork_blocks(
            self._blocks, self._pool, self._copies.fork, parent, fork_pos, self.page_size
        )
        own_pages = np.asarray(child_block.page_ids, dtype=np.int32)
        child = Sequence(child_id, child_block.index, fork_pos, np.concatenate((table, own_pages)))
        self._seqs[child_id] = child
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
        plan = prefix.plan_pop(self._blocks, seq, n, self.page_size)
        fork_pos = seq.seq_length - n
        if plan.remaining and fork_pos % self.page_size:
            if self._pool.num_free + self._pool.num_untouched(plan.freed_pages()) < 1:
                raise OutOfPages(
                    f"popn: sequence {seq.seq_id} pops into a shared page at position {fork_pos}, "
                    "which must be copied; it needs 1 free page and none is free",
                    num_needed=1,
                    num_free=self._pool.num_free,
                )
        prefix.commit_pop(self._blocks, self._pool, self._copies.fork, seq, plan, self.page_size)
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
        len_before, windowed = reserve_batch(
            self._blocks, self._pool, seqs, lens, self.page_size, "begin_forward"
        )
        plan = forward.build_plan(
            ids, seqs, lens, len_before, windowed, self.page_size, self._senders, self._copies
        )
        self._open = "begin_forward"
        return plan

    def append_without_plan(self, seq_ids: SequenceLike[int], append_lengths: SequenceLike[int]) -> None:
        """`begin_forward` + `end_forward` for a forward that computes nothing: the batch's slots
        are reserved (pages taken exactly as `begin_forward` takes them) and no plan is built.
        The simulator's forward (`disagg.cluster.simulate`); refused while fork copies or sends
        are pending, since only a plan carries those out.

        Raises:
            ForwardStateError, SequenceNotFound, CacheError (bad batch, pending copies or
            sends), OutOfPages. State unchanged.
        """
        self._require_closed("append_without_plan")
        if self._senders or self._copies.fork:
            raise CacheError("append_without_plan: copies or sends are pending; they need begin_forward's plan")
        ids, lens = self._check_batch(seq_ids, append_lengths)
        seqs = [self._get(i, "append_without_plan") for i in ids]
        reserve_batch(self._blocks, self._pool, seqs, lens, self.page_size, "append_without_plan")
        self._pool.release_deferred()

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
            raise CacheError(
                f"disagg_prepare_recv: sequence {seq.seq_id}: expected append_length >= 1, got {length}"
            )
        if seq.send is not None:
            raise CacheError(
                f"disagg_prepare_recv: sequence {seq.seq_id} is marked for sending; it cannot receive"
            )
        self._check_no_copy_overlap(seq)
        lens = np.array([length], dtype=np.int64)
        len_before, windowed = reserve_batch(
            self._blocks, self._pool, [seq], lens, self.page_size, "disagg_prepare_recv"
        )
        plan = forward.build_plan([seq.seq_id], [seq], lens, len_before, windowed, self.page_size, {}, None)
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
        self._copies.refresh(self._senders)

    # ------------------------------------------------------------ internals

    def _require_closed(self, op: str) -> None:
        if self._open is not None:
            raise ForwardStateError(f"{op}: a forward ({self._open}) is still open; call end_forward first")

    def _get(self, seq_id: object, op: str) -> Sequence:
        try:
            seq = self._seqs.get(seq_id)  # type: ignore[arg-type]
        except TypeError:
            seq = None
        if seq is None:
            _as_int(seq_id, "seq_id")
            raise SequenceNotFound(f"{op}: sequence {seq_id} is not in the cache")
        return seq

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

    def _check_batch(
        self, seq_ids: SequenceLike[int], append_lengths: SequenceLike[int]
    ) -> tuple[list[int], np.ndarray]:
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
            raise CacheError(
                f"begin_forward: expected integer ids and lengths, got dtypes {ids.dtype} and {lens.dtype}"
            )
        lens = lens.astype(np.int64)
        if lens.min() < 1:
            i = int(np.argmin(lens))
            raise CacheError(f"begin_forward: sequence {ids[i]}: expected append length >= 1, got {lens[i]}")
        id_list = ids.tolist()
        if len(set(id_list)) != len(id_list):
            values, counts = np.unique(ids, return_counts=True)
            raise CacheError(
                f"begin_forward: a batch names each sequence once; {values[counts > 1].tolist()} repeat"
            )
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
                    f"{len(send.remote_slots)} tokens, up to position "
                    f"{send.begin + len(send.remote_slots) - 1}"
                )

    def _check_no_copy_overlap(self, seq: Sequence) -> None:
        """Refuse to let a receiver write a slot that a pending copy still reads or writes."""
        if not self._pool.touched or not len(seq.table):
            return
        block = self._blocks.blocks[seq.last_block_idx]
        used = (len(seq.table) - len(block.page_ids)) * self.page_size + block.num_used_slots
        last_page = int(seq.table[-1])
        if used % self.page_size == 0 or last_page not in self._pool.touched:
            return
        open_slots = set(
            range(last_page * self.page_size + used % self.page_size, (last_page + 1) * self.page_size)
        )
        clash = sorted(open_slots & self._copies.busy_slots(self._senders))
        if clash:
            raise CacheError(
                f"disagg_prepare_recv: sequence {seq.seq_id} would receive into slots {clash[:4]}"
                f"{'...' if len(clash) > 4 else ''} that a pending copy still uses; run a "
                "begin_forward first to drain it"
            )
