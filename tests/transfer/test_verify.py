"""Verified landing (`transfer.verify`, `disagg.transfer.verify`) on two shm PEs in this process.

A clean push with verify on lands (LANDED) and its digest row holds the ring's epoch and the
sender's PE; a page corrupted in flight (after the sender's write, before the receiver's poll)
closes the reservation failed, with the `TransferError` text naming the request, both PEs and the
layer; the router turns that text into a `TransferError` cause. The digest itself sees a flipped
word and two swapped pages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from heap_threads import collective

from disagg.cache import PagedKVCache
from disagg.transfer import KVPoll
from disagg.transfer.heap_connector import HeapConnector
from disagg.transfer.verify import DIGEST_MISMATCH, kv_digest

LAYERS, PAGES, HEADS, PAGE, DIM = 2, 8, 2, 4, 8
SHAPE = (LAYERS, PAGES, 2, HEADS, PAGE, DIM)
N = 6  # prompt tokens pushed: one full page and a partial one


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def verified(heap_pair, request):
    """(sender connector on PE 0, receiver connector on PE 1), both with verify on, KV allocated."""
    c0, c1 = (HeapConnector(heap, lease_s=10.0, verify=True) for heap in heap_pair)
    collective([lambda: c0.alloc_kv(SHAPE, request.param), lambda: c1.alloc_kv(SHAPE, request.param)])
    return c0, c1


def push(c0: HeapConnector, c1: HeapConnector, corrupt=None):
    """Reserve on PE 1, push N tokens from PE 0 (another sequence first, so the slots differ),
    call ``corrupt(receiver_kv, receiver_slots)`` after the last layer's write and before the
    ring; return the reservation's closed states and the receiver's slots."""
    recv_cache, send_cache = PagedKVCache(PAGES, PAGE), PagedKVCache(PAGES, PAGE)
    recv_cache.add_sequence(0)
    cmap = recv_cache.disagg_prepare_recv(0, N)
    recv_cache.end_forward()
    dest = c1.receiver.reserve("p", cmap)
    send_cache.add_sequence(9)
    send_cache.add_sequence(10)
    send_cache.begin_forward([10], [3])
    send_cache.end_forward()
    send_cache.disagg_mark_send(9, 0, dest.cmap, dest.pe)
    c0.sender.attach(9, dest)
    plan = send_cache.begin_forward([9], [N])
    gen = torch.Generator().manual_seed(0)
    c0.sender.begin_forward(plan)
    remote = recv_cache.slots(0).astype(np.int64)
    for layer in range(LAYERS):
        k, v = torch.randn(2, N, HEADS, DIM, generator=gen).to(c0._kv.dtype)
        c0.sender.save_layer(layer, k, v)
    if corrupt is not None:
        corrupt(c1._kv, remote)
    c0.sender.end_forward()
    send_cache.end_forward()
    assert c1.receiver.state("p") is KVPoll.LANDED  # rung: the doorbell alone cannot tell
    return c1.receiver.poll(), remote


def test_a_clean_push_lands_with_its_digest_beside_the_doorbell(verified):
    c0, c1 = verified
    [closed], remote = push(c0, c1)
    assert (closed.request_id, closed.state, closed.reason) == ("p", KVPoll.LANDED, "")
    assert (c1.receiver.num_landed, c1.receiver.num_corrupt) == (1, 0)
    row = c1._digests.landed(0)  # the first doorbell word
    assert row[1] == 0  # the sender's PE
    assert torch.equal(row[2:], kv_digest(c1._kv, torch.from_numpy(remote)))


def test_a_page_corrupted_in_flight_fails_the_request_naming_both_pes_and_the_layer(verified):
    c0, c1 = verified

    def flip_one_value(kv, slots):  # the last token of the partial page, layer 1, V
        slot = int(slots[-1])
        kv[1, slot // PAGE, 1, 0, slot % PAGE, 3] += 1

    [closed], _ = push(c0, c1, flip_one_value)
    assert (closed.request_id, closed.state, closed.handle) == ("p", KVPoll.EXPIRED, None)
    assert closed.reason.startswith(DIGEST_MISMATCH), closed.reason
    assert "layers [1]" in closed.reason and "(request p, PE 0 -> PE 1)" in closed.reason, closed.reason
    assert (c1.receiver.num_landed, c1.receiver.num_corrupt, len(c1.receiver)) == (0, 1, 0)


def test_without_verify_the_same_corruption_lands_unseen(heap_pair):
    c0, c1 = (HeapConnector(heap, lease_s=10.0) for heap in heap_pair)
    collective([lambda: c0.alloc_kv(SHAPE, torch.float32), lambda: c1.alloc_kv(SHAPE, torch.float32)])
    [closed], _ = push(c0, c1, lambda kv, slots: kv[0, int(slots[0]) // PAGE].add_(1))
    assert closed.state is KVPoll.LANDED  # what the debug mode is for


def test_the_digest_sees_a_flipped_word_and_swapped_pages():
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    slots = torch.arange(2 * PAGE, dtype=torch.int64)  # pages 0 and 1, in position order
    base = kv_digest(kv, slots)
    assert base.shape == (LAYERS,) and base.dtype == torch.int64
    swapped = torch.cat([slots[PAGE:], slots[:PAGE]])
    assert (kv_digest(kv, swapped) != base).all()
    kv[0, 1, 0, 1, 2, 5] = torch.nextafter(kv[0, 1, 0, 1, 2, 5], torch.tensor(10.0))  # one ulp
    assert (kv_digest(kv, slots) != base).tolist() == [True, False]


def test_the_router_fails_a_digest_mismatch_with_a_transfer_error():
    from disagg.cluster.launch.instance import Instance
    from disagg.cluster.outputs import RequestMetrics
    from disagg.cluster.routing.requests import RoutedRequest
    from disagg.cluster.routing.call_errors import engine_ended_error
    from disagg.errors import TransferError

    prefill, decode = Instance("prefill-0", "prefill", actor=None, pe=0), Instance("decode-0", "decode", actor=None,
                                                                                    pe=1)
    req = RoutedRequest("r", [1, 2], None, lambda *a: None, RequestMetrics(arrival_time=0.0), stage="decoding",
                        prefill=prefill, decode=decode)
    err = engine_ended_error(req, decode, "error", f"{DIGEST_MISMATCH}: the 6 landed slots differ")
    assert type(err) is TransferError and (err.request_id, err.src_pe, err.dst_pe) == ("r", 0, 1)
