"""Pieces shared by the paged attention kernels (decode and prefill), inlined into both.

`kv_rows` turns token positions of one sequence into element offsets of their K rows in a
`[num_pages, 2, H_kv, P, D]` cache (V rows sit `H_kv * P * D` further on) through the page table.
`attend_tile` is one step of the online softmax (flash attention) in base 2: scores of a query
tile against a K tile, running max/sum update, and the P @ V accumulation. Scores are scaled by
`qk_scale = sm_scale * log2(e) * k_scale` so the fp8 K dequantization costs one multiply.
"""

from __future__ import annotations

import functools
import logging
import math

import triton
import triton.language as tl

logger = logging.getLogger(__name__)

try:  # Programmatic dependent launch (Triton >= 3.4 on sm_90+); absent: launches stay plain.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_PDL = True
    _PDL_IMPORT_ERROR: str | None = None
except ImportError as _err:
    HAS_PDL = False
    _PDL_IMPORT_ERROR = repr(_err)

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

@functools.lru_cache(maxsize=None)
def note_missing_pdl() -> bool:
    """Log, once per process, that GPU launches run without programmatic dependent launch
    because its import failed (small decode grids lose its overlap). Returns True if missing."""
    if _PDL_IMPORT_ERROR is not None:
        logger.warning("programmatic dependent launch unavailable (triton.language.extra.cuda: %s): "
                       "decode launches run without PDL", _PDL_IMPORT_ERROR)
    return not HAS_PDL


def check_sm_scale(sm_scale: float) -> float:
    """`sm_scale` as a float. The kernels apply it after the row max (fused into the exponent's
    argument), which needs it positive; a softmax scale is positive anyway.

    Raises:
        ValueError: not a positive finite number.
    """
    value = float(sm_scale)
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale}")
    return value


# Finite floor of the running max (see attend_tile).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def prefetch_l1(ptrs):
    """Hint the lines holding `ptrs` (a small tensor of global pointers) into L1 (CUDA only)."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


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
    alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN. qk_scale > 0, so the scale is applied
    after the row max and fused into the exponent's argument (one FMA per score).
    """
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if HAS_MASK:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def load_words(ptr, rows, tok_ok, BLOCK_D: tl.constexpr):
    """fp8 rows at element offsets `rows` `[BLOCK_N]` from `ptr` as int32 words
    `[BLOCK_N, BLOCK_D // 4]`, four bytes each (0 for masked tokens)."""
    w = tl.arange(0, BLOCK_D // 4)
    words = (ptr + rows[:, None]).to(tl.pointer_type(tl.int32), bitcast=True)
    return tl.load(words + w[None, :], mask=tok_ok[:, None], other=0)


@triton.jit
def softmax_step(acc, l_i, m_i, q, k, v, tok_ok, qk_scale, DEFER_SUM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """`attend_tile` for decode: tokens masked by `tok_ok` `[N]`; with DEFER_SUM, l_i is
    `[M, N]` and holds per-column sums (rescaled like acc), reduced by the caller at the end.

    A decode tile's columns are spread over the warps, so each per-tile row reduction crosses
    warps (shared memory and a barrier); deferring the sum leaves the row max as the only one.
    """
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    qk = tl.where(tok_ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    if DEFER_SUM:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new



@triton.jit
def softmax_step_t(acc, l_i, m_i, q_t, k, v, tok_ok, qk_scale, DEFER_SUM: tl.constexpr,
                   PV_T: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`softmax_step` with the scores transposed: q_t `[BLOCK_D, M]`, scores `k @ q_t`
    `[N, M]` (tokens are the MMA's rows). acc is `[BLOCK_D, M]` when PV_T (`v^T @ p^T`), else
    `[M, BLOCK_D]`; with DEFER_SUM, l_i is `[N, M]`."""
    s = tl.dot(k.to(q_t.dtype), q_t, input_precision=DOT_PRECISION)
    s = tl.where(tok_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[None, :])
    if DEFER_SUM:
        l_i = l_i * alpha[None, :] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 0)
    if PV_T:
        acc = tl.dot(tl.trans(v.to(q_t.dtype)), p.to(q_t.dtype), acc * alpha[None, :],
                     input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(tl.trans(p.to(q_t.dtype)), v.to(q_t.dtype), acc * alpha[:, None],
                     input_precision=DOT_PRECISION)
    return acc, l_i, m_new
