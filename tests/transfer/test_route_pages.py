"""Head routes whose receiver pages disagree with the symmetric allocation: refused, nothing lost.

Prefill at tensor parallelism a pushing into decode at b != a, as test_split_heads.py's `Fleet`
runs it (a + b connectors on one shm heap), where the two sides' page counts disagree:

- the connectors' layouts disagree (`HeadLayout.num_pages`): the PEs' allocations differ, and
  `alloc_kv` refuses on every PE (a `HeapError` naming both byte counts) before any is made;
- a prefill rank's layout disagrees with the allocation it made, so the routes `local_dest` builds
  name more receiver pages than any PE holds (every layer past the first would land at the wrong
  offset of the receiver's pages): `KVConnector.check_dest`, which `EngineCore.add` asks before the
  request exists, refuses it (`InvalidArgument` on ``dest.routes``, naming both page counts), and
  `KVSender.attach`, for a caller that attaches without asking, refuses it with a `TransferError`
  naming both page counts, the request and the two PEs, before any forward. Nothing is attached
  and nothing of the receivers is written; the prefill side drops the request (abort, then its
  sequence and pages) and each decode rank cancels its reservation and frees its pages; a request
  already in flight on the same receivers lands its exact KV, by the fused launch, segment puts,
  or a push after the forward (`save_written`).

Past `check_dest` the engine does not catch the sender's error: it would fail the step that
attaches the request (`EngineCore._launch`), and with it the instance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from heap_threads import Shared, ThreadGroup, collective, open_shm_heaps
from test_split_heads import DIM, LAYERS, PAGE, PAGES, Fleet, each, expected_marks, forward, make_fleet  # noqa: F401

from disagg.cache import PagedKVCache
from disagg.errors import HeapError, InvalidArgument, TransferError
from disagg.transfer import KVPoll, PushState, open_connector
from disagg.transfer.heads import HeadLayout, kv_heads_of
from disagg.transfer.shm_heap import shm_leftovers

PAIRS = [(4, 1, 2), (4, 2, 1)]  # (model KV heads, prefill, decode tensor parallelism): either side the wider
PATHS = ["fused", "segment-puts", "after-forward"]


@pytest.mark.parametrize("num_kv_heads, a, b", PAIRS)
def test_layouts_whose_page_counts_disagree_are_refused_by_alloc_kv_on_every_pe(num_kv_heads: int, a: int, b: int):
    heaps = open_shm_heaps(a + b)
    groups = Shared(a), Shared(b)
    # The prefill instance was launched with twice the decode instance's pages.
    layouts = [HeadLayout(num_kv_heads, a, i, b, 2 * PAGES) for i in range(a)] + \
              [HeadLayout(num_kv_heads, b, j, a, PAGES) for j in range(b)]
    connectors = []
    for pe, layout in enumerate(layouts):
        group = ThreadGroup(groups[pe >= a], layout.rank, layout.num_ranks) if layout.num_ranks > 1 else None
        connectors.append(open_connector(heaps[pe], group=group, layout=layout))

    def alloc(connector, layout):
        shape = (LAYERS, layout.local_num_pages, 2, len(kv_heads_of(num_kv_heads, layout.num_ranks, 0)), PAGE, DIM)
        try:
            return connector.alloc_kv(shape, torch.float32)
        except HeapError as err:
            return err

    errors = collective([lambda c=c, layout=layout: alloc(c, layout) for c, layout in zip(connectors, layouts)])
    page_bytes = LAYERS * 2 * max(layout.max_local_heads for layout in layouts) * PAGE * DIM * 4
    for pe, err in enumerate(errors):
        assert isinstance(err, HeapError), f"PE {pe}: alloc_kv returned a {type(err).__name__}, expected a HeapError"
        assert "differs in nbytes" in str(err), err
        assert f"{2 * PAGES * page_bytes}" in str(err) and f"{PAGES * page_bytes}" in str(err), err
    for heap in heaps:
        heap.close()
    assert shm_leftovers(heaps[0].uid) == []


def forward_written(fleet: Fleet, caches, seq: int, n: int, full_k, full_v, start: int) -> None:
    """`forward`, but each rank's forward writes its local pages itself (a whole-forward graph) and
    its sender pushes them after it (`KVSender.save_written`)."""
    for i, (connector, cache, kv) in enumerate(zip(fleet.prefill, caches, fleet.kv)):
        heads = list(kv_heads_of(fleet.num_kv_heads, fleet.a, i))
        plan = cache.begin_forward([seq], [n])
        slots = torch.from_numpy(plan.append_slots.astype(np.int64))
        for layer in range(LAYERS):
            kv[layer, slots // PAGE, 0, :, slots % PAGE] = full_k[layer, start:start + n][:, heads]
            kv[layer, slots // PAGE, 1, :, slots % PAGE] = full_v[layer, start:start + n][:, heads]
        assert connector.sender.save_written(plan) is None
        cache.end_forward()


@pytest.mark.parametrize("misread_pages", [2 * PAGES, PAGES + 1], ids=["twice", "one-more"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_kv_heads, a, b", PAIRS)
def test_a_route_naming_more_receiver_pages_than_the_allocation_is_refused_at_attach_losing_nothing(
        make_fleet, num_kv_heads: int, a: int, b: int, path: str, misread_pages: int):
    fleet = make_fleet(num_kv_heads, a, b, force_segment_puts=path == "segment-puts")
    push = forward_written if path == "after-forward" else forward
    n, first = 7, 3  # each request's tokens (a page and part of one); the good one's first chunk
    recv_cache = PagedKVCache(fleet.decode_pages, PAGE)
    recv_free = recv_cache.num_free_pages
    cmaps = []
    for seq in (0, 1):  # "good" in the decode ranks' first pages, "bad" right after them
        recv_cache.add_sequence(seq)
        cmaps.append(recv_cache.disagg_prepare_recv(seq, n))
        recv_cache.end_forward()
    good, bad = fleet.reserve("good", cmaps[0], 0), fleet.reserve("bad", cmaps[1], 0)
    caches = [PagedKVCache(fleet.prefill_pages, PAGE) for _ in range(a)]
    prefill_free = caches[0].num_free_pages
    gen = torch.Generator().manual_seed(a * 10 + b)
    full_k, full_v = torch.randn(2, LAYERS, n, num_kv_heads, DIM, generator=gen)
    for connector, cache in zip(fleet.prefill, caches):
        cache.add_sequence(9)
        mine = connector.local_dest(good)
        cache.disagg_mark_send(9, 0, mine.cmap, mine.pe)
        connector.sender.attach(9, mine)
    push(fleet, caches, 9, first, full_k, full_v, 0)  # "good" is in flight

    for i, (connector, cache) in enumerate(zip(fleet.prefill, caches)):
        # This rank's layout says the fleet has more pages than it allocated (a mis-launched rank):
        # one more page shifts every later layer by a page or two, inside the allocation.
        sized = connector.layout
        connector.layout = dataclasses.replace(sized, num_pages=misread_pages)
        mine = connector.local_dest(bad)
        connector.layout = sized
        with pytest.raises(InvalidArgument) as at_add:  # what `EngineCore.add` asks first
            connector.check_dest("bad", mine)
        route = mine.routes[0]
        room = PAGES * sized.max_local_heads // route.dst_num_kv_heads  # the receiver's pages
        named = misread_pages * sized.max_local_heads // route.dst_num_kv_heads
        assert at_add.value.argument == "dest.routes" and "'bad'" in str(at_add.value), str(at_add.value)
        assert f"names {named} receiver pages of {route.dst_num_kv_heads} KV heads per layer; expected at most " \
               f"{room}" in str(at_add.value), str(at_add.value)
        connector.check_dest("good", connector.local_dest(good))  # the rank's own layout: fine
        # A caller that attaches without asking (the sender's own check, the last line):
        cache.add_sequence(11)
        cache.disagg_mark_send(11, 0, mine.cmap, mine.pe)  # the engine's order: mark, then attach
        with pytest.raises(TransferError) as refused:
            connector.sender.attach(11, mine)
        assert room == fleet.decode_pages and route.dst_num_pages == named > room
        err = refused.value
        assert (err.request_id, err.src_pe, err.dst_pe) == (11, i, route.pe)
        assert f"names {named} receiver pages of {route.dst_num_kv_heads} KV heads per layer, expected at most " \
               f"{room}" in str(err) and "page counts disagree" in str(err), str(err)
    # The prefill side drops the request (nothing of it was attached: nothing can land), the decode
    # side its reservation.
    assert each(lambda c: c.sender.abort("bad", 11, pushed=False), fleet.prefill) == [PushState.QUIESCED] * a
    for cache in caches:
        cache.remove_sequence(11)
    assert each(lambda c: c.receiver.cancel(bad), fleet.decode) == [None] * b
    recv_cache.remove_sequence(1)

    push(fleet, caches, 9, n - first, full_k, full_v, first)  # "good" goes on, its routes unaffected
    assert [[(c.request_id, c.state) for c in got] for got in fleet.poll()] == [[("good", KVPoll.LANDED)]] * b
    slots = recv_cache.slots(0).astype(np.int64)
    t = torch.from_numpy(slots)
    for j, kv in enumerate(fleet.kv[a:]):
        heads = list(kv_heads_of(num_kv_heads, b, j))
        for layer in range(LAYERS):
            torch.testing.assert_close(kv[layer, t // PAGE, 0, :, t % PAGE], full_k[layer][:, heads], rtol=0, atol=0)
            torch.testing.assert_close(kv[layer, t // PAGE, 1, :, t % PAGE], full_v[layer][:, heads], rtol=0, atol=0)
        assert kv[~expected_marks(kv, slots)].isnan().all(), f"decode rank {j}: wrote outside the good request's slots"
    for connector in fleet.decode:
        assert connector.receiver.num_landed == 1 and connector.receiver.num_cancelled == 1
        assert getattr(connector, "inner", connector).receiver.num_armed == 0 and len(connector.receiver) == 0
    for cache in caches:
        cache.remove_sequence(9)
        assert cache.num_free_pages == prefill_free
    recv_cache.remove_sequence(0)
    assert recv_cache.num_free_pages == recv_free
