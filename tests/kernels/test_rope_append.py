"""RoPE + append in one launch (disagg.kernels.rope_append) against the two launches it replaces
(`fused.apply_rope` over the q and k heads, then `append_kv`): q and the whole cache bit for bit
equal, in every dtype, over GQA ratios, page sizes, skipped slots (-1) and strided qkv rows."""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import append_kv, fused
from disagg.kernels.rope_append import rope_append
from disagg.model.layers import rope_cos_sin, rope_inv_freq

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(dtype, device, num_tokens, num_q, num_kv, head_dim, page_size, num_pages=16, pad=0):
    torch.manual_seed(num_tokens * 100 + num_q + head_dim)
    width = (num_q + 2 * num_kv) * head_dim
    qkv = torch.randn(num_tokens, width + pad).to(dtype).to(device)[:, :width]
    positions = torch.randint(0, 4000, (num_tokens,)).to(device)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 500000.0, None, device), dtype)
    kv = torch.randn(num_pages, 2, num_kv, page_size, head_dim).to(dtype).to(device)
    slots = torch.randperm(num_pages * page_size)[:num_tokens].to(device)
    if num_tokens > 2:
        slots[1] = -1  # a padding row: writes nothing
    return qkv, cos, sin, kv, slots


def _unfused(qkv, cos, sin, kv, slots, num_q, num_kv, head_dim):
    n = qkv.shape[0]
    qk = fused.apply_rope(qkv[:, :(num_q + num_kv) * head_dim].view(n, -1, head_dim), cos, sin)
    v = qkv[:, (num_q + num_kv) * head_dim:].view(n, num_kv, head_dim)
    append_kv(qk[:, num_q:], v, kv, slots)
    return qk[:, :num_q]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_q,num_kv,head_dim,page_size,pad", [
    (1, 4, 1, 64, 16, 0), (7, 8, 2, 32, 4, 5), (33, 6, 6, 16, 8, 0), (5, 32, 8, 128, 16, 0),
    (3, 3, 1, 24, 2, 0),
])
def test_rope_append_equals_rope_then_append(device, dtype, num_tokens, num_q, num_kv, head_dim,
                                             page_size, pad):
    qkv, cos, sin, kv, slots = _case(dtype, device, num_tokens, num_q, num_kv, head_dim, page_size,
                                     pad=pad)
    want_kv = kv.clone()
    want_q = _unfused(qkv, cos, sin, want_kv, slots, num_q, num_kv, head_dim)
    got_q = rope_append(qkv, cos, sin, kv, slots, num_q)
    assert got_q.is_contiguous() and got_q.shape == (num_tokens, num_q, head_dim)
    assert torch.equal(got_q, want_q)
    assert torch.equal(kv, want_kv), "the cache differs from append_kv's"


@pytest.mark.parametrize("bad,match", [
    (dict(num_q=5), "qkv: expected shape"),
    (dict(kv_dtype=torch.float16), "qkv: expected dtype"),
    (dict(slot=10_000), "slots"),
    (dict(cos_rows=2), "cos: expected shape"),
])
def test_rope_append_rejects_bad_inputs_and_writes_nothing(device, bad, match):
    qkv, cos, sin, kv, slots = _case(torch.float32, device, 4, 4, 2, 16, 4)
    kv = kv.to(bad.get("kv_dtype", torch.float32))
    if "slot" in bad:
        slots[0] = bad["slot"]
    if "cos_rows" in bad:
        cos = cos[:bad["cos_rows"]]
    before = kv.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        rope_append(qkv, cos, sin, kv, slots, bad.get("num_q", 4), check_indices=True)
    assert torch.equal(kv, before)
