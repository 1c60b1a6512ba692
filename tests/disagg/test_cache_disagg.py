"""Receiver reservations (`disagg_prepare_recv`) and sender routing (`disagg_mark_send`)."""

from __future__ import annotations

import numpy as np
import pytest

from disagg import posmap
from disagg.cache import PagedKVCache
from disagg.errors import CacheError, ForwardStateError, PositionMapError


def forward(cache: PagedKVCache, seq_ids: list[int], lens: list[int]):
    plan = cache.begin_forward(seq_ids, lens)
    cache.end_forward()
    cache.check_integrity()
    return plan


def fragmented_receiver() -> tuple[PagedKVCache, list[int]]:
    """A receiver whose only free pages are 0, 2, 3: seq 3's 10 slots land on pages 0, 2, 3."""
    recv = PagedKVCache(num_pages=5, page_size=4)
    for seq_id, length in ((1, 4), (2, 4), (4, 8), (5, 4)):  # pages 0; 1; 2, 3; 4
        recv.add_sequence(seq_id)
        forward(recv, [seq_id], [length])
    recv.remove_sequence(1)
    recv.remove_sequence(4)  # free: [0], [2, 3]; no extent holds 3 pages
    recv.add_sequence(3)
    cmap = recv.disagg_prepare_recv(3, 10)
    recv.end_forward()
    recv.check_integrity()
    return recv, cmap


def test_prepare_recv_reserves_and_returns_tvm_compressed_map() -> None:
    recv, cmap = fragmented_receiver()
    # Slots 0..3 (page 0), then 8..11 and 12, 13 (pages 2, 3: consecutive, so one run).
    assert cmap == [2, 0, 4, 8, 6]
    assert recv.seq_length(3) == 10
    assert recv.slots(3).tolist() == posmap.decompress(cmap).tolist()
    # The receiver decodes on from there.
    plan = forward(recv, [3], [1])
    assert plan.append_slots.tolist() == [14]
    assert plan.page_indices.tolist() == [0, 2, 3]


def test_prepare_recv_must_be_closed_and_needs_existing_sequence() -> None:
    recv = PagedKVCache(num_pages=4, page_size=4)
    recv.add_sequence(0)
    recv.disagg_prepare_recv(0, 3)
    with pytest.raises(ForwardStateError, match="still open"):
        recv.disagg_prepare_recv(0, 3)
    with pytest.raises(ForwardStateError):
        recv.begin_forward([0], [1])
    recv.end_forward()
    with pytest.raises(ForwardStateError, match="no forward is open"):
        recv.end_forward()


def test_sender_pushes_every_token_into_the_receivers_slots() -> None:
    recv, cmap = fragmented_receiver()
    send = PagedKVCache(num_pages=8, page_size=4)
    send.add_sequence(5)
    send.disagg_mark_send(5, 0, cmap, recver_pe=1)
    plan = forward(send, [5], [10])
    assert plan.push_slots.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    assert plan.push_pes.tolist() == [1] * 10
    assert plan.copy_local_slots.size == 0
    assert plan.send_seq_ids.tolist() == [5]
    assert plan.send_pes.tolist() == [1]
    assert plan.send_complete.tolist() == [True]
    # Continuing past the map's end is refused, with the cache unchanged.
    with pytest.raises(PositionMapError, match="sequence 5 would push positions up to 10"):
        send.begin_forward([5], [1])


def test_mark_send_with_existing_kv_reports_page_to_page_copies() -> None:
    _, cmap = fragmented_receiver()  # 10 receiver slots for sender positions 2..11
    send = PagedKVCache(num_pages=8, page_size=4)
    send.add_sequence(5)
    send.add_sequence(6)
    forward(send, [5], [6])  # positions 0..5 at slots 0..5 (pages 0, 1)
    send.disagg_mark_send(5, 2, cmap, recver_pe=3)
    # Positions 2..5 exist: copied page to page by the next plan, even without seq 5 in it.
    plan = forward(send, [6], [1])
    assert plan.copy_local_slots.tolist() == [2, 3, 4, 5]
    assert plan.copy_remote_slots.tolist() == [0, 1, 2, 3]
    assert plan.copy_pes.tolist() == [3, 3, 3, 3]
    assert plan.push_slots.tolist() == [-1]
    assert plan.send_seq_ids.tolist() == [5]
    assert plan.send_complete.tolist() == [False]
    # New tokens (positions 6..11) are pushed to map entries 4..9; the last one completes it.
    plan = forward(send, [6, 5], [1, 6])
    assert plan.copy_local_slots.size == 0
    assert plan.push_slots.tolist() == [-1, 8, 9, 10, 11, 12, 13]
    assert plan.push_pes.tolist() == [-1, 3, 3, 3, 3, 3, 3]
    assert plan.send_complete.tolist() == [True]


def test_existing_kv_exactly_covering_the_map_completes_with_copies() -> None:
    send = PagedKVCache(num_pages=4, page_size=4)
    send.add_sequence(0)
    forward(send, [0], [5])
    send.disagg_mark_send(0, 3, [1, 40, 2], recver_pe=0)
    plan = forward(send, [], [])
    assert plan.copy_local_slots.tolist() == [3, 4]
    assert plan.copy_remote_slots.tolist() == [40, 41]
    assert plan.send_complete.tolist() == [True]


def test_begin_past_length_sends_only_later_tokens() -> None:
    send = PagedKVCache(num_pages=4, page_size=4)
    send.add_sequence(0)
    forward(send, [0], [2])
    send.disagg_mark_send(0, 4, [1, 100, 3], recver_pe=2)
    plan = forward(send, [0], [5])
    assert plan.push_slots.tolist() == [-1, -1, 100, 101, 102]
    assert plan.send_complete.tolist() == [True]


def test_skipped_remote_slots_are_not_copied_or_pushed() -> None:
    send = PagedKVCache(num_pages=4, page_size=4)
    send.add_sequence(0)
    forward(send, [0], [3])
    cmap = posmap.compress([7, -1, 9, -1, 20])
    send.disagg_mark_send(0, 0, cmap, recver_pe=1)
    plan = forward(send, [0], [2])
    assert plan.copy_local_slots.tolist() == [0, 2]
    assert plan.copy_remote_slots.tolist() == [7, 9]
    assert plan.push_slots.tolist() == [-1, 20]
    assert plan.push_pes.tolist() == [-1, 1]
    assert plan.send_complete.tolist() == [True]


def test_popn_drops_copies_of_popped_positions_and_pushes_resend_them() -> None:
    send = PagedKVCache(num_pages=4, page_size=4)
    send.add_sequence(0)
    forward(send, [0], [6])
    send.disagg_mark_send(0, 0, [1, 50, 8], recver_pe=1)
    send.popn(0, 2)
    send.check_integrity()
    plan = forward(send, [0], [2])
    assert plan.copy_remote_slots.tolist() == [50, 51, 52, 53]
    assert plan.push_slots.tolist() == [54, 55]
    assert plan.append_slots.tolist() == [4, 5]


def test_second_mark_send_replaces_the_first_and_remove_drops_it() -> None:
    send = PagedKVCache(num_pages=4, page_size=4)
    send.add_sequence(0)
    forward(send, [0], [2])
    send.disagg_mark_send(0, 0, [1, 10, 4], recver_pe=1)
    send.disagg_mark_send(0, 1, [1, 90, 3], recver_pe=2)
    plan = forward(send, [], [])
    assert plan.copy_remote_slots.tolist() == [90]
    assert plan.copy_pes.tolist() == [2]
    send.disagg_mark_send(0, 0, [1, 10, 4], recver_pe=1)
    send.remove_sequence(0)
    assert forward(send, [], []).copy_local_slots.size == 0
    assert send.num_free_pages == 4


def test_receiver_round_trip_through_a_simulated_kv_store() -> None:
    recv, cmap = fragmented_receiver()
    send = PagedKVCache(num_pages=8, page_size=4)
    send.add_sequence(5)
    forward(send, [5], [3])  # a cached prefix of 3 tokens on the sender...
    send_kv = np.full(8 * 4, -1)
    send_kv[send.slots(5)] = [100, 101, 102]
    send.disagg_mark_send(5, 0, cmap, recver_pe=0)  # ...all 10 tokens go to the receiver
    recv_kv = np.full(8 * 4, -1)
    plan = forward(send, [5], [7])
    send_kv[plan.append_slots] = np.arange(103, 110)
    recv_kv[plan.copy_remote_slots] = send_kv[plan.copy_local_slots]
    recv_kv[plan.push_slots] = np.arange(103, 110)
    assert recv_kv[recv.slots(3)].tolist() == list(range(100, 110))


def test_prepare_recv_refuses_slots_a_pending_fork_copy_writes(snapshot) -> None:
    cache = PagedKVCache(num_pages=8, page_size=4)
    cache.add_sequence(0)
    forward(cache, [0], [3])
    cache.fork_sequence(0, 1, fork_pos=3)  # pending copy: page 0 slots 0..2 -> page 1 slots 4..6
    cache.popn(1, 2)  # child keeps 1 token; its page still awaits the copy
    before = snapshot(cache)
    with pytest.raises(CacheError, match=r"slots \[5, 6\] that a pending copy"):
        cache.disagg_prepare_recv(1, 2)
    assert snapshot(cache) == before
    # A receiver whose slots no copy touches is fine, and the copy stays pending.
    cache.add_sequence(2)
    assert cache.disagg_prepare_recv(2, 2) == [1, 8, 2]
    cache.end_forward()
    assert forward(cache, [1], [1]).fork_dst_slots.tolist() == [4, 5, 6]


@pytest.mark.parametrize(
    ("begin", "cmap", "pe", "error", "fragment"),
    [
        (0, [1, 0, 3], 1, PositionMapError, "must cover at least max\\(that, 1\\) tokens, got 3"),
        (2, [1, 0, 1], 1, PositionMapError, "2 of them from begin=2"),
        (5, [0], 1, PositionMapError, "got 0"),
        (0, [2, 0, 4], 1, PositionMapError, "expected 5 entries"),
        (-1, [1, 0, 8], 1, CacheError, "begin=-1"),
        (0, [1, 0, 8], -2, CacheError, "recver_pe=-2"),
    ],
)
def test_bad_mark_send_leaves_cache_unchanged(begin, cmap, pe, error, fragment, snapshot) -> None:
    send = PagedKVCache(num_pages=4, page_size=4)
    send.add_sequence(0)
    forward(send, [0], [4])
    before = snapshot(send)
    with pytest.raises(error, match=fragment):
        send.disagg_mark_send(0, begin, cmap, pe)
    assert snapshot(send) == before


def test_windowed_sequences_neither_send_nor_become_windowed_while_sending() -> None:
    cache = PagedKVCache(num_pages=4, page_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.enable_sliding_window(0, 4, 0)
    with pytest.raises(CacheError, match="sequence 0 has a sliding window"):
        cache.disagg_mark_send(0, 0, [1, 0, 4], 1)
    cache.disagg_mark_send(1, 0, [1, 0, 4], 1)
    with pytest.raises(CacheError, match="sequence 1 is marked for sending"):
        cache.enable_sliding_window(1, 4, 0)
    with pytest.raises(CacheError, match="sequence 1 is marked for sending"):
        cache.disagg_prepare_recv(1, 1)
