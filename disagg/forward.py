"""Builds the arrays of a `ForwardPlan` once `PagedKVCache` has reserved a batch's pages.

Everything here is vectorized over the batch: one `np.concatenate` of the cached per-sequence
page tables, cumsums for the indptrs, and one gather for the slots. Only sliding-window sequences
and sequences marked for sending take a per-sequence step. Called by `disagg.cache` in the process
that owns the cache; it reads sequences and blocks, and only drains the pending copies. The
batch's argument checks (`check_batch`, `check_send_room`) run before anything is reserved.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike

import numpy as np

from disagg import sliding
from disagg.blocks import Sequence
from disagg.copies import PendingCopies
from disagg.errors import CacheError, CacheIntegrityError, PositionMapError
from disagg.plan import ForwardPlan
from disagg.reserve import WindowedAppend


def build_plan(
    ids: list[int],
    seqs: list[Sequence],
    lens: np.ndarray,
    len_before: np.ndarray,
    windowed: list[WindowedAppend],
    page_size: int,
    senders: dict[int, Sequence],
    copies: PendingCopies | None,
) -> ForwardPlan:
    """Assemble the plan of a batch whose slots `disagg.reserve.reserve_batch` just reserved.

    Args:
        ids, seqs: the batch's B ids and sequences.
        lens: ``[B]`` int64 append lengths.
        len_before: ``[B]`` int64 lengths before the append.
        windowed: the batch's sliding-window sequences.
        page_size: tokens per page.
        senders: sequences marked for sending (seq id -> sequence), in mark order.
        copies: pending copies to drain into the plan; None leaves them pending.

    Returns:
        The `ForwardPlan` (see `disagg.plan` for every array's shape).
    """
    batch = len(seqs)
    qo_indptr = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(lens, out=qo_indptr[1:])
    page_indptr, page_indices, last_page_len = page_tables(seqs, len_before + lens, page_size)
    slots, positions = append_slots(
        qo_indptr, lens, len_before, page_indptr, page_indices, page_size, [w.index for w in windowed]
    )
    sink_size = np.zeros(batch, dtype=np.int32)
    window_offset = np.zeros(batch, dtype=np.int32)
    if windowed:
        fix_windowed(
            windowed,
            qo_indptr,
            page_indptr,
            page_indices,
            page_size,
            slots,
            last_page_len,
            sink_size,
            window_offset,
        )
    num_tokens = int(qo_indptr[-1])
    push_slots = np.full(num_tokens, -1, dtype=np.int32)
    push_pes = np.full(num_tokens, -1, dtype=np.int32)
    pushed = {}
    if senders:
        send_index = {seq_id: i for i, seq_id in enumerate(ids) if seq_id in senders}
        pushed = push_targets(send_index, senders, qo_indptr, len_before, push_slots, push_pes)
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
        **(copies.drain(senders, pushed) if copies is not None else PendingCopies.none()),
    )


def page_tables(seqs: list[Sequence], lens_after: np.ndarray, page_size: int) -> tuple[np.ndarray, ...]:
    """CSR page tables of the batch after the append.

    Args:
        seqs: the batch, B sequences (reservation done).
        lens_after: ``[B]`` int64 sequence lengths after the append.
        page_size: tokens per page.

    Returns:
        ``(page_indptr [B+1], page_indices [nnz], last_page_len [B])``, int32; `last_page_len`
        assumes identity slot offsets (windowed sequences are fixed up by `fix_windowed`).
    """
    tables = [s.table for s in seqs]
    counts = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    page_indptr = np.zeros(len(tables) + 1, dtype=np.int32)
    np.cumsum(counts, out=page_indptr[1:])
    page_indices = np.concatenate(tables) if tables else np.empty(0, dtype=np.int32)
    last_page_len = ((lens_after - 1) % page_size + 1).astype(np.int32)
    return page_indptr, page_indices, last_page_len


def append_slots(
    qo_indptr: np.ndarray,
    lens: np.ndarray,
    len_before: np.ndarray,
    page_indptr: np.ndarray,
    page_indices: np.ndarray,
    page_size: int,
    windowed_rows: list[int] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """Slots and positions of every appended token, assuming identity slot offsets.

    Args:
        qo_indptr: ``[B+1]`` int32 token ranges.
        lens: ``[B]`` int64 append lengths.
        len_before: ``[B]`` int64 sequence lengths before the append.
        page_indptr, page_indices: the batch's page tables after the append.
        page_size: tokens per page.
        windowed_rows: batch rows of sliding-window sequences, whose slots `fix_windowed`
            overwrites (their identity offsets may run past their tables: those slots are -1
            until then).

    Returns:
        ``(append_slots [T], positions [T])`` int32.

    Raises:
        CacheIntegrityError: a token of another sequence falls outside its own page table (the
            reservation and the tables disagree: a bug, never a silently clipped page).
    """
    num_tokens = int(qo_indptr[-1])
    if num_tokens == len(lens):  # decode: one token per sequence
        owner = slice(None)
        positions = len_before
    else:
        owner = np.repeat(np.arange(len(lens)), lens)
        positions = np.arange(num_tokens, dtype=np.int64) - qo_indptr[:-1][owner] + len_before[owner]
    index = page_indptr[:-1][owner] + positions // page_size
    # A row's last token has its largest position: check rows, then tokens only if one is over.
    over = page_indptr[:-1] + (len_before + lens - 1) // page_size >= page_indptr[1:]
    outside = None
    if over.any():
        bad = np.setdiff1d(np.flatnonzero(over), np.asarray(windowed_rows, dtype=np.int64))
        if bad.size:
            row = int(bad[0])
            raise CacheIntegrityError(
                f"plan: batch row {row} appends positions up to "
                f"{int(len_before[row] + lens[row] - 1)} but its page table holds "
                f"{int(page_indptr[row + 1] - page_indptr[row])} pages of {page_size}"
            )
        outside = index >= page_indptr[1:][owner]
        index = np.where(outside, 0, index)  # windowed rows: fix_windowed overwrites these
    pages = page_indices[index].astype(np.int64) if page_indices.size else np.zeros(num_tokens, np.int64)
    slots = pages * page_size + positions % page_size
    if outside is not None:
        slots[outside] = -1
    return slots.astype(np.int32), positions.astype(np.int32)


def fix_windowed(
    windowed: list[WindowedAppend],
    qo_indptr: np.ndarray,
    page_indptr: np.ndarray,
    page_indices: np.ndarray,
    page_size: int,
    slots: np.ndarray,
    last_page_len: np.ndarray,
    sink_size: np.ndarray,
    window_offset: np.ndarray,
) -> None:
    """Overwrite the slots, last page lengths and holes of sliding-window sequences, in place.

    Vectorized over all windowed sequences of the batch; see `sliding.append_offsets` for the
    three cases (written into the sinks, dropped, written into the window).
    """
    index = np.array([w.index for w in windowed], dtype=np.int64)
    prefix_slots = np.array([w.prefix_pages for w in windowed], dtype=np.int64) * page_size
    before = np.array([w.last_len_before for w in windowed], dtype=np.int64)
    length = np.array([w.block.seq_length for w in windowed], dtype=np.int64)
    sink = np.array([w.block.sink_length for w in windowed], dtype=np.int64)
    start = np.array([w.block.sliding_window_offset for w in windowed], dtype=np.int64)
    lens = (qo_indptr[index + 1] - qo_indptr[index]).astype(np.int64)
    owner = np.repeat(np.arange(len(windowed)), lens)
    j = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    offsets = sliding.append_offsets(
        before[owner] + j, length[owner] - lens[owner] + j, sink[owner], start[owner]
    )
    table_slots = np.where(offsets < 0, 0, prefix_slots[owner] + offsets)
    pages = page_indices[page_indptr[index][owner] + table_slots // page_size].astype(np.int64)
    written = pages * page_size + table_slots % page_size
    slots[qo_indptr[index][owner] + j] = np.where(offsets < 0, -1, written)
    used = prefix_slots + length - sink + start
    last_page_len[index] = (used - 1) % page_size + 1
    has_hole = start > sink
    sink_size[index] = np.where(has_hole, prefix_slots + sink, 0)
    window_offset[index] = np.where(has_hole, prefix_slots + start, 0)


def push_targets(
    send_index: dict[int, int],
    senders: dict[int, Sequence],
    qo_indptr: np.ndarray,
    len_before: np.ndarray,
    push_slots: np.ndarray,
    push_pes: np.ndarray,
) -> dict[int, bool]:
    """Fill the receiver slot and PE of every pushed token, in place.

    Senders never have a sliding window, so a token's position is its sequence's length before the
    append plus its index in the append. One slice of each sender's map, one concatenate.

    Args:
        send_index: batch index of each sender in the batch (seq id -> index).
        senders: sequences marked for sending (seq id -> sequence).
        qo_indptr: ``[B+1]`` int32 token ranges.
        len_before: ``[B]`` int64 sequence lengths before the append.
        push_slots, push_pes: ``[T]`` int32, -1 filled; written for pushed tokens.

    Returns:
        For each sender that pushes in this forward: whether it writes its map's last token.
    """
    if not send_index:
        return {}
    sends = [senders[seq_id].send for seq_id in send_index]
    rows = np.fromiter(send_index.values(), dtype=np.int64, count=len(sends))
    begin = np.array([send.begin for send in sends], dtype=np.int64)
    map_len = np.array([len(send.remote_slots) for send in sends], dtype=np.int64)
    lens = (qo_indptr[rows + 1] - qo_indptr[rows]).astype(np.int64)
    first = len_before[rows] - begin  # map index of each sender's first new token
    skip = np.clip(-first, 0, lens)  # its tokens before `begin` are not sent
    count = lens - skip
    starts = np.maximum(first, 0).tolist()
    parts = [send.remote_slots[lo : lo + n] for send, lo, n in zip(sends, starts, count.tolist()) if n > 0]
    if not parts:
        return {}
    remote = np.concatenate(parts)
    within = np.arange(remote.size, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    tokens = np.repeat(qo_indptr[rows] + skip, count) + within
    pes = np.repeat(np.array([send.recver_pe for send in sends], dtype=np.int32), count)
    push_slots[tokens] = remote
    push_pes[tokens] = np.where(remote >= 0, pes, -1)
    complete = (first + lens == map_len).tolist()
    return {seq_id: done for seq_id, done, n in zip(send_index, complete, count.tolist()) if n > 0}


# ------------------------------------------------------------- argument checks (before any change)


def check_batch(seq_ids: SequenceLike[int], append_lengths: SequenceLike[int]) -> tuple[list[int], np.ndarray]:
    """``(ids, lens)``: the batch's ids as a list and ``[B]`` int64 append lengths (>= 1), or raise."""
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


def check_send_room(seqs: list[Sequence], lens: np.ndarray) -> None:
    """Refuse a forward that would push a sender's tokens past the end of its remote map."""
    for i, seq in enumerate(seqs):
        send = seq.send
        if send is not None and seq.seq_length + int(lens[i]) - send.begin > len(send.remote_slots):
            raise PositionMapError(
                f"begin_forward: sequence {seq.seq_id} would push positions up to "
                f"{seq.seq_length + int(lens[i]) - 1}, but its map (begin={send.begin}) covers "
                f"{len(send.remote_slots)} tokens, up to position "
                f"{send.begin + len(send.remote_slots) - 1}"
            )
