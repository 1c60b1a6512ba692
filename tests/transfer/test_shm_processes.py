"""End to end on the shm heap, 2 and 3 processes: PagedKVCache -> KVPusher -> the receiver's pages.

A receiver reserves pages (`disagg_prepare_recv`) and arms a doorbell; the sender marks the
sequence (`disagg_mark_send`) and runs a fake 4-layer prefill with random K/V per layer, pushing
as it goes; the receiver waits for the doorbell and finds bit-exact K/V at its slots in every
layer, and nothing else in its cache changed. Also: crashes leave nothing in /dev/shm.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import transfer_scenarios
from proc_group import ProcGroup

from disagg.errors import HeapError
from disagg.transfer import new_unique_id, open_heap
from disagg.transfer.shm_heap import shm_leftovers, shm_path

GEOMETRY = dict(num_layers=4, num_pages=48, num_kv_heads=2, page_size=4, head_dim=16)
STEP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def group_factory():
    """A 3-process group shared by the module's tests (re-spawned if a test killed it)."""
    groups: list[ProcGroup] = []

    def get() -> ProcGroup:
        if not groups or groups[-1].broken:
            groups.append(ProcGroup(3))
        return groups[-1]

    yield get
    for group in groups:
        group.close()


@pytest.fixture
def start(group_factory):
    """start(world_size, force_segment_puts=False) -> group with a fresh heap open on ranks 0..n-1."""
    used: list[tuple[ProcGroup, int]] = []

    def _start(world_size: int, force_segment_puts: bool = False) -> ProcGroup:
        group = group_factory()
        uid = new_unique_id("shm")
        group.run("setup", {r: dict(backend="shm", uid=uid, rank=r, world_size=world_size, geometry=GEOMETRY,
                                    dtype="float16", force_segment_puts=force_segment_puts)
                            for r in range(world_size)}, STEP_TIMEOUT_S)
        used.append((group, world_size))
        return group

    yield _start
    for group, world_size in used:
        if not group.broken:
            leftovers = group.run("teardown", {r: {} for r in range(world_size)}, STEP_TIMEOUT_S)
            assert all(files == [] for files in leftovers.values()), leftovers


def send(group: ProcGroup, receivers: dict[int, list[dict]], sender_requests: list[dict],
         ring: bool = True) -> None:
    """Receivers reserve + arm, the sender (rank 0) marks and prefills."""
    tickets = {}
    for pe, reqs in receivers.items():
        got = group.run("prepare_recv", {pe: dict(requests=reqs)}, STEP_TIMEOUT_S)[pe]
        tickets.update({rid: dict(got[rid], pe=pe) for rid in got})
    requests = [dict(req, **tickets[req["request_id"]]) for req in sender_requests]
    group.run("prefill", {0: dict(requests=requests, ring=ring)}, STEP_TIMEOUT_S)


def check(group: ProcGroup, pe: int, begins: dict[int, int]) -> dict:
    result = group.run("check_received", {pe: dict(begins=begins)}, STEP_TIMEOUT_S)[pe]
    assert result["equal"], result
    return result


@pytest.mark.parametrize("force_segment_puts", [False, True], ids=["peer-store", "segment-puts"])
def test_two_processes_prefill_push_lands_bit_exact(start, force_segment_puts):
    group = start(2, force_segment_puts)
    send(group, {1: [dict(request_id=11, seq_id=100, length=37)]},
         [dict(request_id=11, seq_id=5, prompt_len=37)])
    result = check(group, 1, {11: 0})
    assert result["num_slots_received"] == {11: 37}
    assert group.run("sender_unchanged_outside", {0: {}})[0]


@pytest.mark.parametrize("force_segment_puts", [False, True], ids=["peer-store", "segment-puts"])
def test_existing_kv_from_begin_goes_page_to_page(start, force_segment_puts):
    group = start(2, force_segment_puts)
    # 20 tokens exist when the sequence is marked from position 9: 9..19 are copied page to
    # page, 20..32 are pushed as they are computed.
    send(group, {1: [dict(request_id=4, seq_id=40, length=33 - 9)]},
         [dict(request_id=4, seq_id=1, prompt_len=33, local_len=20, begin=9)])
    check(group, 1, {4: 9})


def test_three_processes_two_receivers_in_one_batch(start):
    group = start(3)
    send(group, {1: [dict(request_id=1, seq_id=10, length=21), dict(request_id=3, seq_id=30, length=8)],
                 2: [dict(request_id=2, seq_id=20, length=30)]},
         [dict(request_id=1, seq_id=1, prompt_len=21),
          dict(request_id=2, seq_id=2, prompt_len=30),
          dict(request_id=3, seq_id=3, prompt_len=12, local_len=6, begin=4)])
    check(group, 1, {1: 0, 3: 4})
    check(group, 2, {2: 0})
    assert group.run("sender_unchanged_outside", {0: {}})[0]


def test_doorbell_is_not_rung_before_end_forward(start):
    group = start(2)
    send(group, {1: [dict(request_id=9, seq_id=90, length=13)]},
         [dict(request_id=9, seq_id=9, prompt_len=13)], ring=False)
    assert group.run("is_rung", {1: dict(request_id=9)})[1] is False
    group.run("finish_forward", {0: {}})
    assert group.run("is_rung", {1: dict(request_id=9)})[1] is True
    check(group, 1, {9: 0})


@pytest.mark.parametrize("force_segment_puts", [False, True], ids=["peer-store", "segment-puts"])
def test_doorbell_rings_only_after_the_last_write(start, force_segment_puts):
    """The receiver spins on the doorbell while the sender pushes (pausing after every layer) and
    reads the moment it sees the ring: every layer must be there already. A ring issued before
    the last layer's write fails this (checked against a pusher that rings in begin_forward).
    Then nothing outside the requests' slots changed on either side, and a later request on the
    same ranks lands exactly (the two-GPU module runs these scenarios on shared actors)."""
    group = start(2, force_segment_puts)
    for attempt in range(3):
        rid = 900 + attempt
        got = group.run("prepare_recv", {1: dict(requests=[dict(request_id=rid, seq_id=rid, length=40)])},
                        STEP_TIMEOUT_S)[1]
        request = dict(request_id=rid, seq_id=rid, prompt_len=40, pe=1, **got[rid])
        result = group.run("ring_race", {0: dict(role="send", requests=[request], layer_delay_s=0.05),
                                         1: dict(role="watch", request_id=rid)}, STEP_TIMEOUT_S)
        assert result[1] == {"rung": True, "layers_wrong_at_ring": []}, result
    check(group, 1, {})
    send(group, {1: [dict(request_id=950, seq_id=950, length=40 - 5)]},
         [dict(request_id=950, seq_id=950, prompt_len=40, local_len=9, begin=5)])
    check(group, 1, {950: 5})
    assert group.run("sender_unchanged_outside", {0: {}})[0] is True


def test_wait_times_out_with_request_and_pes(start):
    group = start(2)
    group.run("prepare_recv", {1: dict(requests=[dict(request_id=77, seq_id=7, length=5)])})
    error = group.run("wait_error", {1: dict(request_id=77, timeout_s=0.2)})[1]
    assert error["type"] == "SignalTimeout" and error["request_id"] == 77 and error["dst_pe"] == 1
    assert "request 77" in error["message"]


def test_no_file_is_left_after_the_owner_is_killed():
    ctx = mp.get_context("spawn")
    uid = new_unique_id("shm")
    opened = ctx.Event()
    child = ctx.Process(target=transfer_scenarios.hold_heap, args=(uid, 1, 2, opened, 30.0), daemon=True)
    child.start()
    try:
        heap = open_heap("shm", uid=uid, rank=0, world_size=2, size_bytes=1 << 20, timeout_s=30)
        assert opened.wait(30)
        assert shm_leftovers(uid) == []  # unlinked as soon as every PE mapped every file
        child.kill()
        child.join(10)
        assert shm_leftovers(uid) == []
        with pytest.raises(HeapError, match=r"barrier timed out .* PE\(s\) \[1\]"):
            heap.barrier(timeout_s=0.2)
        heap.close()
    finally:
        child.kill()
        child.join(10)


def test_a_pe_killed_inside_open_is_cleaned_up_by_the_peer_that_times_out():
    ctx = mp.get_context("spawn")
    uid = new_unique_id("shm")
    opened = ctx.Event()  # referenced until the child has unpickled it
    child = ctx.Process(target=transfer_scenarios.hold_heap, args=(uid, 1, 2, opened, 30.0), daemon=True)
    child.start()
    try:
        # The child creates its file (a temp file, linked to the final name, then the temp
        # unlinked) and then waits inside open for PE 0's file, which comes only later: kill it
        # there, once the final file exists and the temp is gone (not between link and unlink).
        path, deadline = shm_path(uid, 1), time.monotonic() + 30
        while not (os.path.exists(path) and not os.path.exists(f"{path}.tmp")):
            assert child.is_alive() and time.monotonic() < deadline, "the child never created its file"
            time.sleep(0.01)
        child.kill()
        child.join(10)
        assert shm_leftovers(uid) == [shm_path(uid, 1)]  # a crash inside open leaves its file...
        with pytest.raises(HeapError, match="timed out"):
            open_heap("shm", uid=uid, rank=0, world_size=2, size_bytes=1 << 20, timeout_s=0.3)
        assert shm_leftovers(uid) == []  # ...until a peer of the job gives up and removes it
    finally:
        child.kill()
        child.join(10)
