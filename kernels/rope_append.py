"""RoPE and the K/V append of one layer in one launch: the fused qkv projection's output goes to
roped q (returned) and to roped K and plain V in the paged cache.

Unfused, a layer runs `apply_rope` over the q and k heads (`disagg.kernels.fused`), then
`append_kv` (`disagg.kernels.append`) over k and v: two launches, each a few microseconds at
decode sizes, 64 a llama3-8b step. This kernel rounds exactly as `apply_rope` does and stores
what `append_kv` stores, so q and the cache come out bit for bit the same. 16-bit caches of the
activations' dtype only (an fp8 cache quantizes: the unfused path), and no receivers (a prefill
that pushes goes through the KV pusher). `disagg.model.llama` uses it unless
`DISAGG_ROPE_APPEND=0` (it saves a launch per layer: benchmarks/records/tuning-notes.md). It
runs inside CUDA-graph capture (no host reads of values unless `check_indices`), on the
caller's current stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks, dispatch
from disagg.kernels.fused import round_to_dtype
from disagg.kernels.paged_tile import gdc_launch_dependents, gdc_wait

# Heads (of one token) per program, as a power of two: q, k and v heads of a llama3-8b token
# (32 + 8 + 8) in one program.
MAX_BLOCK_H = 64


@triton.jit
def rope_append_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, slots_ptr,
    stride_qkv, stride_cos, stride_sin, stride_qt, stride_page,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    # Program (t, j) takes heads [j*BLOCK_H, (j+1)*BLOCK_H) of token t's qkv row, laid out as
    # [ q: NUM_Q_HEADS | k: NUM_KV_HEADS | v: NUM_KV_HEADS ] x head_dim (= 2 * HALF). q and k heads
    # rotate (rotate-half, rounded as `apply_rope_kernel`), v heads pass unchanged; q goes to
    # q_ptr[t], k and v to slot `slots[t]` of the cache (K plane, V plane). Masks cover heads past
    # the last v head, BLOCK_HALF's padding past HALF, and slot -1 (no cache write).
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    num_heads = NUM_Q_HEADS + 2 * NUM_KV_HEADS
    head_dim = 2 * HALF
    mask = (h[:, None] < num_heads) & d_ok[None, :]
    src = qkv_ptr + t * stride_qkv + h[:, None].to(tl.int64) * head_dim + d[None, :]
    x_lo = tl.load(src, mask=mask, other=0.0)
    x_hi = tl.load(src + HALF, mask=mask, other=0.0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
    dtype = x_lo.dtype
    cos_lo = tl.load(cos_ptr + t * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_ptr + t * stride_cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_ptr + t * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_ptr + t * stride_sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    lo, hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    rot_lo = round_to_dtype(
        round_to_dtype(lo * cos_lo, dtype) + round_to_dtype(-hi * sin_lo, dtype), dtype)
    rot_hi = round_to_dtype(
        round_to_dtype(hi * cos_hi, dtype) + round_to_dtype(lo * sin_hi, dtype), dtype)
    is_v = h >= NUM_Q_HEADS + NUM_KV_HEADS
    out_lo = tl.where(is_v[:, None], x_lo, rot_lo.to(dtype))
    out_hi = tl.where(is_v[:, None], x_hi, rot_hi.to(dtype))

    is_q = h < NUM_Q_HEADS
    q_dst = q_ptr + t * stride_qt + h[:, None].to(tl.int64) * head_dim + d[None, :]
    tl.store(q_dst, out_lo, mask=mask & is_q[:, None])
    tl.store(q_dst + HALF, out_hi, mask=mask & is_q[:, None])
    # Cache: K plane head (h - NUM_Q_HEADS), V plane head (h - NUM_Q_HEADS - NUM_KV_HEADS), which
    # is the plane offset NUM_KV_HEADS * PAGE_SIZE * head_dim plus the V head's own offset: one
    # formula, kv head index c = h - NUM_Q_HEADS counting on across both planes.
    c = tl.maximum(h - NUM_Q_HEADS, 0).to(tl.int64)
    page_base = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * head_dim
    kv_dst = kv_ptr + page_base + c[:, None] * (PAGE_SIZE * head_dim) + d[None, :]
    writes = (h >= NUM_Q_HEADS) & (tl.zeros([BLOCK_H], tl.int64) + slot >= 0)
    kv_mask = mask & writes[:, None]
    tl.store(kv_dst, out_lo, mask=kv_mask)
    tl.store(kv_dst + HALF, out_hi, mask=kv_mask)


def _check_inputs(qkv, cos, sin, kv_layer, slots, num_qo_heads: int) -> checks.CacheLayout:
    """`rope_append`'s metadata checks (shapes, dtypes, devices, strides); returns the geometry."""
    geo = checks.check_kv_layer("kv_layer", kv_layer)
    head_dim, num_kv_heads = geo.head_dim, geo.num_kv_heads
    width = (num_qo_heads + 2 * num_kv_heads) * head_dim
    checks.check_tensor("qkv", qkv, dims="[num_tokens, (H_q + 2 H_kv) * head_dim]",
                        shape=(None, width), dtypes=(geo.dtype,), device=kv_layer.device)
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv: expected contiguous columns, got strides {qkv.stride()}")
    if head_dim % 2 or num_qo_heads < 1:
        raise ValueError(f"expected an even head_dim and >= 1 q head, got head_dim {head_dim}, "
                         f"num_qo_heads {num_qo_heads}")
    num_tokens = qkv.shape[0]
    for name, table in (("cos", cos), ("sin", sin)):
        checks.check_tensor(name, table, dims="[num_tokens, head_dim]", shape=(num_tokens, head_dim),
                            dtypes=(qkv.dtype,), device=qkv.device)
        if table.stride(1) != 1:
            raise ValueError(f"{name}: expected a contiguous head_dim, got strides {table.stride()}")
    checks.check_index("slots", slots, length=num_tokens, device=kv_layer.device)
    return geo


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                slots: torch.Tensor, num_qo_heads: int, *,
                check_indices: bool | None = None, check_args: bool = True) -> torch.Tensor:
    """Rotate q and k of a fused qkv projection, write k and v into their slots; return q.

    Equal, bit for bit, to `fused.apply_rope` over the q and k heads followed by
    `append.append_kv(k, v, kv_layer, slots)`.

    Args:
        qkv: `[T, (H_q + 2 H_kv) * D]` float16/bfloat16/float32, rows may be strided, columns
            contiguous (q heads, then k heads, then v heads).
        cos, sin: `[T, D]` of qkv's dtype (`rope_cos_sin`), D contiguous.
        kv_layer: `[num_pages, 2, H_kv, P, D]` of qkv's dtype, pages packed; written in place.
        slots: `[T]` int32/int64, `page_id * P + offset`; -1 writes nothing for that token.
        num_qo_heads: H_q (H_kv and D come from the cache).
        check_indices: range-check slot values (a host sync on CUDA); see
            `disagg.kernels.dispatch.should_check_values`.
        check_args: check shapes, dtypes, devices and strides; False: the caller vouches that
            they equal those of a checked call (`Model.forward` checks its first layer's only).

    Returns:
        q `[T, H_q, D]`, contiguous, qkv's dtype.

    Raises:
        TypeError, ValueError: shapes, dtypes, devices or strides that do not fit together; CPU
            tensors without `TRITON_INTERPRET=1`. Nothing is written then.
    """
    geo = (_check_inputs(qkv, cos, sin, kv_layer, slots, num_qo_heads) if check_args
           else checks.kv_layout(kv_layer))
    head_dim, num_kv_heads = geo.head_dim, geo.num_kv_heads
    num_tokens = qkv.shape[0]
    if dispatch.should_check_values(kv_layer.device, check_indices):
        checks.check_slot_values("slots", slots, geo.num_slots)
    if not dispatch.use_triton(qkv):
        raise ValueError(f"qkv: expected a CUDA tensor, or a CPU one with TRITON_INTERPRET=1, got a "
                         f"{qkv.device.type} tensor; apply_rope + append_kv run anywhere")
    q = torch.empty((num_tokens, num_qo_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    num_heads = num_qo_heads + 2 * num_kv_heads
    half = head_dim // 2
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(num_heads))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    dispatch.runnable(rope_append_kernel)[grid](
        qkv, cos, sin, q, kv_layer, slots, qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
        geo.stride_page, NUM_Q_HEADS=num_qo_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        PAGE_SIZE=geo.page_size, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4, enable_fp_fusion=False, **dispatch.pdl_options(qkv.device),
    )
    return q
