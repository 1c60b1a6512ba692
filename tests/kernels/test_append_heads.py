"""The fused append+push with head routes (`prepare_append_push(heads=...)`: prefill and decode at
different tensor parallelism): each receiver gets exactly its head range of each token, at its own
head offset, in pages of its own head count; the local append is unchanged; bad routes are
refused before anything is written. Runs on the GPU when TRITON_INTERPRET is unset
(`python3 -m pytest tests/kernels/test_append_heads.py` on a GPU host)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from disagg.kernels import reference
from disagg.kernels.append import prepare_append_push

FP8 = torch.float8_e4m3fn
LAYERS, PAGE, DIM = 2, 4, 32


def _caches(device, dtype, local_heads, local_pages, dst_heads, dst_pages, receivers):
    """A local [L, N, 2, H, P, D] cache and ``receivers`` caches of another head count, filled
    with a marker so unwritten bytes show."""
    kv = torch.full((LAYERS, local_pages, 2, local_heads, PAGE, DIM), -7.0, device=device).to(dtype)
    dsts = [torch.full((LAYERS, dst_pages, 2, dst_heads, PAGE, DIM), -7.0, device=device).to(dtype)
            for _ in range(receivers)]
    return kv, dsts


def _new(num_tokens, heads, dtype, device):
    src = torch.float16 if dtype == FP8 else dtype
    k = torch.randn(num_tokens, heads, DIM)
    v = torch.randn(num_tokens, heads, DIM)
    if dtype == FP8:  # values that scale exactly onto e4m3 (see test_append._new_kv)
        k, v = k.to(FP8).to(src) * 2.0, v.to(FP8).to(src) * 0.5
    return k.to(src).to(device), v.to(src).to(device)


def _expected(kv, dsts, layer, k, v, slots, dst_slots, dst_index, heads):
    """Token by token, head by head: what each cache must hold after the push."""
    kv, dsts = kv.clone(), [d.clone() for d in dsts]
    cast = kv.dtype
    for t in range(k.shape[0]):
        if slots[t] >= 0:
            page, off = divmod(int(slots[t]), PAGE)
            kv[layer, page, 0, :, off] = k[t].to(cast)
            kv[layer, page, 1, :, off] = v[t].to(cast)
        for row in dst_index:
            r = int(row[t])
            if r < 0 or dst_slots[t] < 0:
                continue
            first, count, dst_first = heads[r]
            page, off = divmod(int(dst_slots[t]), PAGE)
            for h in range(count):
                dsts[r][layer, page, 0, dst_first + h, off] = k[t, first + h].to(cast)
                dsts[r][layer, page, 1, dst_first + h, off] = v[t, first + h].to(cast)
    return kv, dsts


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# (local heads, local pages, receiver heads, receiver pages, heads per receiver, dst_index rows):
# one sender into two receivers of half its heads (prefill TP1 -> decode TP2: each token to both),
# a sender of half the heads into one receiver at head offset 2 (prefill TP2 rank 1 -> decode TP1),
# a replicated head (one head of four to each of two receivers, from different local heads).
CASES = {
    "1->2": (4, 6, 2, 12, [(0, 2, 0), (2, 2, 0)], [[0, 0, -1, 0, 0, 0, 0], [1, 1, 1, -1, 1, 1, 1]]),
    "2->1": (2, 12, 4, 6, [(0, 2, 2)], [[0, 0, 0, 0, -1, 0, 0]]),
    "one-head": (4, 4, 1, 16, [(1, 1, 0), (3, 1, 0)], [[0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, -1]]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("host_indices", [True, False], ids=["numpy", "tensors"])
def test_each_receiver_gets_exactly_its_heads_at_its_offset(device, case, dtype, host_indices):
    local_heads, local_pages, dst_heads, dst_pages, heads, rows = CASES[case]
    torch.manual_seed(0)
    kv, dsts = _caches(device, dtype, local_heads, local_pages, dst_heads, dst_pages, len(heads))
    num_tokens = len(rows[0])
    # Local slots partly skipped; receiver slots land in the receivers' last pages too (past the
    # sender's page count when the receiver has more pages), one page partly filled.
    slots = np.array([0, 1, 2, 3, 5, -1, 9][:num_tokens], np.int32)
    dst_slots = np.array([4 * dst_pages - 1, 0, 1, 2, 3, 7, -1][:num_tokens], np.int32)
    dst_index = np.array(rows, np.int32)
    k, v = _new(num_tokens, local_heads, dtype, device)
    scales = {"k_scale": 2.0, "v_scale": 0.5} if dtype == FP8 else {}
    args = (slots, dst_slots, dst_index) if host_indices else tuple(
        torch.from_numpy(a).to(device) for a in (slots, dst_slots, dst_index))
    want_kv, want_dsts = _expected(kv, dsts, 1, k * (0.5 if dtype == FP8 else 1.0), v * (2.0 if dtype == FP8 else 1.0),
                                   slots, dst_slots, dst_index, heads)
    prepared = prepare_append_push(kv, args[0], dsts, *args[1:], heads=heads)
    prepared(1, k, v, **scales)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert _same_bits(kv, want_kv)
    for got, want in zip(dsts, want_dsts):
        assert _same_bits(got, want)


def test_torch_reference_writes_what_the_kernel_writes(device):
    local_heads, local_pages, dst_heads, dst_pages, heads, rows = CASES["1->2"]
    kv, dsts = _caches(device, torch.float32, local_heads, local_pages, dst_heads, dst_pages, 2)
    ref_kv, ref_dsts = kv.clone(), [d.clone() for d in dsts]
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6], device=device)
    dst_slots = torch.tensor([9, 10, 11, 12, 13, 14, 15], device=device)
    dst_index = torch.tensor(rows, device=device)
    k, v = _new(7, local_heads, torch.float32, device)
    prepare_append_push(kv, slots, dsts, dst_slots, dst_index, heads=heads)(0, k, v)
    reference.append_push_heads(k, v, ref_kv[0], slots, [d[0] for d in ref_dsts], dst_slots, dst_index, heads)
    assert torch.equal(kv, ref_kv) and all(torch.equal(a, b) for a, b in zip(dsts, ref_dsts))


def test_rebind_keeps_the_routes_and_follows_another_route_count(device):
    local_heads, local_pages, dst_heads, dst_pages, heads, rows = CASES["1->2"]
    kv, dsts = _caches(device, torch.float32, local_heads, local_pages, dst_heads, dst_pages, 2)
    first = prepare_append_push(kv, np.array([0, 1], np.int32), dsts, np.array([0, 1], np.int32),
                                np.array([[0, 0], [1, 1]], np.int32), heads=heads)
    k, v = _new(2, local_heads, torch.float32, device)
    first(0, k, v)
    # The next forward sends to receiver 1 only (one route row).
    second = first.rebind(np.array([2, 3], np.int32), np.array([2, 3], np.int32), np.array([[1, 1]], np.int32))
    want_kv, want_dsts = _expected(kv, dsts, 0, k, v, [2, 3], [2, 3], [[1, 1]], heads)
    second(0, k, v)
    assert torch.equal(kv, want_kv) and all(torch.equal(a, b) for a, b in zip(dsts, want_dsts))


def _misuses():
    """(what is wrong, prepare kwargs over the 1->2 case, the message's start)."""
    rows = np.array([[0, 0], [1, 1]], np.int32)
    yield "a head past the sender's", {"heads": [(0, 2, 0), (3, 2, 0)], "dst_index": rows}, "heads[1]: expected 2 head(s)"
    yield "a head past the receiver's", {"heads": [(0, 2, 1), (2, 2, 0)], "dst_index": rows}, "heads[0]: expected 2 head(s)"
    yield "one route for two receivers", {"heads": [(0, 2, 0)], "dst_index": rows}, "heads: expected one"
    yield "a one-row dst_index", {"heads": [(0, 2, 0), (2, 2, 0)], "dst_index": np.array([0, 1], np.int32)}, \
        "dst_index: expected [routes, 2]"
    yield "a receiver index past the receivers", {"heads": [(0, 2, 0), (2, 2, 0)],
                                                  "dst_index": np.array([[0, 2], [1, 1]], np.int32)}, "dst_index"
    yield "receivers of two head counts", {"heads": [(0, 2, 0), (2, 2, 0)], "dst_index": rows,
                                           "second": (4, 6)}, "dst_kv[1]: expected"


@pytest.mark.parametrize("case", [c[0] for c in _misuses()])
def test_bad_routes_are_refused_naming_them_and_write_nothing(device, case):
    _, kwargs, message = next(c for c in _misuses() if c[0] == case)
    kv, dsts = _caches(device, torch.float32, 4, 6, 2, 12, 2)
    if "second" in kwargs:
        heads_, pages = kwargs.pop("second")
        dsts[1] = torch.zeros(LAYERS, pages, 2, heads_, PAGE, DIM, device=device)
    before = [kv.clone()] + [d.clone() for d in dsts]
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        prepare_append_push(kv, np.array([0, 1], np.int32), dsts, np.array([0, 1], np.int32), kwargs["dst_index"],
                            heads=kwargs["heads"])(0, *_new(2, 4, torch.float32, device))
    assert all(torch.equal(a, b) for a, b in zip([kv] + dsts, before))
