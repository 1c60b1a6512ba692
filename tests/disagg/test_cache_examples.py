"""Exact page ids, page tables and slot copies, worked by hand from TVM's PagedAttentionKVCacheObj.

TVM facts used below (seed tvm_paged_kv_cache.cc): a fresh cache hands pages out 0, 1, 2, ...
(its free list starts as [num_pages-1, ..., 1, 0] and `GetFreePage` pops the back). After frees,
TVM reuses the most recently freed page first; this cache instead hands out free extents so that
runs stay long (`disagg.pages`): the page after a growing sequence's last one, else the
best-fitting free extent, ascending. Block indices come from a stack as in TVM.
"""

from __future__ import annotations

import numpy as np
import pytest

from disagg.cache import PagedKVCache
from disagg.errors import OutOfPages


def forward(cache: PagedKVCache, seq_ids: list[int], lens: list[int]):
    plan = cache.begin_forward(seq_ids, lens)
    cache.end_forward()
    cache.check_integrity()
    return plan


def table(plan, i: int) -> list[int]:
    return plan.page_indices[plan.page_indptr[i] : plan.page_indptr[i + 1]].tolist()


def test_prefill_then_decode_allocates_pages_in_runs() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    # Seq 0 takes 2 pages (0, 1) for 5 tokens, then seq 1 takes page 2 for 3 tokens.
    plan = forward(cache, [0, 1], [5, 3])
    assert plan.qo_indptr.tolist() == [0, 5, 8]
    assert plan.page_indptr.tolist() == [0, 2, 3]
    assert plan.page_indices.tolist() == [0, 1, 2]
    assert plan.last_page_len.tolist() == [1, 3]
    assert plan.append_slots.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    for name in ("qo_indptr", "page_indptr", "page_indices", "last_page_len", "append_slots", "positions"):
        assert getattr(plan, name).dtype == np.int32, name
    # Decode: seq 0 writes offset 1 of page 1; seq 1 fills page 2 (last_page_len 4).
    plan = forward(cache, [0, 1], [1, 1])
    assert plan.append_slots.tolist() == [5, 11]
    assert plan.positions.tolist() == [5, 3]
    assert plan.last_page_len.tolist() == [2, 4]
    # Next decode: seq 1 needs a fresh page, the next on the stack: 3.
    plan = forward(cache, [1, 0], [1, 1])
    assert plan.page_indices.tolist() == [2, 3, 0, 1]
    assert plan.append_slots.tolist() == [12, 6]
    assert cache.num_free_pages == 4
    # Removing seq 0 frees pages 0, 1 (TVM would hand out 1, 0, 4: three runs). Free extents are
    # [0, 1] and [4..7]; 3 pages fit only the second: one run.
    cache.remove_sequence(0)
    cache.add_sequence(2)
    plan = forward(cache, [2], [9])
    assert plan.page_indices.tolist() == [4, 5, 6]
    assert plan.append_slots.tolist() == list(range(16, 25))
    assert cache.slots(2, 3, 5).tolist() == [19, 20]
    # Two pages fit the freed extent exactly (best fit keeps the larger one whole).
    cache.add_sequence(3)
    assert forward(cache, [3], [8]).page_indices.tolist() == [0, 1]


def test_fork_at_page_boundary_shares_pages_and_parent_gets_new_block() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [8])  # pages 0, 1 in block 0
    # fork_pos = 8 = seq_length and 8 % 4 == 0: TVM gives the parent a new empty block (1); the
    # child block (2) links to block 0, whose ref count becomes 2. Nothing is copied.
    cache.fork_sequence(0, 1)
    blocks = cache._blocks.blocks
    assert (cache._seqs[0].last_block_idx, cache._seqs[1].last_block_idx) == (1, 2)
    assert blocks[0].external_ref_cnt == 2
    assert blocks[1].parent_idx == 0 and blocks[2].parent_idx == 0
    plan = forward(cache, [0, 1], [1, 1])
    assert [table(plan, 0), table(plan, 1)] == [[0, 1, 2], [0, 1, 3]]
    assert plan.append_slots.tolist() == [8, 12]
    assert plan.fork_src_slots.size == 0 and plan.fork_dst_slots.size == 0
    # Removing the parent frees only its private page 2; the shared pages stay for the child.
    cache.remove_sequence(0)
    cache.check_integrity()
    assert cache.num_free_pages == 8 - 3
    assert blocks[0].external_ref_cnt == 1
    cache.remove_sequence(1)
    assert cache.num_free_pages == 8


def test_fork_mid_page_splits_block_and_reports_partial_copy() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [6])  # pages 0, 1
    # fork_pos 5: in_page_offset 1, one whole page (0) moves to a new shared block; the child
    # copies slot 0 of page 1 (the parent's position 4) into a fresh page 2.
    cache.fork_sequence(0, 1, fork_pos=5)
    cache.check_integrity()
    assert cache.seq_length(1) == 5
    assert cache.slots(1).tolist() == [0, 1, 2, 3, 8]
    assert cache.slots(0).tolist() == [0, 1, 2, 3, 4, 5]
    plan = forward(cache, [0, 1], [1, 2])
    # The copy is reported in the next plan, to run before its appends.
    assert plan.fork_src_slots.tolist() == [4]
    assert plan.fork_dst_slots.tolist() == [8]
    assert [table(plan, 0), table(plan, 1)] == [[0, 1], [0, 2]]
    assert plan.append_slots.tolist() == [6, 9, 10]
    assert plan.positions.tolist() == [6, 5, 6]
    assert plan.last_page_len.tolist() == [3, 3]
    # Drained: the next plan carries no copy.
    assert forward(cache, [1], [1]).fork_src_slots.size == 0


def test_fork_at_position_zero_shares_nothing() -> None:
    cache = PagedKVCache(num_pages=4, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [6])
    cache.fork_sequence(0, 1, fork_pos=0)
    assert cache.seq_length(1) == 0
    assert cache._blocks.blocks[cache._seqs[1].last_block_idx].parent_idx == -1
    plan = forward(cache, [1], [2])
    assert table(plan, 0) == [2]
    assert plan.fork_src_slots.size == 0


def test_fork_inside_a_shared_prefix_block() -> None:
    cache = PagedKVCache(num_pages=16, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [8])  # block 0: pages 0, 1
    cache.fork_sequence(0, 1)  # seq 0 -> block 1, seq 1 -> block 2, both under block 0
    forward(cache, [0, 1], [2, 3])  # seq 0 gets page 2, seq 1 page 3
    # Fork seq 1 at 6: inside block 0 (not seq 1's last block). TVM splits block 0: its first page
    # moves to a new block 4 (ref 2: block 0 and the child block 3); the child copies 2 slots of
    # page 1 into the next free page, 4.
    cache.fork_sequence(1, 2, fork_pos=6)
    cache.check_integrity()
    blocks = cache._blocks.blocks
    assert cache._seqs[2].last_block_idx == 3
    assert blocks[3].parent_idx == 4 and blocks[0].parent_idx == 4
    assert blocks[4].page_ids == [0] and blocks[0].page_ids == [1]
    assert (blocks[4].external_ref_cnt, blocks[0].external_ref_cnt) == (2, 2)
    assert cache.slots(2).tolist() == [0, 1, 2, 3, 16, 17]
    plan = forward(cache, [2], [1])
    assert plan.fork_src_slots.tolist() == [4, 5]
    assert plan.fork_dst_slots.tolist() == [16, 17]
    assert plan.append_slots.tolist() == [18]


def test_popn_within_own_pages_frees_last_page_first() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [10])  # pages 0, 1, 2
    cache.popn(0, 7)  # 3 tokens left: pages 2 then 1 are pushed back; 1 is on top
    assert cache.seq_length(0) == 3
    assert cache.num_free_pages == 7
    cache.add_sequence(1)
    plan = forward(cache, [1], [5])
    assert table(plan, 0) == [1, 2]


def test_popn_into_shared_prefix_forks_a_private_copy() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [8])  # block 0: pages 0, 1
    cache.fork_sequence(0, 1)  # seq 1: empty block 2 under block 0
    forward(cache, [1], [1])  # seq 1 gets page 2
    # popn(1, 3): block 2 (1 token) is freed whole (page 2 back on top), 2 tokens remain to pop
    # inside shared block 0. TVM forks at 9 - 3 = 6 and removes the old sequence: block 0 splits
    # (page 0 moves to a new block), and the partial page (page 1, 2 slots) is copied into the
    # most recently freed page, 2.
    cache.popn(1, 3)
    cache.check_integrity()
    assert cache.seq_length(1) == 6
    assert cache.slots(1).tolist() == [0, 1, 2, 3, 8, 9]
    assert cache.slots(0).tolist() == list(range(8))
    assert cache.num_free_pages == 8 - 3
    plan = forward(cache, [1, 0], [1, 1])
    assert plan.fork_src_slots.tolist() == [4, 5]
    assert plan.fork_dst_slots.tolist() == [8, 9]
    assert plan.append_slots.tolist() == [10, 12]  # seq 0 writes its new page 3
    cache.remove_sequence(0)
    cache.remove_sequence(1)
    assert cache.num_free_pages == 8


def test_popn_whole_block_back_to_shared_boundary_needs_no_copy() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [8])
    cache.fork_sequence(0, 1)
    forward(cache, [1], [3])
    cache.popn(1, 3)  # n == block length: TVM keeps the (now empty) block; no fork
    cache.check_integrity()
    assert cache.seq_length(1) == 8 and cache.num_free_pages == 6
    cache.popn(1, 4)  # pops into the shared block at a page boundary: fork without a copy
    cache.check_integrity()
    assert cache.slots(1).tolist() == [0, 1, 2, 3]
    assert forward(cache, [1], [1]).fork_src_slots.size == 0


def test_begin_forward_drains_copies_of_sequences_outside_the_batch() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    cache.add_sequence(9)
    forward(cache, [0], [3])  # page 0
    cache.fork_sequence(0, 1, fork_pos=2)  # copies slots 0, 1 into the next free page, 1
    plan = forward(cache, [9], [1])  # seq 9 is not the fork's; its page is 2
    assert plan.fork_src_slots.tolist() == [0, 1]
    assert plan.fork_dst_slots.tolist() == [4, 5]
    assert plan.append_slots.tolist() == [8]
    assert forward(cache, [], []).num_tokens == 0


def test_copy_chain_through_a_removed_sequence_is_kept_and_its_page_parked() -> None:
    cache = PagedKVCache(num_pages=16, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [6])  # pages 0, 1
    cache.fork_sequence(0, 1, 5)  # pending copy: page 1 slot 0 -> fresh page 2
    cache.fork_sequence(1, 2, 5)  # pending copy: page 2 slot 0 -> fresh page 3 (reads the first)
    # Removing seq 1 frees page 2, but the second copy still reads it: both copies stay, and
    # page 2 is parked instead of going back on the free stack.
    cache.remove_sequence(1)
    cache.check_integrity()
    assert cache.num_free_pages == 16 - 4
    assert cache.slots(2).tolist() == [0, 1, 2, 3, 12]
    plan = cache.begin_forward([2], [1])
    # The plan's copies run as one parallel batch: the second reads the first's source.
    assert plan.fork_src_slots.tolist() == [4, 4]
    assert plan.fork_dst_slots.tolist() == [8, 12]
    assert plan.append_slots.tolist() == [13]
    cache.end_forward()  # the copies ran: page 2 is free again (the best fit for one page)
    cache.check_integrity()
    cache.add_sequence(3)
    assert forward(cache, [3], [1]).page_indices.tolist() == [2]


def test_removing_a_fork_child_drops_its_copy() -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [3])
    cache.fork_sequence(0, 1)  # copy of 3 slots into page 1
    cache.remove_sequence(1)  # nobody can read page 1: the copy is dropped, page 1 freed now
    cache.check_integrity()
    assert cache.num_free_pages == 7
    assert forward(cache, [0], [1]).fork_src_slots.size == 0


def test_copy_source_page_is_parked_across_prepare_recv_until_drained() -> None:
    cache = PagedKVCache(num_pages=4, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [3])  # page 0
    cache.fork_sequence(0, 1)  # pending copy: page 0 slots 0..2 -> page 1
    cache.remove_sequence(0)  # page 0 is the copy's source: parked, not free
    cache.check_integrity()
    assert cache.num_free_pages == 2
    cache.add_sequence(2)
    assert cache.disagg_prepare_recv(2, 8) == [1, 8, 8]  # pages 2, 3; page 0 is not handed out
    cache.end_forward()
    cache.add_sequence(3)
    with pytest.raises(OutOfPages):
        cache.disagg_prepare_recv(3, 1)
    plan = cache.begin_forward([1], [1])  # prepare_recv did not drain: this plan carries the copy
    assert plan.fork_src_slots.tolist() == [0, 1, 2]
    assert plan.fork_dst_slots.tolist() == [4, 5, 6]
    assert cache.num_free_pages == 0  # still parked while the copy's forward is open
    cache.end_forward()
    cache.check_integrity()
    assert cache.num_free_pages == 1
    assert cache.disagg_prepare_recv(3, 1) == [1, 0, 1]
    cache.end_forward()


def test_seq_lengths_reads_live_sequences_only() -> None:
    from disagg.errors import CacheError, SequenceNotFound

    cache = PagedKVCache(16, 4, prefix_caching=True)
    for i, n in enumerate([5, 8, 1]):
        cache.add_sequence(i)
        cache.begin_forward([i], [n])
        cache.end_forward()
    assert cache.seq_lengths([2, 0, 1]) == [1, 5, 8] == [cache.seq_length(i) for i in (2, 0, 1)]
    assert cache.seq_lengths([]) == []
    cache.cache_tokens(1, list(range(8)))
    cache.remove_sequence(1)  # kept cached under a negative id, invisible to callers
    cached = min(cache._seqs)
    assert cached < 0
    for ids, error in (([0, 1], SequenceNotFound), ([0, cached], SequenceNotFound), ([0, "x"], CacheError),
                       ([[0]], CacheError)):  # as `seq_length` raises for each
        with pytest.raises(error):
            cache.seq_lengths(ids)
        with pytest.raises(error):
            cache.seq_length(ids[-1])
    with pytest.raises(SequenceNotFound, match=f"begin_forward: sequence {cached} is not in the cache"):
        cache.begin_forward([0, cached], [1, 1])
    assert cache.seq_lengths([0]) == [5]
