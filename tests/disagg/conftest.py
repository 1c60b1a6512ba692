"""Fixtures for the page-table bookkeeping tests: a full-state snapshot of a `PagedKVCache`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from disagg.cache import PagedKVCache


def cache_state(cache: PagedKVCache) -> tuple:
    """Every piece of internal state, as nested tuples: equal snapshots mean an unchanged cache."""
    return (
        cache._pool.state(),
        cache._blocks.state(),
        tuple((seq_id, seq.state()) for seq_id, seq in cache._seqs.items()),
        tuple(sorted(cache._windowed)),
        tuple(cache._senders),
        tuple(cache._copies.fork),
        cache._open,
    )


@pytest.fixture
def snapshot() -> Callable[[PagedKVCache], tuple]:
    """The `cache_state` function, for tests that compare state before and after a failing call."""
    return cache_state
