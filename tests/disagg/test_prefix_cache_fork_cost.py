"""`PagedKVCache.match_prefix`'s page cost: what a fork from the match takes out of `num_free_pages`.

A scheduler admits a prompt forked from a cached prefix when ``match.num_pages`` fits its free
budget; the pages the fork takes from `num_free_pages` must be exactly that, or the forward
after it finds fewer pages than promised and raises OutOfPages (the simulator's equivalence
test, tests/cluster/test_simulate_prefix.py, catches it too: a hit ending mid page in a cached
sequence also pins the partial page its copy reads).
"""

from __future__ import annotations

import pytest

from disagg.cache import PagedKVCache


@pytest.mark.parametrize("cached_len,query_extra", [(24, 10), (32, 10), (40, 3), (20, 30)])
def test_a_fork_takes_exactly_the_matchs_pages(cached_len: int, query_extra: int):
    cache = PagedKVCache(6, 16, prefix_caching=True)
    tokens = list(range(1, cached_len + 1))
    cache.add_sequence(0)
    cache.append_without_plan([0], [cached_len])
    cache.cache_tokens(0, tokens)
    cache.remove_sequence(0)  # cached: its pages are evictable, so counted as free
    before = cache.num_free_pages
    match = cache.match_prefix(tokens + [99] * query_extra)
    assert match.num_tokens == cached_len
    cache.add_sequence(1, prefix=match)
    assert cache.num_free_pages == before - match.num_pages
    cache.check_integrity()


def test_a_hit_in_a_live_sequence_costs_only_the_copy():
    cache = PagedKVCache(6, 16, prefix_caching=True)
    tokens = list(range(1, 25))
    cache.add_sequence(0)
    cache.append_without_plan([0], [24])
    cache.cache_tokens(0, tokens)  # live: its pages are not free, so the fork pins nothing free
    before = cache.num_free_pages
    match = cache.match_prefix(tokens + [99] * 5)
    assert (match.num_tokens, match.num_pages) == (24, 1)
    cache.add_sequence(1, prefix=match)
    assert cache.num_free_pages == before - 1
