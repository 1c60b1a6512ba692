"""Paged decode attention: one new query per sequence over its paged KV, GQA-grouped, split-K.

Called by the decode step of the model runner, once per layer, usually inside a CUDA graph.
Flash-decoding / PagedAttention V2: program (kv_head, seq, split) loads each K/V tile of its
share of the sequence once for all `H_q / H_kv` query heads of the group (padded to the
dot's minimum of 16 rows) and writes a partial output and its log-sum-exp (fp8 tiles are
loaded as int32 words and widened to float16 in registers). The last split program of a
(sequence, kv head) to finish, counted with an atomic in the workspace, merges the partials
(no second launch: at small batch a merge kernel costs as much as the attention), then resets
its counter for the next launch. Each sequence is cut into `num_splits` equal shares (rounded
to the tile), so long and short sequences in one batch both spread over the GPU; an empty share
has lse = -inf and merges with weight 0. With one split the program writes the output directly.
Small grids (latency-bound) launch with programmatic dependent launch: each program reads its
page-table bounds before waiting on the previous kernel (see `PDL_MAX_PROGRAMS_PER_SM`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from disagg.kernels import checks, dispatch, reference
from disagg.kernels.fp8 import fp8_words_to_f16, load_scale, resolve_scales
from disagg.kernels.paged_tile import (HAS_PDL, NEG_BIG, check_sm_scale, gdc_launch_dependents,
                                       gdc_wait, kv_rows, load_words, note_missing_pdl, prefetch_l1,
                                       prepare_q, softmax_step, softmax_step_t)

# Split heuristic: aim for about this many programs per SM, never fewer than this many tokens
# per split, and at most this many splits. Fewer, longer splits lose at small batch (idle SMs);
# more, shorter ones pay for the merge. Figures: benchmarks/records/tuning-notes.md.
PROGRAMS_PER_SM = 6
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Once the unsplit grid alone gives every SM this many programs, a split must hold at least
# FULL_GRID_MIN_SPLIT_TOKENS tokens: the merge then costs more than the balance it buys.
FULL_GRID_PROGRAMS_PER_SM = 2
FULL_GRID_MIN_SPLIT_TOKENS = 2048
# Launch options by cache dtype (benchmarks/sweep_kernels.py picks them; the options and their
# figures: benchmarks/records/tuning-notes.md): BLOCK_N tokens per K/V tile (halved for
# head_dim > 128 to bound registers), warps, pipeline stages, and DEFER_SUM (keep the softmax
# row sums per column, reduce them once after the loop; see `softmax_step`). The fp8 path
# (K/V widened in registers, see `_attend_range`) runs 2 warps: fewer warps per program leave
# room for more programs per SM, which is what it is short of; tokens as the MMA's rows
# (SWAP_AB) lost on Triton 3.6. "16bit-small": 16-bit caches on latency-bound grids (launched
# with PDL, see below), where deferring the sums wins.
CONFIGS = {
    "16bit": dict(BLOCK_N=64, num_warps=4, num_stages=3, DEFER_SUM=False),
    "16bit-small": dict(BLOCK_N=64, num_warps=4, num_stages=3, DEFER_SUM=True),
    "fp8": dict(BLOCK_N=64, num_warps=2, num_stages=5, DEFER_SUM=True),
}
# Programmatic dependent launch (PDL == 2, see the kernel) for grids of at most this many
# programs per SM, i.e. latency-bound launches, where hiding the launch gap wins; big grids
# launch plainly (PDL slows them). Prefetching the split's pages into L2 before the PDL wait
# is slower too. Figures: benchmarks/records/tuning-notes.md.
PDL_MAX_PROGRAMS_PER_SM = 2
MIN_ROWS = 16


@triton.jit
def paged_decode_kernel(
    q_ptr, kv_ptr, page_indptr_ptr, page_indices_ptr, last_page_len_ptr,
    o_ptr, o_part_ptr, lse_part_ptr, lock_ptr, k_scale, v_scale, qk_scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_page, num_splits,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, KV_FP8: tl.constexpr,
    SCALE_IS_TENSOR: tl.constexpr, DOT_PRECISION: tl.constexpr, K_WORDS: tl.constexpr,
    V_WORDS: tl.constexpr, WIDEN_ASM: tl.constexpr, DEFER_SUM: tl.constexpr,
    SWAP_AB: tl.constexpr, PV_T: tl.constexpr, PDL: tl.constexpr,
):
    # Program (h, b, s): kv head h, sequence b, split s of num_splits. Rows of the query tile are
    # the GROUP q heads h*GROUP .. h*GROUP+GROUP-1, padded to BLOCK_G (masked). Split s covers
    # tokens [s*chunk, min((s+1)*chunk, kv_len)), chunk = ceil(kv_len/num_splits) rounded up to
    # BLOCK_N; an empty range writes lse = -inf. Masks: token tail, row and head_dim padding.
    # The last of the num_splits programs of (h, b) merges them (see _merge_splits).
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    page_start = tl.load(page_indptr_ptr + seq)
    num_pages = tl.load(page_indptr_ptr + seq + 1) - page_start
    kv_len = tl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + tl.load(last_page_len_ptr + seq), 0)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    if PDL:
        # Programmatic dependent launch: the page table is the host's, written before the
        # graph; q and the cache (this step's token was just appended) come from the kernels
        # before this one, so everything past here waits for them. PDL == 2 also pulls the
        # lines holding this split's first and last page ids into L1 while the previous
        # kernel finishes (the first K/V load otherwise waits on them after the wait).
        if PDL == 2:
            first = tl.minimum(lo // PAGE_SIZE, tl.maximum(num_pages - 1, 0))
            last = tl.minimum((hi - 1) // PAGE_SIZE, tl.maximum(num_pages - 1, 0))
            ends = tl.where(tl.arange(0, 2) == 0, first, tl.maximum(last, first))
            ids = tl.where(num_pages > 0, page_indices_ptr + page_start + ends, page_indptr_ptr)
            prefetch_l1(ids)
        gdc_wait()
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_ok = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok, other=0.0)
    q, scale = prepare_q(q, qk_scale, load_scale(k_scale, SCALE_IS_TENSOR), KV_FP8)
    acc, l_i, m_i = _attend_range(q, scale, kv_ptr, page_indices_ptr, page_start, lo, hi,
                                  kv_head * (PAGE_SIZE * HEAD_DIM), stride_page, d,
                                  NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_G, BLOCK_D, BLOCK_N,
                                  DOT_PRECISION, K_WORDS, V_WORDS, WIDEN_ASM, DEFER_SUM,
                                  SWAP_AB, PV_T)
    if PDL:
        gdc_launch_dependents()

    has = l_i > 0.0
    out = acc * (load_scale(v_scale, SCALE_IS_TENSOR) / tl.where(has, l_i, 1.0))[:, None]
    if DIRECT:
        o_offs = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=row_ok)
    else:
        base = (seq * (NUM_KV_HEADS * GROUP) + heads).to(tl.int64) * num_splits
        tl.store(o_part_ptr + (base + split)[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_part_ptr + base + split, lse, mask=g < GROUP)
        # Every thread's partial stores happen before the (release) arrival; the last arrival
        # (acquire) sees all num_splits partials of this (sequence, kv head).
        tl.debug_barrier()
        lock = lock_ptr + seq * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            _merge_splits(o_ptr, o_part_ptr, lse_part_ptr, base, seq, heads, g < GROUP, d,
                          num_splits, stride_ob, stride_oh, HEAD_DIM, BLOCK_G, BLOCK_D)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _attend_range(q, scale, kv_ptr, page_indices_ptr, page_start, lo, hi, kv_head_offset,
                  stride_page, d, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, K_WORDS: tl.constexpr,
                  V_WORDS: tl.constexpr, WIDEN_ASM: tl.constexpr, DEFER_SUM: tl.constexpr,
                  SWAP_AB: tl.constexpr, PV_T: tl.constexpr):
    """Online softmax of the query tile over tokens [lo, hi): (acc, l_i, m_i), unnormalized.

    K_WORDS / V_WORDS (fp8 cache, BLOCK_D == HEAD_DIM): that tile is loaded as int32 words and
    widened to float16 in registers (`fp8_words_to_f16`), so it reaches the dots' shared-memory
    operands as 16-bit data; other tiles are cast at the dot. SWAP_AB: the scores are computed
    transposed, `k @ q^T` `[BLOCK_N, BLOCK_G]`, so tokens fill the MMA's M dimension (wgmma
    needs 64 rows; the GQA group pads only N) and K is its A operand; PV_T: likewise
    `v^T @ p^T` `[BLOCK_D, BLOCK_G]` for the output (transposed back at the end).
    """
    v_shift = NUM_KV_HEADS * PAGE_SIZE * HEAD_DIM
    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    if DEFER_SUM:
        if SWAP_AB:
            l_i = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
        else:
            l_i = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_G], tl.float32)
    if SWAP_AB:
        q = tl.trans(q)
    if PV_T:
        acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_ok = tok < hi
        rows = kv_rows(page_indices_ptr, page_start, tok, tok_ok, kv_head_offset, stride_page,
                       PAGE_SIZE, HEAD_DIM)
        k = _load_tile(kv_ptr, rows, tok_ok, d, HEAD_DIM, BLOCK_D, K_WORDS, WIDEN_ASM)
        v = _load_tile(kv_ptr + v_shift, rows, tok_ok, d, HEAD_DIM, BLOCK_D, V_WORDS, WIDEN_ASM)
        if SWAP_AB:
            acc, l_i, m_i = softmax_step_t(acc, l_i, m_i, q, k, v, tok_ok, scale, DEFER_SUM,
                                           PV_T, DOT_PRECISION)
        else:
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, q, k, v, tok_ok, scale, DEFER_SUM,
                                         DOT_PRECISION)
    if PV_T:
        acc = tl.trans(acc)
    if DEFER_SUM:
        l_i = tl.sum(l_i, 0 if SWAP_AB else 1)
    return acc, l_i, m_i


@triton.jit
def _load_tile(ptr, rows, tok_ok, d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               WORDS: tl.constexpr, WIDEN_ASM: tl.constexpr):
    """K or V rows at element offsets `rows` `[BLOCK_N]` from `ptr`: `[BLOCK_N, BLOCK_D]`, 0 where
    masked; fp8 rows as int32 words widened to float16 in registers when WORDS, else as stored."""
    if WORDS:
        return fp8_words_to_f16(load_words(ptr, rows, tok_ok, BLOCK_D), WIDEN_ASM)
    else:
        tile_ok = tok_ok[:, None] & (d < HEAD_DIM)[None, :]
        return tl.load(ptr + rows[:, None] + d[None, :], mask=tile_ok, other=0.0)


@triton.jit
def _merge_splits(o_ptr, o_part_ptr, lse_part_ptr, base, seq, heads, g_ok, d, num_splits,
                  stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """o[seq, heads] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max), streamed over splits.

    Empty splits (lse = -inf) weigh 0; a sequence with no key gives 0, never NaN. Partials are
    read with .cg (L2, not this SM's L1) since other programs wrote them during this launch.
    """
    row_ok = g_ok[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(lse_part_ptr + base + s, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(o_part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=row_ok,
                       other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * w[:, None]
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    o_offs = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=row_ok)


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per sequence: enough programs to fill `num_sms` SMs, none shorter than
    MIN_SPLIT_TOKENS tokens (FULL_GRID_MIN_SPLIT_TOKENS once the unsplit grid fills the SMs), at
    most MAX_SPLITS. Pure host arithmetic (no device sync)."""
    programs = max(1, batch_size * num_kv_heads)
    by_sms = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    full = programs >= FULL_GRID_PROGRAMS_PER_SM * num_sms
    by_len = triton.cdiv(max(1, max_seq_len), FULL_GRID_MIN_SPLIT_TOKENS if full else MIN_SPLIT_TOKENS)
    return max(1, min(by_sms, by_len, MAX_SPLITS))


def decode_workspace_numel(batch_size: int, num_qo_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of the `workspace` that `paged_decode` needs (0 for one split): partial
    outputs, their log-sum-exps, and one int32 arrival counter per (sequence, head)."""
    if num_splits <= 1:
        return 0
    return batch_size * num_qo_heads * (num_splits * (head_dim + 1) + 1)


def decode_workspace(batch_size: int, num_qo_heads: int, head_dim: int, num_splits: int,
                     device: torch.device | str) -> torch.Tensor:
    """A zero-filled workspace for `paged_decode(..., num_splits=num_splits, workspace=...)`.

    Allocate it once (outside any CUDA-graph capture) and reuse it for every call with at most
    these sizes on one stream: each launch leaves its arrival counters at zero again.
    """
    numel = max(1, decode_workspace_numel(batch_size, num_qo_heads, head_dim, num_splits))
    return torch.zeros(numel, dtype=torch.float32, device=device)


def _config(head_dim: int, is_fp8: bool, on_gpu: bool, small: bool) -> dict:
    """Launch options for a head_dim and cache dtype (BLOCK_N halved past head_dim 128).

    fp8 word loads need whole rows (head_dim a power of two); their widening is inline PTX on
    the GPU and shifts in the interpreter. `small`: a latency-bound grid (at most
    PDL_MAX_PROGRAMS_PER_SM programs per SM), which launches with programmatic dependent launch
    (GPU only, where Triton has it) and, for 16-bit caches, takes "16bit-small".
    """
    config = dict(CONFIGS["fp8" if is_fp8 else "16bit-small" if small else "16bit"])
    if head_dim > 128:
        config["BLOCK_N"] = max(16, config["BLOCK_N"] // 2)
    words_ok = is_fp8 and head_dim == triton.next_power_of_2(head_dim)
    config["K_WORDS"] = words_ok and config.pop("K_WORDS", True)
    config["V_WORDS"] = words_ok and config.pop("V_WORDS", True)
    config["WIDEN_ASM"] = on_gpu
    config.setdefault("SWAP_AB", False)
    config.setdefault("PV_T", False)
    if on_gpu and not HAS_PDL:
        note_missing_pdl()
    level = int(config.pop("PDL", 2 if small else 0)) if on_gpu and HAS_PDL else 0
    config["PDL"] = level
    if level:
        config["launch_pdl"] = True
    return config


def _check_decode_inputs(q, kv_layer, page_indptr, page_indices, last_page_len, out):
    geo = checks.check_kv_layer("kv_layer", kv_layer)
    device = kv_layer.device
    checks.check_attention_q(q, geo, device, "[batch_size, num_qo_heads, head_dim]")
    checks.check_page_table(page_indptr, page_indices, last_page_len, q.shape[0], device)
    checks.check_out(out, q)
    return geo


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    page_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    sm_scale: float,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    workspace: torch.Tensor | None = None,
    check_indices: bool | None = None,
    check_args: bool = True,
) -> torch.Tensor:
    """Attention of one new query per sequence over its paged KV.

    Sequence b owns pages `page_indices[page_indptr[b]:page_indptr[b+1]]`, all full except the
    last, which holds `last_page_len[b]` tokens (a sequence with no page attends to nothing and
    gets 0).

    Args:
        q: `[B, H_q, D]` float16/bfloat16/float32 (the cache's dtype unless the cache is fp8);
            head_dim contiguous. `H_q % H_kv == 0`.
        kv_layer: `[num_pages, 2, H_kv, P, D]`, pages packed.
        page_indptr: `[B+1]` int32/int64. page_indices: `[nnz_pages]`. last_page_len: `[B]`.
        sm_scale: softmax scale, usually `D ** -0.5`.
        k_scale, v_scale: fp8 caches only (float or 1-element float32 tensor).
        out: optional `[B, H_q, D]` output buffer of q's dtype.
        num_splits: splits per sequence; default from `choose_num_splits`.
        max_seq_len: longest sequence in the batch, for the split heuristic; without it the bound
            `nnz_pages * P` is used (no device sync either way).
        workspace: from `decode_workspace(...)` (float32, at least `decode_workspace_numel(...)`
            elements, its counters zero as that function leaves them); allocated when None. Pass
            `out`, `num_splits` and `workspace` to make the call capturable in a CUDA graph. One
            call at a time per workspace (calls on one stream are fine).
        check_indices: range-check the page table (a host sync on CUDA); see
            `disagg.kernels.dispatch.should_check_values`.
        check_args: check shapes, dtypes, devices and strides; False: the caller vouches that
            they equal those of a checked call (`Model.forward` checks its first layer's only).

    Returns:
        o: `[B, H_q, D]`, q's dtype (`out` when given).
    """
    geo = (_check_decode_inputs(q, kv_layer, page_indptr, page_indices, last_page_len, out)
           if check_args else checks.kv_layout(kv_layer))
    sm_scale = check_sm_scale(sm_scale)
    check_values = dispatch.should_check_values(kv_layer.device, check_indices)
    scales = resolve_scales(geo.dtype, kv_layer.device, k_scale, v_scale, check_values=check_values)
    if check_values:
        checks.check_page_table_values(page_indptr, page_indices, last_page_len,
                                       num_pages=geo.num_pages, page_size=geo.page_size)
    out = torch.empty_like(q) if out is None else out
    batch_size, num_qo_heads, head_dim = q.shape
    if batch_size == 0:
        return out
    if not dispatch.use_triton(kv_layer):
        out.copy_(reference.paged_decode(q, kv_layer, page_indptr, page_indices, last_page_len,
                                         sm_scale, *scales.host()))
        return out
    num_splits, workspace = _splits_and_workspace(q, geo, page_indices.numel(), num_splits,
                                                  max_seq_len, workspace)
    _launch(q, kv_layer, page_indptr, page_indices, last_page_len, out, workspace, geo, scales,
            sm_scale, num_splits)
    return out


def _splits_and_workspace(q, geo, num_page_ids, num_splits, max_seq_len, workspace):
    """The split count (given, or from the heuristic) and a workspace big enough for it."""
    batch_size, num_qo_heads, head_dim = q.shape
    if num_splits is None:
        longest = max_seq_len if max_seq_len is not None else num_page_ids * geo.page_size
        num_splits = choose_num_splits(batch_size, geo.num_kv_heads, longest,
                                       dispatch.device_sms(q.device))
    if not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits: expected 1..65535, got {num_splits}")
    need = decode_workspace_numel(batch_size, num_qo_heads, head_dim, num_splits)
    if workspace is None:
        return num_splits, decode_workspace(batch_size, num_qo_heads, head_dim, num_splits, q.device)
    if workspace.dtype != torch.float32 or workspace.numel() < need or workspace.device != q.device:
        raise ValueError(
            f"workspace: expected float32 on {q.device} with >= {need} elements, got "
            f"{workspace.dtype} with {workspace.numel()} on {workspace.device}"
        )
    return num_splits, workspace


def _launch(q, kv_layer, page_indptr, page_indices, last_page_len, out, workspace, geo, scales,
            sm_scale, num_splits):
    batch_size, num_qo_heads, head_dim = q.shape
    group = num_qo_heads // geo.num_kv_heads
    num_parts = batch_size * num_qo_heads * num_splits
    o_part = workspace[: num_parts * head_dim]
    lse_part = workspace[num_parts * head_dim: num_parts * (head_dim + 1)]
    locks = workspace[num_parts * (head_dim + 1):].view(torch.int32)
    programs = geo.num_kv_heads * batch_size * num_splits
    small = programs <= PDL_MAX_PROGRAMS_PER_SM * dispatch.device_sms(q.device)
    dispatch.runnable(paged_decode_kernel)[(geo.num_kv_heads, batch_size, num_splits)](
        q, kv_layer, page_indptr, page_indices, last_page_len, out, o_part, lse_part, locks,
        scales.k, scales.v, sm_scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), geo.stride_page, num_splits,
        GROUP=group, NUM_KV_HEADS=geo.num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=geo.page_size,
        BLOCK_G=max(MIN_ROWS, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        DIRECT=num_splits == 1, KV_FP8=scales.is_fp8, SCALE_IS_TENSOR=scales.is_tensor,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **_config(head_dim, scales.is_fp8, q.is_cuda, small),
    )
