"""Compressed position maps: TVM's exact format, -1 handling, round trips and malformed maps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg import posmap
from disagg.errors import PositionMapError


def tvm_compress(slots: list[int]) -> list[int]:
    """Line-by-line port of TVM's DisaggPrepareRecv compression loop (scalar reference)."""
    out = [1, slots[0]]
    for i in range(1, len(slots)):
        if slots[i] != slots[i - 1] + 1:
            out.append(slots[i - 1] - out[-1] + 1)
            out[0] += 1
            out.append(slots[i])
    out.append(slots[-1] - out[-1] + 1)
    return out


def tvm_decompress(cmap: list[int]) -> list[int]:
    """Port of TVM's DisaggMarkSend expansion loop."""
    out = []
    for i in range(cmap[0]):
        begin, length = cmap[2 * i + 1], cmap[2 * i + 2]
        out.extend(begin + j for j in range(length))
    return out


@pytest.mark.parametrize(
    ("slots", "cmap"),
    [
        ([], [0]),
        ([5], [1, 5, 1]),
        ([0, 1, 2, 3], [1, 0, 4]),
        ([4, 5, 6, 7, 12, 13], [2, 4, 4, 12, 2]),
        ([13, 12], [2, 13, 1, 12, 1]),  # descending slots are separate runs
        ([-1, -1], [2, -1, 1, -1, 1]),  # -1 never follows -1 arithmetically
        ([-1, 0, 1], [1, -1, 3]),  # ... but 0 follows -1: one run, as in TVM
        ([3, -1, -1, 8, 9], [4, 3, 1, -1, 1, -1, 1, 8, 2]),
        ([7, 7], [2, 7, 1, 7, 1]),
    ],
)
def test_compress_exact(slots: list[int], cmap: list[int]) -> None:
    assert posmap.compress(slots) == cmap
    assert posmap.compress(np.asarray(slots, dtype=np.int32)) == cmap
    if slots:
        assert tvm_compress(slots) == cmap
    assert posmap.decompress(cmap).tolist() == slots
    assert posmap.decompress(cmap).dtype == np.int32
    assert posmap.num_tokens(cmap) == len(slots)


run_lists = st.lists(st.tuples(st.integers(-1, 5000), st.integers(1, 40)), min_size=0, max_size=20).map(
    lambda runs: [s for begin, n in runs for s in (range(begin, begin + n) if begin >= 0 else [-1] * n)]
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(run_lists)
def test_round_trip_and_tvm_equivalence(slots: list[int]) -> None:
    cmap = posmap.compress(slots)
    assert posmap.decompress(cmap).tolist() == slots
    assert all(isinstance(v, int) for v in cmap)
    if slots:
        assert cmap == tvm_compress(slots)
        assert tvm_decompress(cmap) == slots
    # Runs are maximal: no run could be merged into the one before it.
    begins, lengths = cmap[1::2], cmap[2::2]
    assert len(begins) == cmap[0]
    assert all(begins[i + 1] != begins[i] + lengths[i] for i in range(len(begins) - 1))


@pytest.mark.parametrize(
    ("cmap", "fragment"),
    [
        ([], "shape"),
        ([[1, 2, 3]], "shape"),
        ([1], "expected 3 entries"),
        ([1, 5], "expected 3 entries"),
        ([2, 0, 1], "expected 5 entries"),
        ([-1], "non-negative"),
        ([1, 0, 0], "len=0"),
        ([1, 4, -3], "len=-3"),
        ([1, -2, 1], "begin=-2"),
        ([1, 2**31 - 1, 2], "begin + len - 1"),
        ([1.0, 0.0, 1.0], "integers"),
    ],
)
def test_malformed_maps_raise(cmap: list, fragment: str) -> None:
    with pytest.raises(PositionMapError, match=fragment.replace("+", r"\+")):
        posmap.decompress(cmap)


@pytest.mark.parametrize("slots", [[[1, 2]], [0.5], [-2, 3], [2**31]])
def test_bad_slots_raise(slots: list) -> None:
    with pytest.raises(PositionMapError):
        posmap.compress(slots)


def test_large_map_is_vectorized_and_exact() -> None:
    rng = np.random.default_rng(0)
    pages = rng.permutation(4096)[:1024]
    slots = (pages[:, None] * 16 + np.arange(16)).reshape(-1)
    cmap = posmap.compress(slots)
    np.testing.assert_array_equal(posmap.decompress(cmap), slots)
    assert cmap[0] <= 1024
