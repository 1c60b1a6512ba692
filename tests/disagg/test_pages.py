"""Page hand-out order: free extents keep runs long (`disagg.pages.PagePool`).

TVM's free stack hands the most recently freed page out first, so a prompt reserved in freed
space got one run per page (the review's 4,096-token prompt: 256 runs where one would do). These
pin the order down through the cache and check the pool's bookkeeping against a plain set.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg import posmap
from disagg.cache import PagedKVCache
from disagg.pages import PagePool


def recv(cache: PagedKVCache, seq_id: int, num_tokens: int) -> list[int]:
    cache.add_sequence(seq_id)
    cmap = cache.disagg_prepare_recv(seq_id, num_tokens)
    cache.end_forward()
    cache.check_integrity()
    return cmap


def test_a_prompt_in_freed_space_is_one_run() -> None:
    """The demo's pattern, scaled down: requests of 40, 24, 20 pages, every other one finished."""
    cache = PagedKVCache(num_pages=460, page_size=16)
    sizes, seq_id = (640, 384, 320), 0
    while cache.num_free_pages * 16 >= sizes[seq_id % 3]:
        recv(cache, seq_id, sizes[seq_id % 3])
        seq_id += 1
    for finished in range(1, seq_id, 2):
        cache.remove_sequence(finished)
    cmap = recv(cache, 100, 256)  # 16 pages
    assert cmap[0] == 1, f"a 16-page prompt got {cmap[0]} runs: {cmap[:9]}"


def test_best_fit_keeps_large_extents_whole_and_growth_continues_its_run() -> None:
    cache = PagedKVCache(num_pages=32, page_size=4)
    for seq_id, pages in enumerate((2, 3, 6, 4)):  # pages 0-1, 2-4, 5-10, 11-14; 15-31 free
        recv(cache, seq_id, 4 * pages)
    cache.remove_sequence(1)  # free: [2..4], [15..31]
    assert posmap.decompress(recv(cache, 10, 8)).tolist() == list(range(8, 16))  # pages 2, 3
    assert posmap.decompress(recv(cache, 11, 40))[0] == 60  # 10 pages from 15: [2..4] too small
    # Seq 11 (pages 15..24) grows by a page: the next one, 25, continues its run.
    plan = cache.begin_forward([11], [1])
    cache.end_forward()
    assert plan.page_indices.tolist() == list(range(15, 26))


def test_a_request_larger_than_every_extent_takes_the_largest_first_in_ascending_order() -> None:
    cache = PagedKVCache(num_pages=10, page_size=1)
    for seq_id in range(10):
        recv(cache, seq_id, 1)
    for seq_id in (1, 2, 3, 5, 7, 8):  # free: [1..3], [5], [7, 8]
        cache.remove_sequence(seq_id)
    assert posmap.decompress(recv(cache, 20, 5)).tolist() == [1, 2, 3, 7, 8]
    assert posmap.decompress(recv(cache, 21, 1)).tolist() == [5]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60), st.integers(1, 200))
def test_pool_matches_a_set_of_free_pages(ops, num_pages) -> None:
    pool = PagePool(num_pages)
    free = set(range(num_pages))
    held: list[list[int]] = []
    rng = np.random.default_rng(len(ops))
    for is_take, n in ops:
        if is_take and n <= pool.num_free:
            after = held[-1][-1] if held and held[-1] and rng.random() < 0.5 else None
            pages = pool.take(n, after)
            assert len(pages) == len(set(pages)) == n and set(pages) <= free
            if after is not None and after + 1 in free:
                assert pages[0] == after + 1
            free -= set(pages)
            held.append(pages)
        elif held:
            pages = held.pop(int(rng.integers(len(held))))
            pool.give(pages[::-1])
            free |= set(pages)
        assert pool.num_free == len(free) and pool.free_pages() == sorted(free)
        assert pool.index_problems() == []
