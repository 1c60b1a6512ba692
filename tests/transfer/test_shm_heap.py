"""The shm symmetric heap in one process (one thread per PE): memory, peers, collectives, signals."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from heap_threads import collective, open_shm_heaps

from disagg.errors import HeapError, SignalTimeout
from disagg.transfer import new_unique_id, open_heap
from disagg.transfer.shm_heap import shm_leftovers, shm_path


def test_alloc_is_symmetric_zeroed_and_peer_writes_land(heap_pair):
    h0, h1 = heap_pair
    a0, a1 = collective([lambda: h0.alloc((3, 5), torch.float32), lambda: h1.alloc((3, 5), torch.float32)])
    b0, b1 = collective([lambda: h0.alloc((7,), torch.int64), lambda: h1.alloc((7,), torch.int64)])
    assert torch.count_nonzero(a0) == 0 and torch.count_nonzero(b1) == 0
    assert a0.data_ptr() - h0._data_ptr == a1.data_ptr() - h1._data_ptr
    h0.peer(a0, 1)[1:, 2:] = 4.5  # a view's peer view aliases the same elements remotely
    h0.peer(b0[2:5], 1).fill_(9)
    expected = torch.zeros(3, 5)
    expected[1:, 2:] = 4.5
    assert torch.equal(a1, expected)
    assert b1.tolist() == [0, 0, 9, 9, 9, 0, 0]
    assert torch.count_nonzero(a0) == 0 and h1.peer(a1, 1) is a1


def test_put_segments_copies_each_byte_run(heap_pair):
    h0, h1 = heap_pair
    t0, t1 = collective([lambda: h0.alloc((64,), torch.uint8), lambda: h1.alloc((64,), torch.uint8)])
    t0.copy_(torch.arange(64, dtype=torch.uint8))
    h0.put_segments_async(t0, 1, np.array([[0, 10, 4], [40, 0, 2]], dtype=np.int64))
    expected = torch.zeros(64, dtype=torch.uint8)
    expected[10:14] = torch.arange(4)
    expected[0:2] = torch.tensor([40, 41])
    assert torch.equal(t1, expected)
    with pytest.raises(ValueError, match="byte runs inside"):
        h0.put_segments_async(t0, 1, np.array([[60, 0, 8]], dtype=np.int64))


def test_alloc_mismatch_is_detected_on_every_pe_and_commits_nothing(heap_pair):
    h0, h1 = heap_pair
    results = collective([lambda: _error(lambda: h0.alloc((4, 4), torch.float16)),
                          lambda: _error(lambda: h1.alloc((4, 5), torch.float16))])
    assert all(isinstance(e, HeapError) and "differs in nbytes" in str(e) for e in results)
    results = collective([lambda: _error(lambda: h0.alloc((16,), torch.float16)),
                          lambda: _error(lambda: h1.alloc((8,), torch.float32))])
    assert all(isinstance(e, HeapError) and "differs in dtype" in str(e) for e in results)
    x0, x1 = collective([lambda: h0.alloc((2,), torch.int32), lambda: h1.alloc((2,), torch.int32)])
    assert x0.data_ptr() == h0._data_ptr and x1.data_ptr() == h1._data_ptr  # nothing was committed


def test_alloc_beyond_the_heap_raises_everywhere(heap_pair):
    results = collective([lambda h=h: _error(lambda: h.alloc((1 << 21,), torch.uint8)) for h in heap_pair])
    assert all(isinstance(e, HeapError) and "heap full" in str(e) for e in results)


def test_signals_are_set_remotely_and_waited_locally(heap_pair):
    h0, h1 = heap_pair
    h0.set_signal_async(5, 3, pe=1)
    assert h1.read_signal(5) == 3 and h0.read_signal(5) == 0
    assert h1.wait_signal(5, 3, timeout_s=1.0) == 3
    assert h1.try_wait_signal(5, 4, timeout_s=0.05) is None
    with pytest.raises(SignalTimeout) as err:
        h1.wait_signal(5, 4, timeout_s=0.05, request_id=17, src_pe=0)
    assert (err.value.request_id, err.value.src_pe, err.value.dst_pe) == (17, 0, 1)
    assert h1.read_signals()[5] == 3
    with pytest.raises(ValueError, match="signal index"):
        h0.set_signal_async(64, 1, pe=1)


def test_barrier_times_out_naming_the_missing_pe(heap_pair):
    with pytest.raises(HeapError, match=r"barrier timed out .* PE\(s\) \[1\]"):
        heap_pair[0].barrier(timeout_s=0.1)


def test_closed_heap_refuses_every_call(heap_pair):
    h0, _ = heap_pair
    h0.close()
    for call in (lambda: h0.alloc((1,), torch.int8), lambda: h0.barrier(), lambda: h0.read_signal(0),
                 lambda: h0.set_signal_async(0, 1, 1), lambda: h0.peer(torch.zeros(1), 1)):
        with pytest.raises(HeapError, match="closed"):
            call()
    h0.close()  # idempotent


def test_open_unlinks_every_file_once_all_pes_mapped_them():
    heaps = open_shm_heaps(3)
    assert shm_leftovers(heaps[0].uid) == []
    for heap in heaps:
        heap.close()


def test_open_refuses_mismatched_sizes_and_cleans_up():
    uid = new_unique_id("shm")
    results = collective([
        lambda: _error(lambda: open_heap("shm", uid=uid, rank=0, world_size=2, size_bytes=1 << 20, timeout_s=1)),
        lambda: _error(lambda: open_heap("shm", uid=uid, rank=1, world_size=2, size_bytes=2 << 20, timeout_s=1)),
    ])
    assert any(isinstance(e, HeapError) and "size_bytes or num_signals differ" in str(e) for e in results)
    assert shm_leftovers(uid) == []


def test_open_times_out_when_a_pe_never_comes_and_removes_its_file():
    uid = new_unique_id("shm")
    with pytest.raises(HeapError, match="PE 1 did not create its heap file"):
        open_heap("shm", uid=uid, rank=0, world_size=2, size_bytes=1 << 16, timeout_s=0.2)
    assert shm_leftovers(uid) == []


def test_open_refuses_a_reused_uid():
    uid = new_unique_id("shm")
    with open(shm_path(uid, 0), "wb"):
        pass
    try:
        with pytest.raises(HeapError, match="already exists"):
            open_heap("shm", uid=uid, rank=0, world_size=1, size_bytes=1 << 16)
    finally:
        if os.path.exists(shm_path(uid, 0)):
            os.unlink(shm_path(uid, 0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="gloo"), "backend must be one of"),
    (dict(rank=2), "0 <= rank < world_size"),
    (dict(size_bytes=0), "size_bytes must be positive"),
    (dict(uid=b""), "uid must be"),
    (dict(device="cuda"), "device must be None or 'cpu'"),
])
def test_open_rejects_bad_arguments(kwargs, match):
    args = dict(backend="shm", uid=new_unique_id("shm"), rank=0, world_size=2, size_bytes=1 << 16)
    args.update(kwargs)
    backend = args.pop("backend")
    with pytest.raises(ValueError, match=match):
        open_heap(backend, **args)


def test_peer_rejects_memory_outside_the_heap(heap_pair):
    with pytest.raises(ValueError, match="not memory of this heap"):
        heap_pair[0].peer(torch.zeros(4), 1)
    with pytest.raises(HeapError, match=r"pe must be in \[0, 2\)"):
        heap_pair[0].peer(torch.zeros(4), 2)


def _error(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - returned for the assertion
        return err
    return None
