"""Argument checks of a forward's batch (`PagedKVCache.begin_forward`), before anything changes.

Pure functions over numpy arrays and sequences; they raise a `CacheError` subclass naming the
first problem. Called by `disagg.cache` only.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike

import numpy as np

from disagg.blocks import Sequence
from disagg.errors import CacheError, PositionMapError


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
