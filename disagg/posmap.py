"""Compressed position maps: TVM's run-length format for arrays of slots.

A receiver reserves slots for a sequence (`PagedKVCache.disagg_prepare_recv`) and sends them to the
sender as a compressed map; the sender expands it (`PagedKVCache.disagg_mark_send`) to know where
each token's KV goes. Pure numpy, no per-token Python loops; used in every process.

Format, exactly TVM's (`DisaggPrepareRecv`): ``[n, begin_1, len_1, ..., begin_n, len_n]``, where
run i stands for the slots ``begin_i, begin_i + 1, ..., begin_i + len_i - 1``. Runs are maximal:
a run continues while the next slot equals the previous one plus 1, by plain arithmetic, as TVM
does. ``-1`` ("skip this token") therefore needs no special case: two -1s never join a run (each
is its own run ``[-1, 1]``), and ``[-1, 0, 1]`` is one run ``[-1, 3]``; both expand back exactly.
An empty array compresses to ``[0]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from disagg.errors import PositionMapError

_INT32_MAX = np.iinfo(np.int32).max


def compress(slots: Sequence[int] | np.ndarray) -> list[int]:
    """Compress an array of slots into TVM's run-length format.

    Args:
        slots: ``[num_tokens]`` integer slots (``page_id * page_size + offset``), ``-1`` for a
            token that is skipped. Any integer dtype; a list works too.

    Returns:
        ``[n, begin_1, len_1, ..., begin_n, len_n]`` as Python ints, with maximal runs.

    Raises:
        PositionMapError: ``slots`` is not 1-D, not integer, or holds a value below -1 or above
            the int32 range.
    """
    arr = np.asarray(slots)
    if arr.ndim != 1:
        raise PositionMapError(f"slots: expected a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return [0]
    if arr.dtype.kind not in "iu":
        raise PositionMapError(f"slots: expected integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    low, high = int(arr.min()), int(arr.max())
    if low < -1 or high > _INT32_MAX:
        raise PositionMapError(f"slots: expected values in [-1, {_INT32_MAX}], got [{low}, {high}]")
    # A run breaks wherever a slot is not its predecessor plus one.
    breaks = np.flatnonzero(arr[1:] != arr[:-1] + 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [arr.size]))
    out = np.empty(1 + 2 * starts.size, dtype=np.int64)
    out[0] = starts.size
    out[1::2] = arr[starts]
    out[2::2] = ends - starts
    return out.tolist()


def validate(cmap: Sequence[int] | np.ndarray) -> np.ndarray:
    """Check that ``cmap`` is a well-formed compressed map and return it as int64.

    Args:
        cmap: ``[1 + 2 * n]`` integers in the format of `compress`.

    Returns:
        ``[1 + 2 * n]`` int64 copy of the map.

    Raises:
        PositionMapError: naming what is wrong (shape, dtype, header, a run), expected vs got.
    """
    arr = np.asarray(cmap)
    if arr.ndim != 1 or arr.size == 0:
        raise PositionMapError(f"cmap: expected a 1-D [n, begin, len, ...] map, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise PositionMapError(f"cmap: expected integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    num_runs = int(arr[0])
    if num_runs < 0 or arr.size != 1 + 2 * num_runs:
        raise PositionMapError(
            f"cmap: header says {num_runs} runs, so expected {1 + 2 * max(num_runs, 0)} entries "
            f"and a non-negative count; got {arr.size} entries"
        )
    begins, lengths = arr[1::2], arr[2::2]
    bad = np.flatnonzero((lengths < 1) | (begins < -1) | (begins + lengths - 1 > _INT32_MAX))
    if bad.size:
        i = int(bad[0])
        raise PositionMapError(
            f"cmap: run {i} is (begin={int(begins[i])}, len={int(lengths[i])}); expected "
            f"begin >= -1, len >= 1 and begin + len - 1 <= {_INT32_MAX}"
        )
    return arr


def decompress(cmap: Sequence[int] | np.ndarray) -> np.ndarray:
    """Expand a compressed map into one slot per token.

    Args:
        cmap: ``[1 + 2 * n]`` integers, ``[n, begin_1, len_1, ..., begin_n, len_n]``.

    Returns:
        ``[sum(len_i)]`` int32 slots, run after run.

    Raises:
        PositionMapError: the map is malformed (see `validate`).
    """
    arr = validate(cmap)
    begins, lengths = arr[1::2], arr[2::2]
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int32)
    # Each token's slot is its run's begin plus its index inside the run.
    run_starts = np.cumsum(lengths) - lengths
    within = np.arange(total, dtype=np.int64) - np.repeat(run_starts, lengths)
    return (np.repeat(begins, lengths) + within).astype(np.int32)


def num_tokens(cmap: Sequence[int] | np.ndarray) -> int:
    """Return how many tokens a well-formed compressed map covers (the sum of its run lengths)."""
    arr = validate(cmap)
    return int(arr[2::2].sum())
