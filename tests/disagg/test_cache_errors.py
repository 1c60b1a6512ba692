"""Every misuse raises a project error naming the sequence and numbers, and changes nothing.

Each test snapshots the cache's full internal state (`snapshot` fixture) before the failing call
and compares after it, then runs the integrity check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from disagg.cache import PagedKVCache
from disagg.errors import (
    CacheError,
    DisaggError,
    ForwardStateError,
    OutOfPages,
    PositionMapError,
    SequenceExists,
    SequenceNotFound,
)


def populated() -> PagedKVCache:
    """Seq 0: 6 tokens; seq 1 forked from it at 5 (copy pending); seq 2: windowed; seq 3 sends."""
    cache = PagedKVCache(num_pages=10, page_size=4)
    for seq_id in (0, 2, 3):
        cache.add_sequence(seq_id)
    cache.enable_sliding_window(2, 6, 1)
    cache.begin_forward([0, 2, 3], [6, 9, 2])
    cache.end_forward()
    cache.fork_sequence(0, 1, 5)
    cache.disagg_mark_send(3, 0, [1, 64, 4], recver_pe=1)
    cache.check_integrity()
    return cache


def assert_fails(
    cache: PagedKVCache, snapshot: Callable, call: Callable, error: type, fragment: str
) -> DisaggError:
    before = snapshot(cache)
    with pytest.raises(error, match=fragment) as info:
        call()
    assert snapshot(cache) == before
    cache.check_integrity()
    return info.value


@pytest.mark.parametrize(
    ("num_pages", "page_size", "fragment"),
    [
        (0, 16, "num_pages: expected an int >= 1, got 0"),
        (8, 0, "page_size: expected an int >= 1, got 0"),
        (8.0, 16, "num_pages: expected an int, got float"),
        (8, True, "page_size: expected an int, got bool"),
    ],
)
def test_bad_constructor_arguments(num_pages, page_size, fragment: str) -> None:
    with pytest.raises(CacheError, match=fragment):
        PagedKVCache(num_pages, page_size)


def test_unknown_and_duplicate_ids(snapshot) -> None:
    cache = populated()
    assert_fails(cache, snapshot, lambda: cache.add_sequence(0), SequenceExists, "sequence 0 is already")
    assert_fails(
        cache, snapshot, lambda: cache.add_sequence("x"), CacheError, "seq_id: expected an int, got str"
    )
    assert_fails(
        cache, snapshot, lambda: cache.remove_sequence(7), SequenceNotFound, "remove_sequence: sequence 7"
    )
    assert_fails(cache, snapshot, lambda: cache.popn(7, 1), SequenceNotFound, "sequence 7")
    assert_fails(cache, snapshot, lambda: cache.fork_sequence(7, 8), SequenceNotFound, "sequence 7")
    assert_fails(cache, snapshot, lambda: cache.fork_sequence(0, 1), SequenceExists, "child sequence 1")
    assert_fails(
        cache, snapshot, lambda: cache.enable_sliding_window(7, 4, 0), SequenceNotFound, "sequence 7"
    )
    assert_fails(cache, snapshot, lambda: cache.disagg_prepare_recv(7, 1), SequenceNotFound, "sequence 7")
    assert_fails(
        cache, snapshot, lambda: cache.disagg_mark_send(7, 0, [1, 0, 1], 0), SequenceNotFound, "sequence 7"
    )
    assert_fails(cache, snapshot, lambda: cache.seq_length(7), SequenceNotFound, "sequence 7")
    assert_fails(cache, snapshot, lambda: cache.slots(7), SequenceNotFound, "sequence 7")
    assert 7 not in cache and 0 in cache


def test_popn_and_fork_past_the_length(snapshot) -> None:
    cache = populated()
    assert_fails(
        cache,
        snapshot,
        lambda: cache.popn(0, 7),
        CacheError,
        "sequence 0 holds 6 tokens; expected 0 <= n <= 6, got n=7",
    )
    assert_fails(cache, snapshot, lambda: cache.popn(0, -1), CacheError, "got n=-1")
    assert_fails(
        cache,
        snapshot,
        lambda: cache.fork_sequence(0, 9, 7),
        CacheError,
        "parent 0 holds 6 tokens; expected fork_pos in \\[0, 6\\] or -1, got 7",
    )
    assert_fails(cache, snapshot, lambda: cache.fork_sequence(0, 9, -2), CacheError, "got -2")
    assert_fails(cache, snapshot, lambda: cache.slots(0, 2, 7), CacheError, "start=2, end=7")


@pytest.mark.parametrize(
    ("seq_ids", "lens", "error", "fragment"),
    [
        ([0, 1], [1], CacheError, "shapes \\(2,\\) and \\(1,\\)"),
        ([[0]], [[1]], CacheError, "shapes"),
        ([0, 1], [1, 0], CacheError, "sequence 1: expected append length >= 1, got 0"),
        ([0], [-3], CacheError, "got -3"),
        ([0, 1, 0], [1, 1, 1], CacheError, "\\[0\\] repeat"),
        ([0, 9], [1, 1], SequenceNotFound, "sequence 9"),
        ([0.0], [1], CacheError, "integer ids"),
        ([0], [1.5], CacheError, "integer ids and lengths"),
        (
            [3],
            [3],
            PositionMapError,
            "sequence 3 would push positions up to 4, but its map \\(begin=0\\) covers 4",
        ),
    ],
)
def test_bad_batches(seq_ids, lens, error, fragment: str, snapshot) -> None:
    cache = populated()
    assert_fails(cache, snapshot, lambda: cache.begin_forward(seq_ids, lens), error, fragment)


def test_out_of_pages_everywhere_leaves_state_unchanged(snapshot) -> None:
    cache = populated()
    free = cache.num_free_pages
    err = assert_fails(
        cache, snapshot, lambda: cache.begin_forward([0, 1], [4 * free, 4]), OutOfPages, "needs"
    )
    assert (err.num_needed, err.num_free) == (free + 1, free)
    # The windowed sequence in the batch takes the sequential path; the shortage is the same.
    err = assert_fails(
        cache, snapshot, lambda: cache.begin_forward([2, 0], [1, 4 * free + 4]), OutOfPages, "at its peak"
    )
    assert err.num_free == free and err.num_needed > free
    err = assert_fails(
        cache, snapshot, lambda: cache.disagg_prepare_recv(1, 4 * free + 8), OutOfPages, "needs"
    )
    cache.begin_forward([0], [4 * free + 2])  # use up every free page
    cache.end_forward()
    assert cache.num_free_pages == 0
    err = assert_fails(cache, snapshot, lambda: cache.fork_sequence(0, 9, 3), OutOfPages, "needs 1 free page")
    assert (err.num_needed, err.num_free) == (1, 0)
    cache.fork_sequence(0, 9, 4)  # a page-aligned fork needs no page
    cache.check_integrity()


def test_popn_into_a_shared_partial_page_without_a_free_page(snapshot) -> None:
    cache = PagedKVCache(num_pages=2, page_size=4)
    cache.add_sequence(0)
    cache.begin_forward([0], [8])
    cache.end_forward()
    cache.fork_sequence(0, 1)  # seq 1: an empty block under the shared one
    err = assert_fails(
        cache,
        snapshot,
        lambda: cache.popn(1, 2),
        OutOfPages,
        "sequence 1 pops into a shared page at position 6",
    )
    assert (err.num_needed, err.num_free) == (1, 0)
    cache.popn(1, 4)  # a page boundary: no copy, no page needed
    cache.check_integrity()


def test_every_mutation_refused_while_a_forward_is_open(snapshot) -> None:
    cache = populated()
    cache.begin_forward([0], [1])
    calls = [
        lambda: cache.add_sequence(20),
        lambda: cache.remove_sequence(0),
        lambda: cache.fork_sequence(0, 20),
        lambda: cache.popn(0, 1),
        lambda: cache.enable_sliding_window(0, 8, 0),
        lambda: cache.begin_forward([1], [1]),
        lambda: cache.disagg_prepare_recv(0, 1),
        lambda: cache.disagg_mark_send(0, 0, [1, 0, 9], 0),
    ]
    for call in calls:
        assert_fails(cache, snapshot, call, ForwardStateError, "still open; call end_forward first")
    cache.end_forward()
    assert_fails(cache, snapshot, cache.end_forward, ForwardStateError, "no forward is open")


def test_prepare_recv_bad_length(snapshot) -> None:
    cache = populated()
    assert_fails(
        cache,
        snapshot,
        lambda: cache.disagg_prepare_recv(0, 0),
        CacheError,
        "sequence 0: expected append_length >= 1, got 0",
    )
    assert_fails(
        cache,
        snapshot,
        lambda: cache.disagg_prepare_recv(0, np.float32(2)),
        CacheError,
        "append_length: expected an int",
    )


def test_errors_are_project_errors_and_builtin_kinds() -> None:
    assert issubclass(SequenceNotFound, CacheError) and issubclass(CacheError, ValueError)
    assert issubclass(OutOfPages, DisaggError) and issubclass(OutOfPages, RuntimeError)
