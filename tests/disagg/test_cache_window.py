"""Sliding windows with attention sinks, worked step by step from TVM's SlideWindowForSequence."""

from __future__ import annotations

import numpy as np
import pytest

from disagg.cache import PagedKVCache
from disagg.errors import CacheError


def step(cache: PagedKVCache, seq_id: int, n: int = 1):
    plan = cache.begin_forward([seq_id], [n])
    cache.end_forward()
    cache.check_integrity()
    return plan


def test_window_with_sinks_slides_pages_off_and_keeps_sink_page() -> None:
    cache = PagedKVCache(num_pages=16, page_size=4)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=8, sink_size=2)
    plan = step(cache, 0, 8)  # pages 0, 1; the window is full, nothing slides
    assert plan.append_slots.tolist() == list(range(8))
    # Each step below: (slot written, hole [sink_size, sliding_window_offset), last_page_len).
    # Token 8: page 2 is reserved; the first slide pins sinks = 2 and moves the window start to
    # in-block slot 3 (position 2 slid off); the token lands at slot offset 7 - 2 + 3 = 8.
    # Tokens 9..11 shift the window start to 4, 5, 6; token 12 needs page 3; token 13 moves the
    # window start to 8 = page 2, so page 1 holds only slid-off positions and is freed (the
    # window start is then rebased to 1 * 4 + 0 = 4 on the remaining pages [0, 2, 3]).
    expected = [
        (8, (2, 3), 1),
        (9, (2, 4), 2),
        (10, (2, 5), 3),
        (11, (2, 6), 4),
        (12, (2, 7), 1),
        (13, (2, 4), 2),
    ]
    for slot, hole, last_len in expected:
        plan = step(cache, 0)
        assert plan.append_slots.tolist() == [slot]
        assert plan.positions.tolist() == [8]  # TVM's RoPE position: in-cache length before
        assert (int(plan.sink_size[0]), int(plan.sliding_window_offset[0])) == hole
        assert plan.last_page_len.tolist() == [last_len]
    assert plan.page_indices.tolist() == [0, 2, 3]
    assert cache.seq_length(0) == 8
    # Sinks (tokens 0, 1) then tokens 8..13: slots 0, 1, 8..13.
    assert cache.slots(0).tolist() == [0, 1, 8, 9, 10, 11, 12, 13]
    assert cache.num_free_pages == 13
    # Page 1 was freed by the slide: the next reservation anywhere takes it first.
    cache.add_sequence(1)
    assert step(cache, 1).page_indices.tolist() == [1]


def test_window_without_sinks() -> None:
    cache = PagedKVCache(num_pages=8, page_size=2)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=3, sink_size=0)
    step(cache, 0, 3)  # pages 0, 1; slots 0, 1, 2
    # Token 3 fits page 1 (slot 3); the slide moves the window start to in-block slot 1.
    assert step(cache, 0).append_slots.tolist() == [3]
    # Token 4 needs page 2; the window start reaches slot 2 = page 1, so page 0 is freed and the
    # start is rebased to 0 on pages [1, 2]; the token lands at offset 2 -> page 2, slot 4.
    plan = step(cache, 0)
    assert plan.append_slots.tolist() == [4]
    assert plan.page_indices.tolist() == [1, 2]
    assert (int(plan.sink_size[0]), int(plan.sliding_window_offset[0])) == (0, 0)
    assert cache.slots(0).tolist() == [2, 3, 4]
    assert cache.num_free_pages == 6


def test_long_append_drops_tokens_that_slide_off_before_they_are_written() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=6, sink_size=2)
    plan = step(cache, 0, 10)
    # Tokens 0, 1 are sinks; tokens 2..5 slide off inside the same append (slot -1); 6..9 stay.
    slots = plan.append_slots.tolist()
    assert slots[2:6] == [-1, -1, -1, -1]
    assert cache.slots(0).tolist() == slots[:2] + slots[6:]
    assert cache.seq_length(0) == 6


def test_temporary_pages_when_the_free_list_is_empty() -> None:
    # TVM borrows placeholder pages when none is free, slides, then hands back real ones.
    cache = PagedKVCache(num_pages=2, page_size=2)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=2, sink_size=0)
    step(cache, 0, 2)  # page 0 holds the window, page 1 free
    cache.add_sequence(1)
    step(cache, 1, 1)  # page 1 taken: no page free
    plan = step(cache, 0, 2)  # needs a page: borrows, slides page 0 off, reuses it
    assert plan.page_indices.tolist() == [0]
    assert cache.num_free_pages == 0


def test_fork_of_windowed_parent_within_sinks_only() -> None:
    cache = PagedKVCache(num_pages=16, page_size=2)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=6, sink_size=4)
    step(cache, 0, 9)  # slid: sinks 0..3, window of 2
    with pytest.raises(CacheError, match="within its 4 sink tokens; got fork_pos=5"):
        cache.fork_sequence(0, 1, fork_pos=5)
    cache.fork_sequence(0, 1, fork_pos=3)  # splits the slid block: one sink page becomes shared
    cache.check_integrity()
    assert cache.slots(1).tolist()[:2] == cache.slots(0).tolist()[:2]
    assert cache.seq_length(1) == 3
    # The parent keeps sliding correctly with its sinks now partly in a shared prefix block.
    for _ in range(5):
        step(cache, 0)
    assert cache.seq_length(0) == 6


def test_popn_on_a_slid_window_and_back_into_sinks() -> None:
    cache = PagedKVCache(num_pages=16, page_size=4)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=8, sink_size=2)
    step(cache, 0, 14)
    before = cache.slots(0).tolist()
    cache.popn(0, 3)
    cache.check_integrity()
    assert cache.slots(0).tolist() == before[:5]
    cache.popn(0, 4)  # into the sinks: the block forgets its hole and frees those pages
    cache.check_integrity()
    assert cache.slots(0).tolist() == before[:1]
    assert cache.num_free_pages == 15
    for _ in range(10):
        step(cache, 0)
    assert cache.seq_length(0) == 8


@pytest.mark.parametrize(
    ("window", "sink", "fragment"),
    [(0, 0, "window_size=0"), (4, 4, "sink_size=4"), (4, -1, "sink_size=-1"), (8, 2, "window_size > 8")],
)
def test_bad_window_arguments(window: int, sink: int, fragment: str, snapshot) -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    step(cache, 0, 8)
    cache.fork_sequence(0, 1)  # seq 1 has a shared prefix of 8
    before = snapshot(cache)
    with pytest.raises(CacheError, match=fragment):
        cache.enable_sliding_window(1, window, sink)
    assert snapshot(cache) == before


def test_window_twice_raises() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, 4, 1)
    with pytest.raises(CacheError, match="already has a window of 4"):
        cache.enable_sliding_window(0, 5, 1)


def test_page_table_with_hole_reads_exactly_the_kept_slots() -> None:
    cache = PagedKVCache(num_pages=32, page_size=4)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=11, sink_size=3)
    for n in [5, 1, 7, 2, 1, 1, 9, 1, 1, 1]:
        plan = step(cache, 0, n)
        pages = plan.page_indices[plan.page_indptr[0] : plan.page_indptr[1]]
        slots = (pages[:, None] * 4 + np.arange(4)).reshape(-1)
        slots = slots[: (len(pages) - 1) * 4 + int(plan.last_page_len[0])]
        keep = np.ones(slots.size, dtype=bool)
        keep[int(plan.sink_size[0]) : int(plan.sliding_window_offset[0])] = False
        assert slots[keep].tolist() == cache.slots(0).tolist()


def test_first_slide_inside_one_long_append_writes_sinks_and_frees_pages() -> None:
    cache = PagedKVCache(num_pages=16, page_size=2)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window_size=6, sink_size=2)
    # 12 tokens reserve pages 0..5. The slide pins sinks = 2 (page 0) and slides 6 positions:
    # the window start moves to in-block slot 8 (page index 4), so pages 1, 2, 3 are freed and
    # the start is rebased to slot 2. Tokens 0, 1 go to the sinks, 2..7 are dropped (-1), and
    # 8..11 land on pages 4, 5.
    plan = step(cache, 0, 12)
    assert plan.append_slots.tolist() == [0, 1, -1, -1, -1, -1, -1, -1, 8, 9, 10, 11]
    assert plan.page_indices.tolist() == [0, 4, 5]
    assert cache.slots(0).tolist() == [0, 1, 8, 9, 10, 11]
    assert cache.num_free_pages == 13
