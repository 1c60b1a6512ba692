"""Pieces shared by the paged attention kernels (decode and prefill), inlined into both.

`kv_rows` turns token positions of one sequence into element offsets of their K rows in a
`[num_pages, 2, H_kv, P, D]` cache (V rows sit `H_kv * P * D` further on) through the page table.
`attend_tile` is one step of the online softmax (flash attention) in base 2: scores of a query
tile against a K tile, running max/sum update, and the P @ V accumulation. Scores are scaled by
`qk_scale = sm_scale * log2(e) * k_scale` so the fp8 K dequantization costs one multiply.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite floor of the running max (see attend_tile).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def kv_rows(page_indices_ptr, page_start, tok, tok_ok, kv_head_offset, stride_page,
            PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offsets `[BLOCK_N]` (int64) of the K rows of tokens `tok` (0 where masked)."""
    page = tl.load(page_indices_ptr + page_start + tok // PAGE_SIZE, mask=tok_ok, other=0)
    return page.to(tl.int64) * stride_page + kv_head_offset + (tok % PAGE_SIZE) * HEAD_DIM


@triton.jit
def prepare_q(q, qk_scale, k_scale, KV_FP8: tl.constexpr):
    """The query tile in the dtype the dots run in, and the factor that turns q.k into base-2 logits.

    16/32-bit caches: q as is, factor `qk_scale * k_scale`. fp8 caches: the dots run in float16
    (e4m3 widens to float16 in one instruction; the conversion to bfloat16 costs a further one
    per element): q is pre-multiplied by qk_scale, clamped to float16's range, and converted;
    the factor is k_scale alone.
    """
    if KV_FP8:
        q = q.to(tl.float32) * qk_scale
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
        return q, k_scale
    else:
        return q, qk_scale * k_scale


@triton.jit
def attend_tile(acc, l_i, m_i, q, k, v, qk_scale, visible, HAS_MASK: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Fold one K/V tile into the running (acc, l_i, m_i) of a query tile.

    q `[M, BLOCK_D]`, k/v `[N, BLOCK_D]` (any float dtype; cast to q's), visible `[M, N]` bool
    (used when HAS_MASK). m_i starts at a large negative finite value, so a fully masked row keeps
    alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN.
    """
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if HAS_MASK:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new
