"""Append new tokens' K/V into the paged cache, optionally pushing them to receivers in the same pass.

`append_kv` is the model runner's write of one layer's new K/V into its local pages (vLLM's
`reshape_and_cache_flash` for the HND layout). `append_push_kv` is the KV pusher's fused version
(`disagg.transfer`): each K/V tile is loaded once and stored twice, locally and into a receiver's
pages, which may live in another GPU's memory mapped into this process (an NVSHMEM peer view) or
in another process's file (the CPU shm heap). One launch serves every receiver in the batch: the
kernel adds a per-receiver element offset (`build_dst_table`) to the local cache's pointer.
Both run on the caller's current stream, capture-safe when no values are checked (`check_indices`)
and, for the push, when `dst_table` is prebuilt.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from disagg.kernels import checks, dispatch, reference
from disagg.kernels.fp8 import Scales, load_scale, quantize_fp8, resolve_scales

# A receiver's cache offset must keep 16-element alignment so stores stay vectorized.
DST_ALIGN_ELEMENTS = 16
# Elements of K (and of V) one program moves, and its warps (tuned on one H200).
TILE_ELEMENTS = 16384
NUM_WARPS = 4


@triton.jit
def _store_tile(ptr, offs, x, mask, scale, QUANT: tl.constexpr):
    if QUANT:
        x = quantize_fp8(x, scale)
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def append_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slots_ptr,
    dst_slots_ptr, dst_index_ptr, dst_table_ptr,
    k_scale, v_scale,
    num_tokens, stride_kt, stride_kh, stride_vt, stride_vh, stride_page,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PUSH: tl.constexpr, QUANT: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
):
    # Program (i, j) moves tokens [i*BLOCK_T, (i+1)*BLOCK_T) x kv heads [j*BLOCK_H, (j+1)*BLOCK_H)
    # as one [BLOCK_T, BLOCK_H, BLOCK_D] tile of K and one of V. Masks cover the ragged token
    # tail, head/head_dim padding to powers of two, and skipped slots (-1) locally and remotely.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    col_ok = (h[None, :, None] < NUM_HEADS) & (d[None, None, :] < HEAD_DIM)

    slot = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    # In-page offset of (head, dim) for slot offset 0; K at +0, V at +NUM_HEADS*PAGE_SIZE*HEAD_DIM.
    inner = h[None, :, None] * (PAGE_SIZE * HEAD_DIM) + d[None, None, :]
    v_shift = NUM_HEADS * PAGE_SIZE * HEAD_DIM
    local = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * HEAD_DIM
    local = local[:, None, None] + inner
    local_ok = (slot >= 0)[:, None, None] & col_ok

    src_ok = t_ok[:, None, None] & col_ok
    t64 = t.to(tl.int64)[:, None, None]
    k = tl.load(k_ptr + t64 * stride_kt + h[None, :, None] * stride_kh + d[None, None, :], mask=src_ok)
    v = tl.load(v_ptr + t64 * stride_vt + h[None, :, None] * stride_vh + d[None, None, :], mask=src_ok)
    ks = load_scale(k_scale, SCALE_IS_TENSOR)
    vs = load_scale(v_scale, SCALE_IS_TENSOR)
    _store_tile(kv_ptr, local, k, local_ok, ks, QUANT)
    _store_tile(kv_ptr, local + v_shift, v, local_ok, vs, QUANT)

    if PUSH:
        dst_slot = tl.load(dst_slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
        receiver = tl.load(dst_index_ptr + t, mask=t_ok, other=-1)
        remote_ok = (dst_slot >= 0) & (receiver >= 0)
        # Element distance from this cache to the receiver's (build_dst_table keeps it aligned).
        base = tl.load(dst_table_ptr + receiver, mask=remote_ok, other=0)
        base = tl.multiple_of(base, 16)
        remote = base + (dst_slot // PAGE_SIZE) * stride_page + (dst_slot % PAGE_SIZE) * HEAD_DIM
        remote = remote[:, None, None] + inner
        remote_ok = remote_ok[:, None, None] & col_ok
        _store_tile(kv_ptr, remote, k, remote_ok, ks, QUANT)
        _store_tile(kv_ptr, remote + v_shift, v, remote_ok, vs, QUANT)


def _check_new_kv(k: torch.Tensor, v: torch.Tensor, geo: checks.KVGeometry,
                  device: torch.device) -> int:
    """Check k, v `[T, H_kv, D]` against the cache; return T."""
    dims = "[num_tokens, num_kv_heads, head_dim]"
    shape = (None, geo.num_kv_heads, geo.head_dim)
    checks.check_tensor("k", k, dims=dims, shape=shape, dtypes=checks.ATTN_DTYPES, device=device)
    checks.check_tensor("v", v, dims=dims, shape=(k.shape[0],) + shape[1:], dtypes=(k.dtype,),
                        device=device)
    if geo.dtype != torch.float8_e4m3fn and k.dtype != geo.dtype:
        raise TypeError(f"k: expected the cache's dtype {geo.dtype}, got {k.dtype}")
    checks.check_rows("k", k)
    checks.check_rows("v", v)
    return k.shape[0]


def _launch(k, v, kv_layer, slots, geo: checks.KVGeometry, scales: Scales, push_args) -> None:
    num_tokens = k.shape[0]
    block_h = min(triton.next_power_of_2(geo.num_kv_heads), 8)
    block_d = triton.next_power_of_2(geo.head_dim)
    block_t = max(1, min(64, TILE_ELEMENTS // (block_h * block_d)))
    dst_slots, dst_index, dst_table = push_args if push_args is not None else (slots, slots, slots)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(geo.num_kv_heads, block_h))
    dispatch.runnable(append_kv_kernel)[grid](
        k, v, kv_layer, slots, dst_slots, dst_index, dst_table, scales.k, scales.v,
        num_tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1), geo.stride_page,
        NUM_HEADS=geo.num_kv_heads, HEAD_DIM=geo.head_dim, PAGE_SIZE=geo.page_size,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        PUSH=push_args is not None, QUANT=scales.is_fp8, SCALE_IS_TENSOR=scales.is_tensor,
        num_warps=NUM_WARPS,
    )


def append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    check_indices: bool | None = None,
) -> None:
    """Write new tokens' K/V into their slots of one layer's paged cache.

    Args:
        k: `[T, H_kv, D]` float16/bfloat16/float32 (the cache's dtype unless the cache is fp8);
            head_dim contiguous, other strides free (e.g. a slice of a fused qkv output).
        v: `[T, H_kv, D]`, like k.
        kv_layer: `[num_pages, 2, H_kv, P, D]`, pages packed; written in place.
        slots: `[T]` int32/int64, `page_id * P + offset`, -1 skips the token.
        k_scale: fp8 caches only: float or 1-element float32 tensor; stored value is
            `clamp(k / k_scale, -448, 448)` in e4m3. Default 1.0.
        v_scale: like k_scale, for V.
        check_indices: range-check slot values (a host sync on CUDA); see
            `disagg.kernels.dispatch.should_check_values` for the default.

    Raises:
        TypeError, ValueError: see `disagg.kernels.checks`; nothing is written then.
    """
    geo = checks.check_kv_layer("kv_layer", kv_layer)
    num_tokens = _check_new_kv(k, v, geo, kv_layer.device)
    checks.check_index("slots", slots, length=num_tokens, device=kv_layer.device)
    scales = resolve_scales(geo.dtype, kv_layer.device, k_scale, v_scale)
    if dispatch.should_check_values(kv_layer.device, check_indices):
        checks.check_slot_values("slots", slots, geo.num_slots)
    if num_tokens == 0:
        return
    if not dispatch.use_triton(kv_layer):
        reference.append_kv(k, v, kv_layer, slots, *scales.host())
        return
    _launch(k, v, kv_layer, slots, geo, scales, None)


def build_dst_table(kv_layer: torch.Tensor, dst_layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Element offsets of each receiver cache from `kv_layer`, for `append_push_kv(dst_table=)`.

    When the local and receiver caches have the same shape (the symmetric heap allocates the same
    `[num_layers, num_pages, ...]` on every PE), the offset of layer l's receiver view from layer
    l's local view is the same for every l: build the table once per plan (outside a CUDA-graph
    capture: it copies to the device) and reuse it for all layers.

    Args:
        kv_layer: `[num_pages, 2, H_kv, P, D]` local cache view.
        dst_layers: R views of the same geometry (peer views are fine).

    Returns:
        `[R]` int64 on kv_layer's device (at least one element; unused when R == 0).

    Raises:
        ValueError: a receiver view not a multiple of 16 elements away from kv_layer.
    """
    elem = kv_layer.element_size()
    offsets = []
    for i, dst in enumerate(dst_layers):
        distance = dst.data_ptr() - kv_layer.data_ptr()
        if distance % (elem * DST_ALIGN_ELEMENTS):
            raise ValueError(
                f"dst_layers[{i}]: expected its data {DST_ALIGN_ELEMENTS * elem}-byte aligned "
                f"relative to kv_layer, got a distance of {distance} bytes"
            )
        offsets.append(distance // elem)
    return torch.tensor(offsets or [0], dtype=torch.int64, device=kv_layer.device)


def _check_receivers(kv_layer: torch.Tensor, geo: checks.KVGeometry,
                     dst_layers: Sequence[torch.Tensor]) -> list[checks.KVGeometry]:
    """Each receiver view must match the local cache's layout and page stride."""
    if isinstance(dst_layers, torch.Tensor) or not isinstance(dst_layers, Sequence):
        raise TypeError(f"dst_layers: expected a sequence of tensors, got {type(dst_layers).__name__}")
    geos = []
    for i, dst in enumerate(dst_layers):
        name = f"dst_layers[{i}]"
        dst_geo = checks.check_kv_layer(name, dst)
        if not dst_geo.same_layout(geo) or dst_geo.stride_page != geo.stride_page:
            raise ValueError(
                f"{name}: expected kv_layer's geometry (H_kv={geo.num_kv_heads}, P={geo.page_size}, "
                f"D={geo.head_dim}, {geo.dtype}, page stride {geo.stride_page}), got "
                f"(H_kv={dst_geo.num_kv_heads}, P={dst_geo.page_size}, D={dst_geo.head_dim}, "
                f"{dst_geo.dtype}, page stride {dst_geo.stride_page})"
            )
        if dst.device.type != kv_layer.device.type:
            raise ValueError(f"{name}: expected a {kv_layer.device.type} tensor, got {dst.device}")
        geos.append(dst_geo)
    return geos


def _check_push_values(dst_slots: torch.Tensor, dst_index: torch.Tensor,
                       geos: list[checks.KVGeometry]) -> None:
    """dst_index in [-1, R); each pushed token's dst slot in [-1, its receiver's num_slots)."""
    if dst_index.numel() == 0:
        return
    checks.check_slot_values("dst_index", dst_index, len(geos))
    limits = torch.tensor([g.num_slots for g in geos] or [0], dtype=torch.int64,
                          device=dst_index.device)
    receiver = dst_index.clamp(min=0).to(torch.int64)
    bad = (dst_slots < -1) | ((dst_index >= 0) & (dst_slots >= limits[receiver]))
    if bool(bad.any()):
        t = int(bad.to(torch.int8).argmax())
        r = int(dst_index[t])
        raise ValueError(
            f"dst_slots: expected -1 or a slot of receiver {r} in [0, {geos[r].num_slots if r >= 0 else 0}),"
            f" got {int(dst_slots[t])} at position {t}"
        )


def append_push_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    dst_layers: Sequence[torch.Tensor],
    dst_slots: torch.Tensor,
    dst_index: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    dst_table: torch.Tensor | None = None,
    check_indices: bool | None = None,
) -> None:
    """`append_kv` plus a push of the same tokens into receivers' caches, in one launch.

    Token t is written to `kv_layer` at `slots[t]` (skipped when -1) and to
    `dst_layers[dst_index[t]]` at `dst_slots[t]` (skipped when either is -1). Each K/V tile is
    loaded once and stored twice (fp8 caches: quantized once).

    Args:
        k, v, kv_layer, slots, k_scale, v_scale: as in `append_kv`.
        dst_layers: R receiver views, each `[num_pages_r, 2, H_kv, P, D]` with kv_layer's dtype,
            page layout and page stride; peer views of other GPUs (same address space) or CPU
            tensors mapping another process's memory.
        dst_slots: `[T]` int32/int64 receiver slots, -1 = not sent.
        dst_index: `[T]` int32/int64 index into dst_layers, -1 = not sent.
        dst_table: `[R]` int64 from `build_dst_table` (trusted, not re-checked): pass it to keep
            the launch allocation-free and CUDA-graph capturable; built here when None.
        check_indices: range-check slots/dst_index/dst_slots (host sync on CUDA).

    Raises:
        TypeError, ValueError: bad shapes, dtypes, geometry or index values; nothing is written.
    """
    geo = checks.check_kv_layer("kv_layer", kv_layer)
    device = kv_layer.device
    num_tokens = _check_new_kv(k, v, geo, device)
    checks.check_index("slots", slots, length=num_tokens, device=device)
    checks.check_index("dst_slots", dst_slots, length=num_tokens, device=device)
    checks.check_index("dst_index", dst_index, length=num_tokens, device=device)
    geos = _check_receivers(kv_layer, geo, dst_layers)
    if dst_table is not None:
        checks.check_tensor("dst_table", dst_table, dims="[num_receivers]",
                            shape=(max(len(geos), 1),), dtypes=(torch.int64,), device=device)
    scales = resolve_scales(geo.dtype, device, k_scale, v_scale)
    if dispatch.should_check_values(device, check_indices):
        checks.check_slot_values("slots", slots, geo.num_slots)
        _check_push_values(dst_slots, dst_index, geos)
    if num_tokens == 0:
        return
    if not dispatch.use_triton(kv_layer):
        reference.append_push_kv(k, v, kv_layer, slots, dst_layers, dst_slots, dst_index,
                                 *scales.host())
        return
    if dst_table is None:
        dst_table = build_dst_table(kv_layer, dst_layers)
    _launch(k, v, kv_layer, slots, geo, scales, (dst_slots, dst_index, dst_table))
