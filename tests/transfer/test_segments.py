"""Coalescing slot pairs into byte runs: exact run lists, and runs that move exactly the right bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.kernels import reference
from disagg.transfer.segments import KVGeometry, coalesce, slot_runs

GEO = KVGeometry(num_layers=3, num_pages=8, num_kv_heads=2, page_size=4, head_dim=8, itemsize=2)
PAGE_BYTES = GEO.page_elems * GEO.itemsize  # 2*2*4*8*2 = 256


def apply_runs(src: torch.Tensor, dst: torch.Tensor, runs: np.ndarray) -> None:
    """What a put does with each row: copy bytes [s, s+n) of src to [d, d+n) of dst."""
    src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for s, d, n in runs.tolist():
        dst_bytes[d:d + n] = src_bytes[s:s + n]


def test_whole_pages_consecutive_on_both_sides_are_one_run_per_layer():
    src = np.arange(2 * 4, 5 * 4)  # pages 2, 3, 4
    dst = np.arange(5 * 4, 8 * 4)  # pages 5, 6, 7
    segs = coalesce(src, dst, GEO)
    assert segs.runs.tolist() == [[2 * PAGE_BYTES, 5 * PAGE_BYTES, 3 * PAGE_BYTES]]
    assert segs.for_layer(2).tolist() == [[2 * PAGE_BYTES + 2 * GEO.layer_bytes,
                                           5 * PAGE_BYTES + 2 * GEO.layer_bytes, 3 * PAGE_BYTES]]
    assert len(segs.for_layers(GEO.num_layers)) == GEO.num_layers


def test_scattered_pages_give_one_run_per_page_never_per_token():
    src = np.concatenate([np.arange(4) + 4 * p for p in (1, 2, 6)])
    dst = np.concatenate([np.arange(4) + 4 * p for p in (0, 5, 6)])
    segs = coalesce(src, dst, GEO)
    # pages 1->0 alone; 2->5 and 6->6 do not continue each other
    assert segs.runs[:, 2].tolist() == [PAGE_BYTES] * 3


def test_partial_page_is_one_run_per_kv_and_head():
    segs = coalesce(np.array([5, 6]), np.array([9, 10]), GEO)  # page 1 off 1..2 -> page 2 off 1..2
    assert len(segs) == 2 * GEO.num_kv_heads
    assert set(segs.runs[:, 2].tolist()) == {2 * GEO.head_dim * GEO.itemsize}


def test_runs_break_at_page_ends_and_follow_source_order():
    src0, dst0, length = slot_runs(np.array([7, 3, 4, 5, 6]), np.array([20, 0, 1, 2, 3]), page_size=4)
    # sorted by source: 3->0 | 4,5,6 -> 1,2,3 | 7 -> 20 (a page boundary at 4, a jump at 7)
    assert (src0.tolist(), dst0.tolist(), length.tolist()) == ([3, 4, 7], [0, 1, 20], [1, 3, 1])


def test_out_of_range_slots_are_refused():
    with pytest.raises(ValueError, match=r"dst_slots must be in \[0, 32\)"):
        coalesce(np.array([0]), np.array([32]), GEO)
    with pytest.raises(ValueError, match="one length"):
        coalesce(np.array([0, 1]), np.array([3]), GEO)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_runs_move_exactly_what_copy_slots_moves(data):
    n = data.draw(st.integers(0, GEO.num_slots))
    src_slots = np.array(data.draw(st.permutations(range(GEO.num_slots)))[:n], dtype=np.int64)
    dst_slots = np.array(data.draw(st.permutations(range(GEO.num_slots)))[:n], dtype=np.int64)
    if data.draw(st.booleans()):  # favour long runs: sorted, aligned reservations
        src_slots, dst_slots = np.sort(src_slots), np.sort(dst_slots)
    shape = (GEO.num_layers, GEO.num_pages, 2, GEO.num_kv_heads, GEO.page_size, GEO.head_dim)
    src = torch.randn(shape).to(torch.float16)
    got, want = torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)
    apply_runs(src, got, coalesce(src_slots, dst_slots, GEO).for_layers(GEO.num_layers))
    reference.copy_slots(src, torch.from_numpy(src_slots), want, torch.from_numpy(dst_slots))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("src_heads,dst_heads,src_head,dst_head,num_heads", [(4, 2, 2, 0, 2), (2, 4, 0, 2, 2)])
def test_head_runs_address_a_receiver_that_views_the_same_bytes_as_more_or_fewer_pages(
        src_heads, dst_heads, src_head, dst_head, num_heads):
    """Both sides view one allocation of 8 pages of 4 heads: the 2-head side as 16 pages. The runs
    of `coalesce_heads` put each (layer, slot, K/V, head) where the receiver's own view reads it,
    slots past the sender's page count included (a whole page and a partial one)."""
    from disagg.transfer.segments import coalesce_heads

    layers, page, dim, widest_pages = 3, 4, 8, 8
    pages = {h: widest_pages * 4 // h for h in (src_heads, dst_heads)}
    total = layers * widest_pages * 2 * 4 * page * dim
    src_flat = torch.randn(total)
    dst_flat = torch.zeros(total)
    src = src_flat[:layers * pages[src_heads] * 2 * src_heads * page * dim].view(
        layers, pages[src_heads], 2, src_heads, page, dim)
    dst = dst_flat[:layers * pages[dst_heads] * 2 * dst_heads * page * dim].view(
        layers, pages[dst_heads], 2, dst_heads, page, dim)
    geo = KVGeometry(num_layers=layers, num_pages=pages[src_heads], num_kv_heads=src_heads, page_size=page,
                     head_dim=dim, itemsize=4)
    src_slots = np.concatenate([np.arange(4) + 4 * 1, np.arange(2) + 4 * 3])  # page 1 whole, 2 tokens of page 3
    last = pages[dst_heads] - 1
    dst_slots = np.concatenate([np.arange(4) + 4 * last, np.arange(2) + 4 * (last - 1) + 1])
    segs = coalesce_heads(src_slots, dst_slots, geo, dst_heads, src_head, dst_head, num_heads, pages[dst_heads])
    apply_runs(src_flat, dst_flat, segs.for_layers(layers))
    for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
        torch.testing.assert_close(dst[:, d // page, :, dst_head:dst_head + num_heads, d % page],
                                   src[:, s // page, :, src_head:src_head + num_heads, s % page], rtol=0, atol=0)
    written = torch.zeros(total, dtype=torch.bool)
    for s, d, n in segs.for_layers(layers).tolist():
        written[d // 4:(d + n) // 4] = True
    assert int(written.sum()) == layers * len(src_slots) * 2 * num_heads * dim  # nothing else is written
    with pytest.raises(ValueError, match="dst_slots"):
        coalesce_heads(src_slots, dst_slots + 4 * (pages[dst_heads] - last), geo, dst_heads, src_head, dst_head,
                       num_heads, pages[dst_heads])
