"""Paged prefill attention: ragged queries (prompts or prompt chunks) over paged KV, causal, GQA.

Called by the prefill step of the model runner (and the colocated engine's chunked prefill),
once per layer, after `append_kv` has written the new tokens' K/V: the pages already hold the
whole sequence, history first. Query i of a sequence with q_len queries and kv_len keys sits at
key position `kv_len - q_len + i` and, when causal, sees keys up to it.

Program (q head, q block) owns BLOCK_M consecutive queries of one sequence. The grid has
`ceil(T / BLOCK_M) + B` q blocks, an upper bound on the blocks of any ragged batch of T tokens
and B sequences, so it needs no host knowledge of the lengths (and stays CUDA-graph safe); each
program finds its sequence from `qo_indptr` with a prefix sum, and spare programs exit. Blocks
run heaviest first (the last block of a sequence sees the most keys).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from disagg.kernels import checks, dispatch, reference
from disagg.kernels.fp8 import load_scale, resolve_scales
from disagg.kernels.paged_tile import NEG_BIG, attend_tile, check_sm_scale, kv_rows

# Sequences scanned per step when a program looks for its q block. One constant for every batch:
# a constexpr that followed the batch size compiled a new kernel (1-3 s) the first time a batch of a
# new power of two came, which stalled serving (batch_size is not specialized for the same reason).
SEARCH_BLOCK = 256
# Launch options on CUDA by head_dim bound (benchmarks/sweep_kernels.py; the tiles, warps and
# stages tried, with TFLOP/s: benchmarks/records/tuning-notes.md).
CUDA_CONFIGS = {
    128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    256: dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
}
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
# float32 q (IEEE dots on float32 tiles) doubles every tile's bytes: halve both tile sizes so the
# pipelined K/V tiles still fit in shared memory (128 x 128 float32 tiles over-run it).
LN2 = tl.constexpr(math.log(2.0))
LOG2E = tl.constexpr(math.log2(math.e))
LSE_MODES = {None: 0, "store": 1, "merge": 2}


@triton.jit
def merge_two(o_a, lse2_a, o_b, lse2_b):
    """Two attention outputs `[M, D]` (float32) of the same queries over disjoint key sets, merged
    by their base-2 log-sum-exp `[M]` (-inf: no key, weight 0), as FlashInfer's merge_state."""
    m = tl.maximum(lse2_a, lse2_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2(lse2_a - m)
    w_b = tl.exp2(lse2_b - m)
    total = w_a + w_b
    return (o_a * w_a[:, None] + o_b * w_b[:, None]) / tl.where(total > 0.0, total, 1.0)[:, None]


@triton.jit
def _find_q_block(qo_indptr_ptr, batch_size, block, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, index of its first q block) owning global q block `block`; sequence ==
    batch_size when `block` is past the last one."""
    num_before = 0
    blocks_before = 0
    carry = 0
    for c in range(0, batch_size, BLOCK_B):
        i = c + tl.arange(0, BLOCK_B)
        ok = i < batch_size
        q_lens = tl.load(qo_indptr_ptr + i + 1, mask=ok, other=0) - tl.load(qo_indptr_ptr + i, mask=ok, other=0)
        n = tl.cdiv(q_lens, BLOCK_M)
        ends = tl.cumsum(n, 0) + carry  # global q-block index one past each sequence
        done = ok & (ends <= block)
        num_before += tl.sum(done.to(tl.int32), 0)
        blocks_before = tl.maximum(blocks_before, tl.max(tl.where(done, ends, 0), 0))
        carry += tl.sum(n, 0)
    return num_before, blocks_before


@triton.jit
def _key_ranges(shift, m0, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(full_hi, hi): keys [0, full_hi) are visible to every row m0 .. m0+BLOCK_M-1 (a multiple
    of BLOCK_N, no mask needed); keys [full_hi, hi) need the causal/length mask; none beyond."""
    if CAUSAL:
        hi = tl.minimum(shift + m0 + BLOCK_M, kv_len)
        full_hi = tl.maximum(tl.minimum(shift + m0 + 1, kv_len), 0) // BLOCK_N * BLOCK_N
    else:
        hi = kv_len
        full_hi = kv_len // BLOCK_N * BLOCK_N
    return full_hi, hi


@triton.jit(do_not_specialize=["batch_size", "stride_lse_h"])
def paged_prefill_kernel(
    q_ptr, kv_ptr, qo_indptr_ptr, page_indptr_ptr, page_indices_ptr, last_page_len_ptr, o_ptr,
    lse_ptr, other_ptr, k_scale, v_scale, qk_scale, batch_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_page,
    stride_lse_h, stride_other_t, stride_other_h,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, CAUSAL: tl.constexpr, PREFIX_ONLY: tl.constexpr,
    LSE_MODE: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (h, j): q head h, global q block num_programs(1)-1-j (heaviest first). Rows are
    # queries m0 .. m0+BLOCK_M-1 of the owning sequence (masked past q_len). The keys it reads are
    # [0, kv_end): the whole sequence, or with PREFIX_ONLY the prefix before the sequence's own
    # queries (kv_end = kv_len - q_len, every key visible to every row). Keys [0, full_hi) are
    # visible to every row (no mask); keys [full_hi, hi) get the causal and length mask.
    # LSE_MODE 0: o only; 1: also the rows' natural-log LSE into lse_ptr `[H_q, T]` (-inf for a
    # row without keys); 2: lse_ptr and other_ptr hold, on entry, the same rows' attention over
    # other keys and its LSE, and the program writes o = both merged by LSE (merge_state).
    head = tl.program_id(0)
    block = tl.num_programs(1) - 1 - tl.program_id(1)
    seq, first_block = _find_q_block(qo_indptr_ptr, batch_size, block, BLOCK_M, BLOCK_B)
    if seq >= batch_size:
        return
    q_start = tl.load(qo_indptr_ptr + seq)
    q_len = tl.load(qo_indptr_ptr + seq + 1) - q_start
    page_start = tl.load(page_indptr_ptr + seq)
    num_pages = tl.load(page_indptr_ptr + seq + 1) - page_start
    kv_len = tl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + tl.load(last_page_len_ptr + seq), 0)
    m0 = (block - first_block) * BLOCK_M

    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_ok = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    q_offs = (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    shift = kv_len - q_len  # row r sees keys <= shift + r
    if PREFIX_ONLY:
        kv_end = shift
    else:
        kv_end = kv_len
    # A merge without prefix keys only copies the other part: its q rows are never read.
    q_rows = tl.where(kv_end > 0, q_len, 0)
    q = tl.load(q_ptr + q_offs, mask=(rows < q_rows)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    scale = qk_scale * load_scale(k_scale, SCALE_IS_TENSOR)
    kv_head_offset = (head // GROUP) * (PAGE_SIZE * HEAD_DIM)
    v_shift = NUM_KV_HEADS * PAGE_SIZE * HEAD_DIM
    full_hi, hi = _key_ranges(shift, m0, kv_end, BLOCK_M, BLOCK_N, CAUSAL)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    d_ok = (d < HEAD_DIM)[None, :]
    for start in range(0, full_hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        kv = kv_ptr + kv_rows(page_indices_ptr, page_start, tok, tok < full_hi, kv_head_offset,
                              stride_page, PAGE_SIZE, HEAD_DIM)[:, None] + d[None, :]
        if BLOCK_D == HEAD_DIM:
            k = tl.load(kv)
            v = tl.load(kv + v_shift)
        else:
            k = tl.load(kv, mask=d_ok, other=0.0)
            v = tl.load(kv + v_shift, mask=d_ok, other=0.0)
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k, v, scale, True, False, DOT_PRECISION)
    for start in range(full_hi, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_ok = tok < kv_end
        kv = kv_ptr + kv_rows(page_indices_ptr, page_start, tok, tok_ok, kv_head_offset,
                              stride_page, PAGE_SIZE, HEAD_DIM)[:, None] + d[None, :]
        k = tl.load(kv, mask=tok_ok[:, None] & d_ok, other=0.0)
        v = tl.load(kv + v_shift, mask=tok_ok[:, None] & d_ok, other=0.0)
        visible = tok_ok[None, :]
        if CAUSAL:
            visible = visible & (tok[None, :] <= shift + rows[:, None])
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k, v, scale, visible, True, DOT_PRECISION)

    has = l_i > 0.0
    out = acc * (load_scale(v_scale, SCALE_IS_TENSOR) / tl.where(has, l_i, 1.0))[:, None]
    if LSE_MODE != 0:
        tokens = (q_start + rows).to(tl.int64)
        lse_ptrs = lse_ptr + head * stride_lse_h + tokens
        # m_i is the running max of base-2 logits, l_i the sum of exp2(logit - m_i).
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        if LSE_MODE == 1:
            tl.store(lse_ptrs, lse2 * LN2, mask=rows < q_len)
        else:
            other_offs = tokens[:, None] * stride_other_t + head * stride_other_h + d[None, :]
            other = tl.load(other_ptr + other_offs, mask=row_ok, other=0.0).to(tl.float32)
            other_lse2 = tl.load(lse_ptrs, mask=rows < q_len, other=float("-inf")) * LOG2E
            out = merge_two(out, lse2, other, other_lse2)
    o_offs = (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=row_ok)


def _config(head_dim: int, device: torch.device, q_dtype: torch.dtype) -> dict:
    """Tile sizes and launch options: Hopper-sized on CUDA (halved for float32 queries), small
    tiles for the interpreter."""
    if device.type != "cuda":
        return dict(INTERPRETER_CONFIG)
    config = dict(CUDA_CONFIGS[128 if head_dim <= 128 else 256])
    if q_dtype == torch.float32:
        config["BLOCK_M"] //= 2
        config["BLOCK_N"] //= 2
    return config


def _check_prefill_inputs(q, kv_layer, qo_indptr, page_indptr, page_indices, last_page_len, out):
    geo = checks.check_kv_layer("kv_layer", kv_layer)
    device = kv_layer.device
    checks.check_attention_q(q, geo, device, "[num_tokens, num_qo_heads, head_dim]")
    checks.check_index("qo_indptr", qo_indptr, length=None, device=device)
    batch_size = qo_indptr.numel() - 1
    if batch_size < 0:
        raise ValueError("qo_indptr: expected shape [batch_size + 1], got an empty tensor")
    checks.check_page_table(page_indptr, page_indices, last_page_len, batch_size, device)
    checks.check_out(out, q)
    return geo


def _check_lse_inputs(q: torch.Tensor, lse: torch.Tensor | None, merge_with: torch.Tensor | None) -> None:
    """`lse` `[H_q, T]` float32 with unit token stride; `merge_with` like q (strides may differ)."""
    if merge_with is not None and lse is None:
        raise ValueError("merge_with: needs lse, the merged part's log-sum-exp [num_qo_heads, num_tokens]")
    if lse is not None:
        num_tokens, num_qo_heads, _ = q.shape
        checks.check_tensor("lse", lse, dims="[num_qo_heads, num_tokens]", shape=(num_qo_heads, num_tokens),
                            dtypes=(torch.float32,), device=q.device)
        if num_tokens > 1 and lse.stride(1) != 1:
            raise ValueError(f"lse: expected stride 1 along num_tokens, got strides {lse.stride()}")
    if merge_with is not None:
        checks.check_tensor("merge_with", merge_with, dims="like q", shape=tuple(q.shape),
                            dtypes=(q.dtype,), device=q.device)
        checks.check_rows("merge_with", merge_with)


def paged_prefill(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    sm_scale: float,
    causal: bool = True,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    prefix_only: bool = False,
    lse: torch.Tensor | None = None,
    merge_with: torch.Tensor | None = None,
    check_indices: bool | None = None,
    check_args: bool = True,
) -> torch.Tensor:
    """Attention of ragged query runs over paged KV that already holds them.

    The split prefill (`disagg.kernels.split_prefill`) runs it over the prefix only and merges
    the result with the own tokens' part (``prefix_only``, ``lse``, ``merge_with``):

        keys of sequence b:  [ 0 ........ prefix_len | prefix_len ...... kv_len )
                               prefix (pages; every     the q_len new tokens (own
                               query sees all of it)    part: causal, dense)

    Args:
        q: `[T, H_q, D]` float16/bfloat16/float32 (the cache's dtype unless the cache is fp8);
            rows `qo_indptr[b]:qo_indptr[b+1]` are sequence b's newest q_len tokens, in order.
        kv_layer: `[num_pages, 2, H_kv, P, D]`, pages packed; `H_q % H_kv == 0`.
        qo_indptr: `[B+1]` int32/int64. page_indptr: `[B+1]`. page_indices: `[nnz_pages]`.
        last_page_len: `[B]`; kv_len of sequence b is `(pages_b - 1) * P + last_page_len[b]`
            and must be >= its q_len (history + the new tokens).
        sm_scale: softmax scale, usually `D ** -0.5`.
        causal: query i sees keys 0 .. kv_len - q_len + i; otherwise all kv_len keys.
        k_scale, v_scale: fp8 caches only (float or 1-element float32 tensor).
        out: optional `[T, H_q, D]` output buffer of q's dtype (CUDA-graph capture needs it).
        prefix_only: attend to keys `[0, kv_len - q_len)` only, the keys before the sequence's
            own queries, all visible to every query (``causal`` is then moot).
        lse: `[H_q, T]` float32, token stride 1. Without ``merge_with``: written with each query's
            natural-log log-sum-exp of its scaled scores (-inf for a query without keys, whose
            output is 0). With ``merge_with``: read, the log-sum-exp of that part.
        merge_with: `[T, H_q, D]` of q's dtype (head_dim contiguous): the same queries' attention
            over other keys (e.g. the own part of `split_prefill`); the result is both parts
            merged by their log-sum-exp, as if attending over the union of the keys.
        check_indices: range-check the page table and q_len <= kv_len (a host sync on CUDA); see
            `disagg.kernels.dispatch.should_check_values`.
        check_args: check shapes, dtypes, devices and strides; False: the caller vouches that
            they equal those of a checked call (`Model.forward` checks its first layer's only).

    Returns:
        o: `[T, H_q, D]`, q's dtype (`out` when given).
    """
    if check_args:
        geo = _check_prefill_inputs(q, kv_layer, qo_indptr, page_indptr, page_indices, last_page_len, out)
        _check_lse_inputs(q, lse, merge_with)
    else:
        geo = checks.kv_layout(kv_layer)
    sm_scale = check_sm_scale(sm_scale)
    check_values = dispatch.should_check_values(kv_layer.device, check_indices)
    scales = resolve_scales(geo.dtype, kv_layer.device, k_scale, v_scale, check_values=check_values)
    if check_values:
        kv_lens = checks.check_page_table_values(page_indptr, page_indices, last_page_len,
                                                 num_pages=geo.num_pages, page_size=geo.page_size)
        checks.check_qo_indptr_values(qo_indptr, q.shape[0], kv_lens)
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_qo_heads, head_dim = q.shape
    batch_size = qo_indptr.numel() - 1
    if num_tokens == 0:
        return out
    lse_mode = None if lse is None else "store" if merge_with is None else "merge"
    if not dispatch.use_triton(kv_layer):
        _reference_into(out, lse, merge_with, lse_mode, q, kv_layer, qo_indptr, page_indptr,
                        page_indices, last_page_len, sm_scale, causal, prefix_only, scales.host())
        return out
    config = _config(head_dim, q.device, q.dtype)
    grid = (num_qo_heads, triton.cdiv(num_tokens, config["BLOCK_M"]) + batch_size)
    other = out if merge_with is None else merge_with
    dispatch.runnable(paged_prefill_kernel)[grid](
        q, kv_layer, qo_indptr, page_indptr, page_indices, last_page_len, out,
        out if lse is None else lse, other, scales.k, scales.v, sm_scale * math.log2(math.e), batch_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), geo.stride_page,
        0 if lse is None else lse.stride(0), other.stride(0), other.stride(1),
        GROUP=num_qo_heads // geo.num_kv_heads, NUM_KV_HEADS=geo.num_kv_heads, HEAD_DIM=head_dim,
        PAGE_SIZE=geo.page_size, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_B=SEARCH_BLOCK, CAUSAL=bool(causal) and not prefix_only, PREFIX_ONLY=bool(prefix_only),
        LSE_MODE=LSE_MODES[lse_mode], SCALE_IS_TENSOR=scales.is_tensor,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **config,
    )
    return out


def _reference_into(out, lse, merge_with, lse_mode, q, kv_layer, qo_indptr, page_indptr,
                    page_indices, last_page_len, sm_scale, causal, prefix_only, host_scales) -> None:
    """The CPU path of `paged_prefill`: the torch reference, written where the kernel writes."""
    args = (q, kv_layer, qo_indptr, page_indptr, page_indices, last_page_len, sm_scale)
    if lse_mode is None and not prefix_only:
        out.copy_(reference.paged_prefill(*args, causal, *host_scales))
        return
    o, part_lse = reference.paged_prefill_lse(*args, causal, *host_scales, prefix_only=prefix_only)
    if lse_mode == "merge":
        o = reference.merge_state(o, part_lse, merge_with, lse)
    elif lse_mode == "store":
        lse.copy_(part_lse)
    out.copy_(o)
