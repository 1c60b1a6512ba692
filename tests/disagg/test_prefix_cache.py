"""Automatic prefix caching in `PagedKVCache` with exact page ids (vLLM's test_prefix_caching habit):
hits on a page boundary, mid page (a copied page), the whole prompt (one token left to compute),
LRU eviction of cached pages only, live pages never evicted, stale matches refused, counters."""

from __future__ import annotations

import pytest

from disagg.cache import PagedKVCache
from disagg.errors import CacheError, OutOfPages

P = 4


def computed(cache: PagedKVCache, seq_id: int, tokens: list[int], start: int = 0) -> None:
    """Append ``tokens[start:]`` to ``seq_id`` in one forward and register all of ``tokens``."""
    cache.begin_forward([seq_id], [len(tokens) - start])
    cache.end_forward()
    cache.cache_tokens(seq_id, tokens)


def enter(cache: PagedKVCache, seq_id: int, tokens: list[int], **kw) -> int:
    """Add ``seq_id`` from its longest cached prefix, compute the rest; return the hit length."""
    match = cache.match_prefix(tokens, **kw)
    cache.add_sequence(seq_id, prefix=match)
    computed(cache, seq_id, tokens, match.num_tokens)
    cache.check_integrity()
    return match.num_tokens


@pytest.fixture
def cache() -> PagedKVCache:
    return PagedKVCache(8, P, prefix_caching=True)


A = list(range(100, 110))  # 10 tokens: pages 0, 1 full, page 2 holds 2


def test_removed_sequence_stays_cached_and_counts_as_free(cache):
    assert enter(cache, 0, A) == 0
    assert cache.slots(0).tolist() == list(range(10))
    assert cache.num_free_pages == 5
    cache.remove_sequence(0)
    cache.check_integrity()
    assert 0 not in cache
    assert cache.num_free_pages == 8 and cache.num_cached_pages == 3
    assert cache._pool.num_free == 5


def test_hit_on_a_page_boundary_shares_whole_pages(cache):
    enter(cache, 0, A)
    cache.remove_sequence(0)
    b = A[:8] + [1, 2, 3]
    assert enter(cache, 1, b) == 8
    assert cache.slots(1).tolist()[:8] == list(range(8))  # pages 0, 1 shared
    assert cache.prefix_stats()["prefix_hit_tokens"] == 8
    assert cache.prefix_stats()["prefix_query_tokens"] == 10 + 11


def test_hit_mid_page_copies_that_page(cache):
    enter(cache, 0, A)
    b = A[:9] + [7, 7]
    match = cache.match_prefix(b)
    assert (match.seq_id, match.num_tokens, match.num_pages) == (0, 9, 1)  # live parent: 1 copy page
    cache.add_sequence(1, prefix=match)
    plan = cache.begin_forward([1], [2])
    assert plan.fork_src_slots.tolist() == [8] and plan.fork_dst_slots.tolist() == [12]
    cache.end_forward()
    assert cache.slots(1).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14]
    assert enter(cache, 2, b, page_aligned=True) == 8


def test_whole_prompt_leaves_one_token_to_compute(cache):
    enter(cache, 0, A)
    cache.remove_sequence(0)
    match = cache.match_prefix(A)
    assert match.num_tokens == 9
    short = A[:8]
    assert cache.match_prefix(short).num_tokens == 7  # page 0, then 3 tokens into page 1
    assert cache.match_prefix(A[:4]).num_tokens == 0  # no full page before the last token


def test_eviction_takes_least_recently_used_cached_pages_last_page_first(cache):
    enter(cache, 0, A)            # pages 0-2
    enter(cache, 1, [5] * 8)      # pages 3-4
    cache.remove_sequence(0)
    cache.remove_sequence(1)
    enter(cache, 2, A[:8] + [9])  # hit on seq 0's pages 0-1 (seq 0 becomes most recent); page 5
    assert cache._pool.free_pages() == [6, 7]
    cache.add_sequence(3)
    cache.begin_forward([3], [4 * P])  # 4 pages: 6, 7, then seq 1's pages 4 and 3 (LRU, last first)
    cache.end_forward()
    cache.check_integrity()
    assert sorted(cache.slots(3).tolist()[::P]) == [12, 16, 24, 28]
    assert cache.match_prefix([5] * 8).num_tokens == 0
    cache.add_sequence(4)
    cache.begin_forward([4], [P])  # seq 0's page 2 (its pages 0, 1 are live under seq 2)
    cache.end_forward()
    assert cache.slots(4).tolist() == [8, 9, 10, 11]
    with pytest.raises(OutOfPages):
        cache.begin_forward([4], [1])
    assert cache.match_prefix(A).num_tokens == 8


def test_live_and_pushing_pages_are_never_evicted(cache):
    enter(cache, 0, A)
    cache.disagg_mark_send(0, 0, [1, 0, 10], 1)
    enter(cache, 1, [3] * 12)
    cache.remove_sequence(1)
    cache.add_sequence(2)
    with pytest.raises(OutOfPages):
        cache.begin_forward([2], [6 * P])  # 3 free + 3 cached pages; seq 0's 3 pages are live
    cache.begin_forward([2], [5 * P])
    cache.end_forward()
    assert sorted(set(cache.slots(2).tolist()) & set(range(12))) == []
    cache.check_integrity()


def test_stale_match_and_bad_registration_are_refused(cache, snapshot):
    enter(cache, 0, A)
    match = cache.match_prefix(A)
    cache.add_sequence(5)
    with pytest.raises(CacheError, match="stale"):
        cache.add_sequence(1, prefix=match)
    before = snapshot(cache)
    with pytest.raises(CacheError, match="disagree"):
        cache.cache_tokens(0, [1] + A[1:])
    with pytest.raises(CacheError, match="at most"):
        cache.cache_tokens(0, A + [1])
    assert snapshot(cache) == before


def test_everything_is_free_after_removing_everything(cache):
    for seq_id in range(4):
        enter(cache, seq_id, A[: 5 + seq_id])
    for seq_id in range(4):
        cache.remove_sequence(seq_id)
    cache.check_integrity()
    assert cache.num_free_pages == 8
    cache.add_sequence(9)
    cache.begin_forward([9], [8 * P])  # every cached page can be evicted
    cache.end_forward()
    cache.remove_sequence(9)
    assert cache._pool.num_free == 8 and cache.num_cached_pages == 0


def test_off_by_default():
    cache = PagedKVCache(4, P)
    cache.add_sequence(0)
    computed(cache, 0, A[:8])
    assert cache.match_prefix(A).num_tokens == 0
    cache.remove_sequence(0)
    assert cache._pool.num_free == 4 and cache.num_cached_pages == 0


def test_reset_forgets_cached_prefixes_and_keeps_live_ones(cache):
    enter(cache, 0, A)
    b = A[:8] + [1, 2, 3]
    assert enter(cache, 1, b) == 8  # 1 shares pages 0, 1 with the live 0
    cache.remove_sequence(0)  # 0 cached: its page 2 held only by it, pages 0, 1 shared with 1
    assert cache.num_cached_pages == 1
    evicted = cache.prefix_stats()["prefix_evicted_pages"]
    assert cache.reset_prefix_cache() == 1
    cache.check_integrity()
    assert cache.num_cached_pages == 0 and cache._pool.num_free == 8 - 3  # 1 keeps pages 0, 1 and its own
    assert cache.prefix_stats()["prefix_evicted_pages"] == evicted + 1
    assert cache.slots(1).tolist()[:8] == list(range(8))  # the live sequence still reads its shared pages
    assert cache.match_prefix(A).num_tokens == 8  # the live 1 stays matchable (pages 0, 1)
    cache.remove_sequence(1)  # removed after the reset: cached again
    assert cache.num_cached_pages == 3
    assert cache.reset_prefix_cache() == 3 and cache._pool.num_free == 8
    assert cache.match_prefix(A).num_tokens == 0 and cache.reset_prefix_cache() == 0
    cache.check_integrity()


def test_reset_parks_pages_a_pending_copy_still_reads(cache):
    enter(cache, 0, A)
    cache.remove_sequence(0)
    cache.add_sequence(1, prefix=cache.match_prefix(A[:9] + [5]))  # mid-page hit: copies cached page 2
    assert cache.reset_prefix_cache() == 1  # page 2 given back, parked until the copy ran
    cache.check_integrity()
    assert cache._pool.deferred and cache.num_cached_pages == 0
    computed(cache, 1, A[:9] + [5], 9)  # the forward runs the copy, then the page is free
    cache.check_integrity()
    assert not cache._pool.deferred and cache.slots(1).tolist()[:8] == list(range(8))
