"""Chains of forks before any forward: the plan's fork copies must run as ONE parallel batch.

A fork of a fork leaves two pending copies, the second reading the first's destination. Consumers
(the KV pusher, the engines) apply a plan's fork copies in one `copy_slots` launch, whose pairs
run in parallel; so the plan must already resolve the chain to the original source slots. Each
test plays the plan's fork copies as one batched numpy assignment (every read before any write,
like the launch) and checks what each sequence then reads.
"""

from __future__ import annotations

import numpy as np
import pytest

from disagg.cache import PagedKVCache


def play_batched(kv: np.ndarray, plan) -> None:
    """The fork copies as one parallel batch, then the appends (tags = 1000 + token row)."""
    src, dst = plan.fork_src_slots, plan.fork_dst_slots
    assert np.intersect1d(src, dst).size == 0, "a fork copy reads a slot another copy writes"
    assert np.unique(dst).size == dst.size, "two fork copies write one slot"
    kv[dst] = kv[src]  # numpy reads every source before it writes: a parallel launch
    kv[plan.append_slots] = 1000 + np.arange(plan.num_tokens)


def reads(cache: PagedKVCache, kv: np.ndarray, seq_id: int) -> list[int]:
    return kv[cache.slots(seq_id)].tolist()


def test_fork_of_a_fork_then_a_forward_reads_the_original_kv() -> None:
    """The review's repro: 3-token seq 0; fork 0 -> 1; fork 1 -> 2; append one token to 2."""
    cache = PagedKVCache(num_pages=8, page_size=4)
    kv = np.zeros(8 * 4, dtype=np.int64)
    cache.add_sequence(0)
    plan = cache.begin_forward([0], [3])
    play_batched(kv, plan)
    cache.end_forward()
    cache.fork_sequence(0, 1)
    cache.fork_sequence(1, 2)
    plan = cache.begin_forward([2], [1])
    play_batched(kv, plan)
    cache.end_forward()
    cache.check_integrity()
    assert reads(cache, kv, 0) == [1000, 1001, 1002]
    assert reads(cache, kv, 1) == [1000, 1001, 1002]
    assert reads(cache, kv, 2) == [1000, 1001, 1002, 1000]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("remove_middle", [False, True])
def test_fork_of_a_fork_of_a_fork(page_size: int, remove_middle: bool) -> None:
    cache = PagedKVCache(num_pages=32, page_size=page_size)
    kv = np.zeros(32 * page_size, dtype=np.int64)
    cache.add_sequence(0)
    plan = cache.begin_forward([0], [7])
    play_batched(kv, plan)
    cache.end_forward()
    cache.fork_sequence(0, 1, 6)
    cache.fork_sequence(1, 2, 5)
    cache.fork_sequence(2, 3, -1)
    if remove_middle:  # the chain runs through freed (parked) pages
        cache.remove_sequence(1)
        cache.remove_sequence(2)
    cache.check_integrity()
    plan = cache.begin_forward([3], [2])
    play_batched(kv, plan)
    cache.end_forward()
    cache.check_integrity()
    assert reads(cache, kv, 3) == [1000, 1001, 1002, 1003, 1004, 1000, 1001]
    if not remove_middle:
        assert reads(cache, kv, 1) == [1000 + i for i in range(6)]
        assert reads(cache, kv, 2) == [1000 + i for i in range(5)]
    assert reads(cache, kv, 0) == [1000 + i for i in range(7)]


def test_chain_through_a_received_slot_reads_each_slot_from_its_writer() -> None:
    """Seq 1's page holds two copied slots and one received slot when it is forked again."""
    cache = PagedKVCache(num_pages=8, page_size=8)
    kv = np.zeros(8 * 8, dtype=np.int64)
    cache.add_sequence(0)
    plan = cache.begin_forward([0], [2])
    play_batched(kv, plan)
    cache.end_forward()
    cache.fork_sequence(0, 1)  # pending: 2 slots of page 0 -> seq 1's page
    slots = np.asarray(cache.slots(1))
    cache.disagg_prepare_recv(1, 1)
    received = int(cache.slots(1)[2])
    cache.end_forward()
    kv[received] = 555  # the sender's KV lands now, before the copies run
    cache.fork_sequence(1, 2)  # pending: 3 slots of seq 1's page (2 of them not written yet)
    plan = cache.begin_forward([2], [1])
    play_batched(kv, plan)
    cache.end_forward()
    assert slots.tolist() == cache.slots(1)[:2].tolist()
    assert reads(cache, kv, 1) == [1000, 1001, 555]
    assert reads(cache, kv, 2) == [1000, 1001, 555, 1000]
