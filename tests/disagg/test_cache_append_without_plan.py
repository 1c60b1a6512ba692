"""`PagedKVCache.append_without_plan` (the simulator's forward) takes exactly `begin_forward`'s pages."""

from __future__ import annotations

import numpy as np
import pytest

from disagg.cache import PagedKVCache
from disagg.errors import CacheError, OutOfPages


def test_same_pages_and_slots_as_begin_forward():
    rng = np.random.default_rng(0)
    planned, unplanned = PagedKVCache(64, 16), PagedKVCache(64, 16)
    for cache in (planned, unplanned):
        for seq in range(4):
            cache.add_sequence(seq)
    for _ in range(30):
        seqs = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False).tolist())
        lens = rng.integers(1, 9, size=len(seqs)).tolist()
        planned.begin_forward(seqs, lens)
        planned.end_forward()
        unplanned.append_without_plan(seqs, lens)
        assert planned.num_free_pages == unplanned.num_free_pages
    for seq in range(4):
        np.testing.assert_array_equal(planned.slots(seq), unplanned.slots(seq))
    unplanned.remove_sequence(0)
    unplanned.check_integrity()


def test_out_of_pages_changes_nothing_and_sends_are_refused():
    cache = PagedKVCache(2, 16)
    cache.add_sequence(0)
    with pytest.raises(OutOfPages):
        cache.append_without_plan([0], [33])
    assert cache.num_free_pages == 2 and cache.seq_length(0) == 0
    cache.append_without_plan([0], [4])
    cache.disagg_mark_send(0, 0, [1, 0, 4], 1)
    with pytest.raises(CacheError, match="need begin_forward's plan"):
        cache.append_without_plan([0], [1])


def test_a_pending_fork_copy_runs_with_it_as_with_begin_forward():
    """A prefix-cache hit that ends mid page leaves a fork copy pending (the simulator's prompts hit
    so): the forward counts it as run, exactly as `begin_forward`'s plan runs it."""
    caches = [PagedKVCache(8, 16, prefix_caching=True) for _ in range(2)]
    prompt = list(range(1, 41))
    for cache in caches:
        cache.add_sequence(0)
        cache.append_without_plan([0], [24])
        cache.cache_tokens(0, prompt[:24])
        cache.remove_sequence(0)
        cache.add_sequence(1, prefix=cache.match_prefix(prompt))  # 24 cached: a page and a half
        assert cache.seq_length(1) == 24
    planned, unplanned = caches
    planned.begin_forward([1], [16])
    planned.end_forward()
    unplanned.append_without_plan([1], [16])
    assert planned.num_free_pages == unplanned.num_free_pages
    np.testing.assert_array_equal(planned.slots(1), unplanned.slots(1))
    unplanned.check_integrity()
    unplanned.append_without_plan([1], [1])  # nothing pending any more
    unplanned.check_integrity()
