"""Pending slot copies: fork copies and page-to-page sends, until a plan carries them.

The cache never assumes a copy happened; it records it here and the next `begin_forward` drains
every pending copy into its plan. Meanwhile the pages those copies read or write are "touched":
freed, they are parked by `disagg.pages.PagePool` instead of being handed out. Copies that nobody
can observe any more (destination page freed and not read by a later copy) are dropped. Owned by
`disagg.cache.PagedKVCache`.
"""

from __future__ import annotations

import logging

import numpy as np

from disagg.blocks import Sequence
from disagg.pages import PagePool

logger = logging.getLogger(__name__)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, dtype=np.int32)


def fork_copy_slots(copies: list[tuple[int, int, int]], page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Expand ``(src_page, dst_page, length)`` fork copies into ``[F]`` int32 src and dst slots.

    The copies are ordered (a later one may read an earlier one's destination: a fork of a fork
    before any forward), but a plan's fork copies run as ONE parallel launch. So every source slot
    that an earlier copy writes is resolved to that copy's own (resolved) source: the result
    reads only slots that no pair of it writes, and gives each destination what the ordered copies
    would. (A later copy never writes a slot an earlier one reads: that page is parked until the
    copies run, see `disagg.pages`.)
    """
    if not copies:
        return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32)
    src_pages, dst_pages, lengths = (np.asarray(col, dtype=np.int64) for col in zip(*copies))
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    src = np.repeat(src_pages * page_size, lengths) + within
    dst = np.repeat(dst_pages * page_size, lengths) + within
    if np.isin(src_pages, dst_pages).any():
        src = _resolve_chains(src, dst)
    return src.astype(np.int32), dst.astype(np.int32)


def _resolve_chains(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Ordered pairs ``dst[i] <- src[i]`` -> sources read before any pair writes (see above)."""
    origin: dict[int, int] = {}
    resolved = src.tolist()
    for i, (s, d) in enumerate(zip(resolved, dst.tolist())):
        s = origin.get(s, s)
        resolved[i] = s
        origin[d] = s
    return np.asarray(resolved, dtype=np.int64)


class PendingCopies:
    """Fork copies in creation order, plus the senders whose existing KV awaits a page-to-page copy.

    Attributes:
        fork: ``(src_page, dst_page, num_slots)``: slots ``0 .. num_slots - 1`` of `src_page` are
            copied to the same offsets of `dst_page`, in list order (a later copy may read an
            earlier one's destination; `fork_copy_slots` resolves such chains for the plan).
    """

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self.fork: list[tuple[int, int, int]] = []

    def refresh(self, senders: dict[int, Sequence]) -> None:
        """Drop copies nobody can observe, recompute the touched pages, and free unparked pages.

        Call after anything that adds, trims or drops a copy, or frees a page, with no forward open.
        """
        deferred = self.pool.deferred
        kept, read = [], set()
        for src, dst, length in reversed(self.fork):
            if dst not in deferred or dst in read:
                kept.append((src, dst, length))
                read.add(src)
        kept.reverse()
        if len(kept) != len(self.fork):
            logger.debug("dropped %d fork copies into freed pages", len(self.fork) - len(kept))
        self.fork = kept
        touched = {page for src, dst, _ in kept for page in (src, dst)}
        for seq in senders.values():
            local, _ = seq.send.pending_copies()
            touched.update((local // self.page_size).tolist())
        self.pool.touched = touched
        self.pool.release_deferred()

    def busy_slots(self, senders: dict[int, Sequence]) -> set[int]:
        """Every slot a pending copy reads or writes."""
        src, dst = fork_copy_slots(self.fork, self.page_size)
        busy = set(src.tolist()) | set(dst.tolist())
        for seq in senders.values():
            busy.update(seq.send.pending_copies()[0].tolist())
        return busy

    def drain(self, senders: dict[int, Sequence], pushed: dict[int, bool]) -> dict[str, np.ndarray]:
        """Move every pending copy into plan arrays and forget it.

        The touched set is cleared, but pages parked so far stay parked until `end_forward`, so the
        copies drained into the open plan still find them intact.

        Args:
            senders: sequences marked for sending, in `disagg_mark_send` order.
            pushed: senders that push in this forward -> whether they push their map's last token.

        Returns:
            The plan's ``copy_*``, ``fork_*`` and ``send_*`` arrays by field name.
        """
        fork_src, fork_dst = fork_copy_slots(self.fork, self.page_size)
        self.fork = []
        local, remote, pes = [], [], []
        send_ids, send_pes, complete = [], [], []
        for seq_id, seq in senders.items():
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
        self.pool.touched = set()
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

    @staticmethod
    def none() -> dict[str, np.ndarray]:
        """Empty copy and send arrays, for a forward that drains nothing (`disagg_prepare_recv`)."""
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
