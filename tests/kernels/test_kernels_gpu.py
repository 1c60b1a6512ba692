"""GPU checks of the kernels: bf16/fp16/fp8 matrix, long sequences, page sizes 1/16/64, head_dim
64/128/256, bit-exact append/push/copy, and CUDA-graph capture and replay.

Attention is compared with the float32 torch reference by relative error ||o - ref|| / ||ref||:
16-bit operands (q, P and, for fp16/bf16 caches, K/V) bound it near 2^-8, so 2e-2 leaves room;
fp8 caches are compared against the reference over the same dequantized cache.
Run: `python3 -m pytest -m gpu tests/kernels`.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import (append_kv, append_push_kv, build_dst_table, copy_slots,
                            decode_workspace, paged_decode, paged_prefill, reference)

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
CUDA = torch.device("cuda")
# (q dtype, cache dtype, page_size, head_dim): every page size, head_dim and dtype appears.
MATRIX = [
    (torch.bfloat16, torch.bfloat16, 1, 64),
    (torch.bfloat16, torch.bfloat16, 16, 128),
    (torch.bfloat16, torch.bfloat16, 64, 256),
    (torch.bfloat16, torch.bfloat16, 16, 64),
    (torch.float16, torch.float16, 16, 128),
    (torch.float16, torch.float16, 64, 64),
    (torch.float16, torch.float16, 1, 256),
    (torch.bfloat16, FP8, 16, 128),
    (torch.bfloat16, FP8, 64, 64),
    (torch.float16, FP8, 1, 256),
]
FP8_SCALES = dict(k_scale=0.05, v_scale=0.04)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _cache(lengths, page_size, num_kv_heads, head_dim, cache_dtype, page_table):
    num_pages = sum((n + page_size - 1) // page_size for n in lengths) + 4
    kv = torch.randn(num_pages, 2, num_kv_heads, page_size, head_dim, device=CUDA)
    kv = (kv / 0.05).to(cache_dtype) if cache_dtype == FP8 else kv.to(cache_dtype)
    return kv, page_table(lengths, page_size, num_pages, device=CUDA)


@pytest.mark.parametrize("dtype,cache_dtype,page_size,head_dim", MATRIX)
def test_decode_gpu(page_table, dtype, cache_dtype, page_size, head_dim):
    lengths = [1, 15, 16, 17, 1000, 4097, 0]
    kv, table = _cache(lengths, page_size, 2, head_dim, cache_dtype, page_table)
    q = torch.randn(len(lengths), 8, head_dim, device=CUDA, dtype=dtype)
    scales = FP8_SCALES if cache_dtype == FP8 else {}
    args = (q, kv, table.page_indptr, table.page_indices, table.last_page_len, head_dim ** -0.5)
    want = reference.paged_decode(*args, *scales.values())
    for num_splits in (None, 1, 13):
        got = paged_decode(*args, num_splits=num_splits, **scales)
        assert not got.isnan().any()
        assert _rel_err(got[:-1], want[:-1]) < 2e-2, num_splits
        assert got[-1].eq(0).all()


@pytest.mark.parametrize("dtype,cache_dtype,page_size,head_dim", MATRIX)
def test_prefill_gpu(page_table, dtype, cache_dtype, page_size, head_dim):
    kv_lens, q_lens = [1, 16, 300, 1000, 129], [1, 16, 300, 37, 1]
    kv, table = _cache(kv_lens, page_size, 2, head_dim, cache_dtype, page_table)
    qo_indptr = torch.tensor([0] + q_lens, device=CUDA).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 6, head_dim, device=CUDA, dtype=dtype)
    scales = FP8_SCALES if cache_dtype == FP8 else {}
    for causal in (True, False):
        args = (q, kv, qo_indptr, table.page_indptr, table.page_indices, table.last_page_len,
                head_dim ** -0.5, causal)
        got = paged_prefill(*args, **scales)
        want = reference.paged_prefill(*args, *scales.values())
        assert _rel_err(got, want) < 2e-2, causal


def test_long_sequences_gpu(page_table):
    """32k tokens: decode with the default split count, and a 1024-query chunk after 31k tokens."""
    kv, table = _cache([32768, 100], 16, 2, 128, torch.bfloat16, page_table)
    q = torch.randn(2, 8, 128, device=CUDA, dtype=torch.bfloat16)
    args = (q, kv, table.page_indptr, table.page_indices, table.last_page_len, 128 ** -0.5)
    assert _rel_err(paged_decode(*args, max_seq_len=32768), reference.paged_decode(*args)) < 2e-2
    qo_indptr = torch.tensor([0, 1024, 1124], device=CUDA, dtype=torch.int32)
    q = torch.randn(1124, 8, 128, device=CUDA, dtype=torch.bfloat16)
    args = (q, kv, qo_indptr, table.page_indptr, table.page_indices, table.last_page_len, 128 ** -0.5)
    assert _rel_err(paged_prefill(*args), reference.paged_prefill(*args)) < 2e-2


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, FP8])
def test_append_push_copy_bit_exact_gpu(cache_dtype):
    geometry = (2, 4, 16, 128)
    kv = torch.zeros(64, *geometry, device=CUDA).to(cache_dtype)
    dsts = [torch.zeros(n, *geometry, device=CUDA).to(cache_dtype) for n in (40, 80)]
    num_tokens = 600
    src_dtype = torch.bfloat16 if cache_dtype == FP8 else cache_dtype
    k = (torch.randn(num_tokens, 4, 128, device=CUDA) * 30).to(src_dtype)
    v = torch.randn(num_tokens, 4, 128, device=CUDA).to(src_dtype)
    slots = torch.randperm(1024, device=CUDA)[:num_tokens]
    slots[::7] = -1
    dst_index = torch.randint(-1, 2, (num_tokens,), device=CUDA)
    dst_slots = torch.randperm(640, device=CUDA)[:num_tokens]
    scales = FP8_SCALES if cache_dtype == FP8 else {}
    ref_kv, ref_dsts = kv.clone(), [d.clone() for d in dsts]
    append_push_kv(k, v, kv, slots, dsts, dst_slots, dst_index, **scales)
    reference.append_push_kv(k, v, ref_kv, slots, ref_dsts, dst_slots, dst_index, *scales.values())
    for got, want in zip([kv] + dsts, [ref_kv] + ref_dsts):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    append_kv(k, v, ref_kv, slots, **scales)
    assert torch.equal(kv.view(torch.uint8), ref_kv.view(torch.uint8))

    layers_src = torch.randn(4, 64, *geometry, device=CUDA).to(cache_dtype)
    layers_dst = torch.randn(4, 96, *geometry, device=CUDA).to(cache_dtype)
    want = layers_dst.clone()
    src_slots, dst_slots = torch.randperm(1024, device=CUDA)[:500], torch.randperm(1536, device=CUDA)[:500]
    src_slots[3] = -1
    copy_slots(layers_src, src_slots, layers_dst, dst_slots)
    reference.copy_slots(layers_src, src_slots, want, dst_slots)
    assert torch.equal(layers_dst.view(torch.uint8), want.view(torch.uint8))


def test_cuda_graph_capture_and_replay(page_table):
    """append -> decode (split, workspace) -> prefill captured once, replayed on new inputs."""
    kv, table = _cache([300, 77, 1024], 16, 2, 128, torch.bfloat16, page_table)
    kv.zero_()
    new_slots = torch.cat([s for s in table.seq_slots]).to(CUDA)
    k = torch.empty(len(new_slots), 2, 128, device=CUDA, dtype=torch.bfloat16)
    v, q_decode = torch.empty_like(k), torch.empty(3, 8, 128, device=CUDA, dtype=torch.bfloat16)
    qo_indptr = torch.tensor([0, 300, 377, 1401], device=CUDA, dtype=torch.int32)
    q_prefill = torch.empty(1401, 8, 128, device=CUDA, dtype=torch.bfloat16)
    o_decode, o_prefill = torch.empty_like(q_decode), torch.empty_like(q_prefill)
    workspace = decode_workspace(3, 8, 128, 4, CUDA)
    tables = (table.page_indptr, table.page_indices, table.last_page_len)

    def step():
        append_kv(k, v, kv, new_slots)
        paged_decode(q_decode, kv, *tables, 0.088, out=o_decode, num_splits=4, workspace=workspace)
        paged_prefill(q_prefill, kv, qo_indptr, *tables, 0.088, out=o_prefill)

    for x in (k, v, q_decode, q_prefill):
        x.normal_()
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        for x in (k, v, q_decode, q_prefill):
            x.normal_()
        kv.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref_kv = torch.zeros_like(kv)
        reference.append_kv(k, v, ref_kv, new_slots)
        assert torch.equal(kv, ref_kv)
        assert _rel_err(o_decode, reference.paged_decode(q_decode, kv, *tables, 0.088)) < 2e-2
        want = reference.paged_prefill(q_prefill, kv, qo_indptr, *tables, 0.088)
        assert _rel_err(o_prefill, want) < 2e-2


@pytest.mark.parametrize("page_size", [1, 16])
def test_fork_chain_copies_in_one_launch_gpu(page_size):
    """A fork of a fork of a fork before any forward: the plan's copies, run as ONE launch with
    check_indices=False (how the pusher runs them on CUDA), give every child its parent's KV."""
    import numpy as np

    from disagg.cache import PagedKVCache

    cache = PagedKVCache(num_pages=64, page_size=page_size)
    kv = torch.zeros(3, 64, 2, 2, page_size, 64, device=CUDA, dtype=torch.bfloat16)
    cache.add_sequence(0)
    plan = cache.begin_forward([0], [page_size + 3])
    slots = torch.from_numpy(plan.append_slots.astype(np.int64)).to(CUDA)
    new = torch.randn(3, 2, plan.num_tokens, 2, 64, device=CUDA).to(torch.bfloat16)
    for layer in range(3):
        append_kv(new[layer, 0], new[layer, 1], kv[layer], slots)
    cache.end_forward()
    cache.fork_sequence(0, 1)
    cache.fork_sequence(1, 2, page_size + 2)
    cache.fork_sequence(2, 3)
    plan = cache.begin_forward([3], [1])
    src = torch.from_numpy(plan.fork_src_slots.astype(np.int64)).to(CUDA)
    dst = torch.from_numpy(plan.fork_dst_slots.astype(np.int64)).to(CUDA)
    copy_slots(kv, src, kv, dst, check_indices=False)
    cache.end_forward()
    torch.cuda.synchronize()

    def keys(seq_id):
        s = torch.from_numpy(cache.slots(seq_id).astype(np.int64)).to(CUDA)
        return torch.stack([kv[layer, s // page_size, 0, :, s % page_size] for layer in range(3)])

    assert torch.equal(keys(1), keys(0))
    assert torch.equal(keys(3)[:, : page_size + 2], keys(0)[:, : page_size + 2])
