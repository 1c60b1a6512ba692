"""paged_prefill against the torch reference: ragged batches, causal alignment, chunked prefill.

Tolerances as in test_decode: 1e-5 for float32 (IEEE dots), atol 2e-3 / rtol 1e-2 for float16.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import paged_prefill, reference

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-2)}


def _run(device, page_table, dtype, num_kv_heads, group, head_dim, page_size, kv_lens, q_lens,
         causal=True, cache_dtype=None, scales=None):
    cache_dtype = cache_dtype or dtype
    num_pages = sum((n + page_size - 1) // page_size for n in kv_lens) + 2
    kv = torch.randn(num_pages, 2, num_kv_heads, page_size, head_dim).to(cache_dtype).to(device)
    table = page_table(kv_lens, page_size, num_pages, device=device)
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype).to(device)
    scales = scales or {}
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, kv, qo_indptr.to(device), table.page_indptr, table.page_indices,
                  table.last_page_len, head_dim ** -0.5, causal, out=out, **scales)
    want = reference.paged_prefill(q.cpu(), kv.cpu(), qo_indptr, table.page_indptr.cpu(),
                                   table.page_indices.cpu(), table.last_page_len.cpu(),
                                   head_dim ** -0.5, causal, *scales.values())
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,page_size", [
    (2, 2, 64, 4),
    (1, 1, 32, 1),
    (1, 4, 128, 16),
    (1, 3, 48, 5),
    (1, 2, 256, 8),  # the widest head: float32 tiles must still fit in shared memory on a GPU
])
def test_prefill_matches_reference(device, page_table, dtype, num_kv_heads, group, head_dim, page_size):
    # a one-token prompt, a prompt ending on a page boundary, a partial last page
    _run(device, page_table, dtype, num_kv_heads, group, head_dim, page_size,
         kv_lens=[1, 16, 35], q_lens=[1, 16, 35])


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_prefill_history_plus_chunk(device, page_table, causal):
    """Chunks of 1..20 new queries after 0..44 tokens of history, and a decode-like row."""
    _run(device, page_table, torch.float32, 2, 2, 32, 4,
         kv_lens=[64, 21, 9, 33], q_lens=[20, 1, 9, 17], causal=causal)


def test_prefill_empty_sequences_in_batch(device, page_table):
    """Sequences with no queries take no program and leave no hole in the ragged output."""
    _run(device, page_table, torch.float32, 1, 2, 32, 4,
         kv_lens=[5, 12, 0, 18], q_lens=[0, 12, 0, 3])


def test_prefill_fp8_cache(device, page_table):
    _run(device, page_table, torch.float16, 1, 2, 32, 4, kv_lens=[19, 6], q_lens=[19, 2],
         cache_dtype=FP8, scales=dict(k_scale=0.5, v_scale=1.5))


def test_prefill_bad_inputs(device, page_table):
    table = page_table([8, 4], 4, 4, device=device)
    kv = torch.randn(4, 2, 1, 4, 32, device=device)
    q = torch.randn(10, 2, 32, device=device)
    qo = torch.tensor([0, 6, 10], dtype=torch.int32, device=device)
    args = (table.page_indptr, table.page_indices, table.last_page_len, 0.1)
    with pytest.raises(ValueError, match="qo_indptr: sequence 1 has 5 queries"):
        paged_prefill(q, kv, torch.tensor([0, 5, 10], dtype=torch.int32, device=device), *args)
    with pytest.raises(ValueError, match="qo_indptr: expected non-decreasing offsets from 0 to num_tokens=10"):
        paged_prefill(q, kv, torch.tensor([0, 6, 9], dtype=torch.int32, device=device), *args)
    with pytest.raises(ValueError, match="page_indptr: expected shape"):
        paged_prefill(q, kv, qo[:2], *args)
    with pytest.raises(ValueError, match="num_qo_heads divisible"):
        paged_prefill(q, torch.randn(4, 2, 3, 4, 32, device=device), qo, *args)
    with pytest.raises(TypeError, match="q: expected the cache's dtype"):
        paged_prefill(q.half(), kv, qo, *args)
    with pytest.raises(ValueError, match="sm_scale: expected a positive finite float"):
        paged_prefill(q, kv, qo, *args[:3], -0.1)
