"""The disaggregated half of `PagedKVCache`: a receiver's reservation and a sender's map.

`DisaggSends` is a base of `PagedKVCache` (`disagg.cache`) holding `disagg_prepare_recv` (the
decode side reserves slots for a prompt's KV and hands back their compressed map) and
`disagg_mark_send` (the prefill side names where a sequence's positions go), with the check that
a receiver never writes a slot a pending copy still uses. It works on the cache's own state
(page pool, blocks, pending copies, senders); the semantics are `disagg.cache`'s module
docstring's. Runs in every engine process, like the cache.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike

import numpy as np

from disagg import forward, posmap
from disagg.blocks import SendState
from disagg.errors import CacheError, PositionMapError
from disagg.reserve import reserve_batch


def as_int(value: object, name: str) -> int:
    """``value`` as an int; CacheError naming ``name`` when it is not one (bools refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CacheError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return int(value)


class DisaggSends:
    """`PagedKVCache`'s receive and send operations (the cache's attributes: see `PagedKVCache`)."""

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
        length = as_int(append_length, "append_length")
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
            self._blocks, self._pool, [seq], lens, self.page_size, "disagg_prepare_recv", self._room()
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
        begin = as_int(begin, "begin")
        recver_pe = as_int(recver_pe, "recver_pe")
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
