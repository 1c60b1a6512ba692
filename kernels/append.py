"""Append new tokens' K/V into the paged cache, optionally pushing them to receivers in the same pass.

`append_kv` is the model runner's write of one layer's new K/V into its local pages (vLLM's
`reshape_and_cache_flash` for the HND layout). `append_push_kv` is the KV pusher's fused version
(`disagg.transfer`): each K/V tile is loaded once and stored twice, locally and into a receiver's
pages, which may live in another GPU's memory mapped into this process (an NVSHMEM peer view) or
in another process's file (the CPU shm heap). One launch serves every receiver in the batch: the
kernel adds a per-receiver element offset (`build_dst_table`) to the local cache's pointer.
Both run on the caller's current stream, capture-safe when no values are checked (`check_indices`)
and, for the push, when `dst_table` is prebuilt.

`prepare_append_push` is the per-forward form for a layer loop: it checks everything that is the
same for all layers once (geometry, receivers, index values, offset table) and returns a
`PreparedAppend` whose per-layer call checks only k/v against what it has seen and launches the
compiled kernel directly (a few microseconds of host time instead of ~100: the one-shot
launchers' checks plus Triton's argument binding would otherwise bound a layer-wise push by the
CPU rather than by NVLink).
"""

from __future__ import annotations

import copy
import operator
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from disagg.kernels import checks, dispatch, reference
from disagg.kernels.fp8 import FP8_DTYPE, Scales, load_scale, quantize_fp8, resolve_scales

# A receiver's cache offset must keep 16-element alignment so stores stay vectorized.
DST_ALIGN_ELEMENTS = 16
# (elements of K, and of V, one program moves; its warps), by kernel variant. "append": local
# stores only, large programs (benchmarks/bench_kernels.py). "push": the fused append+push
# across NVLink (benchmarks/sweep_push.py): small programs leave short tails at each launch's
# end and many warps keep enough stores in flight; far larger programs spill registers.
# Figures: benchmarks/records/tuning-notes.md.
LAUNCH = {"append": (16384, 4), "push": (4096, 16)}


@triton.jit
def _store_tile(ptr, offs, x, mask, scale, QUANT: tl.constexpr):
    if QUANT:
        x = quantize_fp8(x, scale)
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def append_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slots_ptr,
    dst_slots_ptr, dst_index_ptr, dst_table_ptr,
    k_scale, v_scale,
    num_tokens, stride_kt, stride_kh, stride_vt, stride_vh, stride_page, dst_stride_page,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PUSH: tl.constexpr, ROUTES: tl.constexpr, QUANT: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
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
        if ROUTES == 0:  # one receiver per token, pages shaped like the local ones
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
        else:  # head routes: up to ROUTES receivers per token, each takes a head range of it
            # into its pages of dst_stride_page elements (another head count than the local ones).
            dst_at = (dst_slot // PAGE_SIZE) * dst_stride_page + (dst_slot % PAGE_SIZE) * HEAD_DIM
            for r in tl.static_range(ROUTES):
                receiver = tl.load(dst_index_ptr + r * num_tokens + t, mask=t_ok, other=-1)
                route_ok = (dst_slot >= 0) & (receiver >= 0)
                # The receiver's row (`ROUTE_COLUMNS`): offset, first head, head count, head shift.
                row = dst_table_ptr + receiver.to(tl.int64) * 4
                base = tl.multiple_of(tl.load(row, mask=route_ok, other=0), 16)
                first = tl.load(row + 1, mask=route_ok, other=0)
                count = tl.load(row + 2, mask=route_ok, other=0)
                shift = tl.load(row + 3, mask=route_ok, other=0)
                head_ok = (h[None, :] >= first[:, None]) & (h[None, :] < (first + count)[:, None])
                remote = (base + dst_at)[:, None, None] + d[None, None, :] \
                    + (h[None, :, None] + shift[:, None, None]) * (PAGE_SIZE * HEAD_DIM)
                remote_ok = route_ok[:, None, None] & head_ok[:, :, None] & col_ok
                _store_tile(kv_ptr, remote, k, remote_ok, ks, QUANT)
                _store_tile(kv_ptr, remote + dst_stride_page // 2, v, remote_ok, vs, QUANT)


def _launch_args(k: torch.Tensor, v: torch.Tensor, geo: checks.CacheLayout, scales: Scales,
                 push: bool, routes: int = 0,
                 dst_stride_page: int | None = None) -> tuple[tuple[int, int, int], tuple, int]:
    """The grid, the kernel's arguments after the 9 tensors and scales (sizes, strides,
    constexprs) in signature order, and the warps, for new K/V `k`, `v` `[T, H_kv, D]`; with
    ``routes``, up to that many head-routed receivers per token whose pages are
    ``dst_stride_page`` elements apart."""
    num_tokens = k.shape[0]
    tile_elements, num_warps = LAUNCH["push" if push else "append"]
    block_h = min(triton.next_power_of_2(geo.num_kv_heads), 8)
    block_d = triton.next_power_of_2(geo.head_dim)
    block_t = max(1, min(64, tile_elements // (block_h * block_d)))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(geo.num_kv_heads, block_h), 1)
    dst_stride_page = geo.stride_page if dst_stride_page is None else dst_stride_page
    tail = (num_tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1), geo.stride_page, dst_stride_page,
            geo.num_kv_heads, geo.head_dim, geo.page_size, block_t, block_h, block_d,
            push, routes, scales.is_fp8, scales.is_tensor)
    return grid, tail, num_warps


def _launch(k, v, kv_layer, slots, geo: checks.CacheLayout, scales: Scales, push_args) -> None:
    """Triton's usual launch (binds and specializes the arguments on every call)."""
    dst_slots, dst_index, dst_table = push_args if push_args is not None else (slots, slots, slots)
    grid, tail, num_warps = _launch_args(k, v, geo, scales, push_args is not None)
    dispatch.runnable(append_kv_kernel)[grid](
        k, v, kv_layer, slots, dst_slots, dst_index, dst_table, scales.k, scales.v, *tail,
        num_warps=num_warps,
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
    num_tokens = checks.check_new_kv(k, v, geo, kv_layer.device)
    checks.check_index("slots", slots, length=num_tokens, device=kv_layer.device)
    check_values = dispatch.should_check_values(kv_layer.device, check_indices)
    scales = resolve_scales(geo.dtype, kv_layer.device, k_scale, v_scale, check_values=check_values)
    if check_values:
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
    num_tokens = checks.check_new_kv(k, v, geo, device)
    checks.check_index("slots", slots, length=num_tokens, device=device)
    checks.check_index("dst_slots", dst_slots, length=num_tokens, device=device)
    checks.check_index("dst_index", dst_index, length=num_tokens, device=device)
    geos = checks.check_receivers("dst_layers", kv_layer, geo, dst_layers)
    if dst_table is not None:
        checks.check_tensor("dst_table", dst_table, dims="[num_receivers]",
                            shape=(max(len(geos), 1),), dtypes=(torch.int64,), device=device)
    check_values = dispatch.should_check_values(device, check_indices)
    scales = resolve_scales(geo.dtype, device, k_scale, v_scale, check_values=check_values)
    if check_values:
        checks.check_slot_values("slots", slots, geo.num_slots)
        checks.check_push_values(dst_slots, dst_index, geos)
    if num_tokens == 0:
        return
    if not dispatch.use_triton(kv_layer):
        reference.append_push_kv(k, v, kv_layer, slots, dst_layers, dst_slots, dst_index,
                                 *scales.host())
        return
    if dst_table is None:
        dst_table = build_dst_table(kv_layer, dst_layers)
    _launch(k, v, kv_layer, slots, geo, scales, (dst_slots, dst_index, dst_table))


_UNIT_SCALES = Scales(1.0, 1.0, is_fp8=False, is_tensor=False)
_ALIGN_BYTES = 16  # Triton specializes pointer arguments on 16-byte alignment


def prepare_append_push(
    kv: torch.Tensor,
    slots: torch.Tensor | np.ndarray,
    dst_kv: Sequence[torch.Tensor] = (),
    dst_slots: torch.Tensor | np.ndarray | None = None,
    dst_index: torch.Tensor | np.ndarray | None = None,
    *,
    heads: Sequence[tuple[int, int, int]] | None = None,
    check_indices: bool | None = None,
) -> PreparedAppend:
    """Check one forward's append (and push) once; return its per-layer launcher.

    Everything that is the same for every layer of a forward is checked and resolved here: the
    caches' geometry, the receivers, the index arrays and their values, the receiver offset
    table. The returned `PreparedAppend` is then called once per layer with that layer's K/V
    and writes what `append_push_kv` (or, without receivers, `append_kv`) would, with a few
    microseconds of host time.

    Args:
        kv: `[L, num_pages, 2, H_kv, P, D]` local cache, every layer (pages packed, layers at
            one stride, e.g. a contiguous heap allocation).
        slots: `[T]` int32/int64 local slot of each new token, -1 skips it.
        dst_kv: R receiver caches `[L, num_pages_r, 2, H_kv, P, D]` with kv's dtype, page layout
            and page stride (peer views of other GPUs, or CPU tensors mapping another process's
            memory); empty for a local append only.
        dst_slots: `[T]` int32/int64 receiver slot of each token, -1 = not sent (receivers only).
        dst_index: `[T]` int32/int64 index into dst_kv, -1 = not sent (receivers only); with
            ``heads``, `[routes, T]`: up to ``routes`` receivers of each token.
        heads: head routes (prefill and decode at different tensor parallelism,
            `disagg.transfer.heads`): per receiver ``(first, count, dst_first)``, heads
            ``[first, first + count)`` of each token sent to it land at its heads from
            ``dst_first``; the receivers' pages then hold another number of heads than kv's (one
            number for all of them), with kv's page size, head_dim and dtype. Each receiver's
            stores stay one run per page per K/V of its head range. None: every receiver takes
            every head, into pages shaped like kv's.
        check_indices: for index tensors: range-check their values (a host sync on CUDA); see
            `dispatch.should_check_values`. Numpy index arrays are checked on the host unless
            this is False (a caller that validated them already, as `KVPusher` does with
            `push_plan.check_plan`), then copied to kv's device in one transfer (pinned, on the
            current stream).

    Returns:
        The `PreparedAppend` of this forward.

    Raises:
        TypeError, ValueError: bad geometry, dtypes, devices or index values; nothing is written.
    """
    if not isinstance(kv, torch.Tensor) or kv.dim() != 6:
        got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv: expected shape [num_layers, num_pages, 2, num_kv_heads, page_size, "
                         f"head_dim], got {got}")
    geo = checks.check_kv_layer("kv", kv, lead_ok=True)
    geos = checks.check_receivers("dst_kv", kv, geo, dst_kv, local="kv", stacked=True, routed=heads is not None)
    routes = None if heads is None else _check_heads(heads, geo, geos)
    indices = _prepare_indices(kv, geo, dst_kv, geos, slots, dst_slots, dst_index, check_indices, routes=routes)
    return PreparedAppend(kv, geo, list(dst_kv), geos, indices, routes)


def _check_heads(heads: object, geo: checks.CacheLayout, geos: list[checks.CacheLayout]) -> tuple[tuple[int, int, int], ...]:
    """``heads`` as a tuple of ``(first, count, dst_first)`` ints, one per receiver, inside both sides' heads.

    Raises:
        TypeError, ValueError: not one triple of ints per receiver, or a head range outside kv's or
            its receiver's heads.
    """
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence) or len(heads) != len(geos):
        got = len(heads) if isinstance(heads, Sequence) else type(heads).__name__
        raise ValueError(f"heads: expected one (first, count, dst_first) per receiver ({len(geos)}), got {got}")
    checked = []
    for i, (triple, dst_geo) in enumerate(zip(heads, geos)):
        if not isinstance(triple, Sequence) or len(triple) != 3 or not all(isinstance(x, (int, np.integer)) for x in triple):
            raise TypeError(f"heads[{i}]: expected (first, count, dst_first) ints, got {triple!r}")
        first, count, dst_first = (int(x) for x in triple)
        if count < 1 or first < 0 or first + count > geo.num_kv_heads or dst_first < 0 \
                or dst_first + count > dst_geo.num_kv_heads:
            raise ValueError(f"heads[{i}]: expected {count} head(s) from {first} inside kv's {geo.num_kv_heads} "
                             f"and from {dst_first} inside the receiver's {dst_geo.num_kv_heads}, got {triple!r}")
        checked.append((first, count, dst_first))
    return tuple(checked)


def _prepare_indices(kv, geo, dst_kv, geos, slots, dst_slots, dst_index,
                     check_indices, with_table: bool = True, routes=None) -> list[torch.Tensor]:
    """Check the index arrays (shapes, dtypes, values) and build the receiver offset table;
    return `[slots]`, or with receivers `[slots, dst_slots, dst_index, table]` (no table unless
    `with_table`), on kv's device. With head ``routes``, dst_index is `[routes, T]` and the table
    carries each receiver's head range (`_offset_table`)."""
    if bool(geos) != (dst_slots is not None) or bool(geos) != (dst_index is not None):
        raise ValueError("dst_slots, dst_index: expected both with receivers (dst_kv) and neither "
                         f"without, got {len(geos)} receivers, dst_slots "
                         f"{'set' if dst_slots is not None else 'None'}, dst_index "
                         f"{'set' if dst_index is not None else 'None'}")
    names = ("slots", "dst_slots", "dst_index")[:3 if geos else 1]
    given = (slots, dst_slots, dst_index)[:len(names)]
    on_host = [isinstance(x, np.ndarray) for x in given]
    if any(on_host) and not all(on_host):
        raise TypeError(f"{', '.join(names)}: expected all numpy arrays or all tensors, got "
                        f"{', '.join(type(x).__name__ for x in given)}")
    host = all(on_host)
    where = torch.device("cpu") if host else kv.device
    tensors = [torch.from_numpy(x) if host else x for x in given]
    num_tokens = checks.check_index("slots", tensors[0], length=None, device=where).shape[0]
    if routes is not None and geos:
        tensors[2] = _flat_routes(tensors[2], num_tokens)
    for name, tensor in zip(names[1:], tensors[1:]):
        checks.check_index(name, tensor, length=tensor.shape[0] if name == "dst_index" and routes else num_tokens,
                           device=where)
    if check_indices is not False if host else dispatch.should_check_values(kv.device, check_indices):
        checks.check_slot_values("slots", tensors[0], geo.num_slots)
        if geos:
            repeat = tensors[2].shape[0] // max(num_tokens, 1) if routes else 1
            checks.check_push_values(tensors[1].repeat(repeat), tensors[2], geos)
    if geos and with_table:
        tensors.append(_offset_table(kv, geo, dst_kv, geos, routes))
    if not kv.is_cuda:
        return tensors
    if host:
        return _to_device(tensors, kv.device)
    return tensors[:3] + (_to_device(tensors[3:], kv.device) if len(tensors) > 3 else [])


def _flat_routes(dst_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A routed dst_index `[routes, T]` as the kernel reads it: `[routes * T]`, route-major."""
    if not isinstance(dst_index, torch.Tensor) or dst_index.dim() != 2 or dst_index.shape[1] != num_tokens \
            or dst_index.shape[0] < 1:
        got = tuple(dst_index.shape) if isinstance(dst_index, torch.Tensor) else type(dst_index).__name__
        raise ValueError(f"dst_index: expected [routes, {num_tokens}] with head routes (routes >= 1), got {got}")
    return dst_index.contiguous().reshape(-1)


# A routed receiver's row of the offset table: its element offset, then its head range
# (first head, head count, and the shift from kv's head index to the receiver's). The kernel
# steps through the table by this many int64s (the literal 4 in `append_kv_kernel`).
ROUTE_COLUMNS = 4


def _offset_table(kv: torch.Tensor, geo: checks.CacheLayout, dst_kv: Sequence[torch.Tensor],
                  geos: list[checks.CacheLayout], routes=None) -> torch.Tensor:
    """Element offsets of each receiver's layer l from local layer l (as `build_dst_table`); with
    head ``routes``, each receiver's `ROUTE_COLUMNS` (offset, first, count, dst_first - first).

    Returns:
        CPU int64 `[1, R']` when they are the same for every layer (receivers with kv's layer
        stride, as on a symmetric heap), else `[L, R']`; R' = R rounded up to even (16-byte rows)
        (with routes: `ROUTE_COLUMNS` * R).
    """
    elem = kv.element_size()
    columns = []
    for i, (dst, dst_geo) in enumerate(zip(dst_kv, geos)):
        distance, step = dst.data_ptr() - kv.data_ptr(), dst_geo.stride_lead - geo.stride_lead
        if distance % (elem * DST_ALIGN_ELEMENTS) or step % DST_ALIGN_ELEMENTS:
            raise ValueError(
                f"dst_kv[{i}]: expected every layer {DST_ALIGN_ELEMENTS * elem}-byte aligned "
                f"relative to kv's, got a distance of {distance} bytes and a layer stride of "
                f"{dst_geo.stride_lead} elements (kv: {geo.stride_lead})"
            )
        columns.append([distance // elem + layer * step for layer in range(geo.num_lead)])
    rows = [list(row) for row in zip(*columns)]
    if all(row == rows[0] for row in rows):
        rows = rows[:1]
    if routes is not None:
        rows = [[x for offset, (first, count, dst_first) in zip(row, routes)
                 for x in (offset, first, count, dst_first - first)] for row in rows]
        return torch.tensor(rows, dtype=torch.int64)
    pad = [0] * (len(columns) % 2)
    return torch.tensor([row + pad for row in rows], dtype=torch.int64)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU int tensors -> int64 views on `device` from one pinned, non-blocking copy; each view
    starts 16 bytes aligned."""
    starts = [0]
    for tensor in tensors:
        starts.append(starts[-1] + tensor.numel() + tensor.numel() % 2)
    host = torch.zeros(starts[-1], dtype=torch.int64, pin_memory=True)
    for tensor, start in zip(tensors, starts):
        host[start:start + tensor.numel()] = tensor.reshape(-1)
    packed = host.to(device, non_blocking=True)
    return [packed[start:start + t.numel()].view(t.shape) for t, start in zip(tensors, starts)]


def _aligned(tensor: torch.Tensor | float) -> bool:
    """Whether a tensor's data is 16-byte aligned (what Triton specializes pointers on)."""
    return isinstance(tensor, torch.Tensor) and tensor.data_ptr() % _ALIGN_BYTES == 0


def _variant_key(k: object, v: object) -> tuple | None:
    """What the checks read of k and v and what the compiled kernel is specialized on."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    try:
        return (k.shape, v.shape, k.dtype, v.dtype, k.device, v.device, k.stride(), v.stride(),
                k.data_ptr() % _ALIGN_BYTES == 0, v.data_ptr() % _ALIGN_BYTES == 0)
    except RuntimeError:  # a tensor without storage (meta): the full checks say what is wrong
        return None


# Compiled launchers by specialization, shared by every PreparedAppend of the process: a forward
# of a shape seen before finds its launcher here instead of asking Triton's JIT again
# (`JITFunction.warmup` binds and hashes the arguments: ~100 us of host time per forward).
_RUNNERS: dict[tuple, object] = {}


def _compiled(kernel, device: torch.device, grid: tuple, args: tuple, tail: tuple, num_warps: int):
    """`dispatch.compiled_launcher` for these arguments, cached on what Triton specializes on:
    tensor dtypes and 16-byte alignment, the scalar arguments and constexprs (`tail`), warps."""
    spec = tuple((a.dtype, _aligned(a)) if isinstance(a, torch.Tensor) else type(a) for a in args)
    key = (device.index, grid, tail, num_warps, spec)
    runner = _RUNNERS.get(key)
    if runner is None:
        with torch.cuda.device(device):
            runner = dispatch.compiled_launcher(kernel, grid, args + tail, {"num_warps": num_warps})
        if runner is not None:
            _RUNNERS[key] = runner
    return runner


class PreparedAppend:
    """One forward's `append_push_kv` (or `append_kv`), checked once; call it once per layer.

    Made by `prepare_append_push`. A call checks only what may change from layer to layer: the
    layer number, k/v's shape, dtype, device, strides and alignment, and the scales, by looking
    them up among the combinations already seen (a dict lookup). A new combination gets
    `append_push_kv`'s full checks and, on CUDA, its compiled kernel (`dispatch.compiled_launcher`);
    then every call with it launches that kernel directly. CPU caches run Triton's interpreter or
    the torch reference, as the one-shot launchers do. A refused call writes nothing. Calls make
    no allocation, host sync or stream switch, so they may be captured in a CUDA graph.

    Attributes:
        num_layers: L.
        num_tokens: T, new tokens per layer.
        num_receivers: R.
        device: the cache's device.
    """

    def __init__(self, kv: torch.Tensor, geo: checks.CacheLayout, dst_kv: list[torch.Tensor],
                 geos: list[checks.CacheLayout], indices: list[torch.Tensor],
                 routes: tuple[tuple[int, int, int], ...] | None = None) -> None:
        # What depends on the caches and receivers only (shared with `rebind`'s copies).
        self.num_layers, self.num_receivers = geo.num_lead, len(geos)
        self._routes = routes if geos else None
        self._dst_stride_page = geos[0].stride_page if geos else geo.stride_page
        self.device = kv.device
        self._kv, self._dst_kv, self._geo, self._geos = kv, dst_kv, geo, geos
        self._fp8 = geo.dtype == FP8_DTYPE
        self._layers = kv.unbind(0)
        self._reference = not dispatch.use_triton(kv)
        self._kernel = None if self._reference else dispatch.runnable(append_kv_kernel)
        self._compile = kv.is_cuda and not self._reference  # launch compiled kernels directly
        self._dst_layers = [list(views) for views in zip(*(d.unbind(0) for d in dst_kv))] \
            if self._reference and geos else None
        self._stream_of = dispatch.stream_handle_getter() if kv.is_cuda else None
        if geos:
            table = indices[3]
            self._tables = list(table.unbind(0)) if len(table) > 1 else [table[0]] * self.num_layers
            self._layer_keys = [(_aligned(layer), _aligned(t)) for layer, t in zip(self._layers, self._tables)]
        else:
            self._layer_keys = [(_aligned(layer),) for layer in self._layers]
        self._variants: dict[tuple, tuple] = {}
        self._bind(indices[:3])

    def _bind(self, indices: list[torch.Tensor]) -> None:
        """Take one forward's index tensors (`[slots]` or `[slots, dst_slots, dst_index]`)."""
        self.num_tokens = indices[0].shape[0]
        self._slots = indices[0]
        self._num_routes = 0
        if self.num_receivers:
            self._dst_slots, self._dst_index = indices[1:3]
            # Route slots per token (the kernel's ROUTES; 0: one receiver per token, no head routes).
            self._num_routes = self._dst_index.shape[0] // max(self.num_tokens, 1) if self._routes else 0
        else:  # unused by the kernel without receivers (PUSH=False)
            self._dst_slots = self._dst_index = self._slots
            self._tables = [self._slots] * self.num_layers
        # Triton specializes pointers on 16-byte alignment: part of every variant's key.
        self._index_key = tuple(_aligned(t) for t in indices)

    def rebind(self, slots: torch.Tensor | np.ndarray, dst_slots: torch.Tensor | np.ndarray | None = None,
               dst_index: torch.Tensor | np.ndarray | None = None, *,
               check_indices: bool | None = None) -> PreparedAppend:
        """This append for another forward: the same caches and receivers, new index arrays.

        The result shares everything that does not depend on the indices (checked geometry,
        layer views, the receiver offset table on the device, compiled launch variants), so a
        forward after the first costs only the index checks and one host-to-device copy.
        Arguments as in `prepare_append_push`; `self` stays valid and unchanged.

        Raises:
            TypeError, ValueError: as `prepare_append_push` for the index arrays.
        """
        indices = _prepare_indices(self._kv, self._geo, self._dst_kv, self._geos, slots, dst_slots,
                                   dst_index, check_indices, with_table=False, routes=self._routes)
        other = copy.copy(self)
        other._bind(indices)
        return other

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                 k_scale: float | torch.Tensor | None = None,
                 v_scale: float | torch.Tensor | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Write layer `layer`'s new K/V into kv and the receivers, as `append_push_kv` would.

        Args:
            layer: `0 <= layer < L`.
            k: `[T, H_kv, D]` float16/bfloat16/float32 (the cache's dtype unless it is fp8),
                head_dim contiguous, on the cache's device.
            v: `[T, H_kv, D]`, like k.
            k_scale, v_scale: fp8 caches only, as in `append_kv`.
            stream: CUDA stream to launch on (default: the current stream of the cache's
                device); no stream switch is made either way.

        Raises:
            TypeError, ValueError: a layer out of range, k/v of another shape, dtype or device
                than prepared, bad scales, a stream of another device; nothing is written.
        """
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            layer = self._check_layer(layer)
        if k_scale is None and v_scale is None and not self._fp8:
            scales, scale_key = _UNIT_SCALES, None
        else:
            scales = resolve_scales(self._geo.dtype, self.device, k_scale, v_scale)
            scale_key = (scales.is_tensor, _aligned(scales.k), _aligned(scales.v))
        if stream is not None:
            self._check_stream(stream)
        key = _variant_key(k, v)
        if key is not None:
            key += (self._layer_keys[layer], self._index_key, scale_key, self._num_routes)
        variant = self._variants.get(key)
        if variant is None:
            variant = self._new_variant(key, layer, k, v, scales)
        runner, grid, tail, num_warps = variant
        if runner is not None:
            runner(k, v, self._layers[layer], self._slots, self._dst_slots, self._dst_index,
                   self._tables[layer], scales.k, scales.v, *tail,
                   stream=self._stream_of(self.device.index) if stream is None else stream.cuda_stream)
        elif self.num_tokens:
            self._launch_slow(layer, k, v, scales, grid, tail, num_warps, stream)

    def _new_variant(self, key: tuple | None, layer: int, k: torch.Tensor, v: torch.Tensor,
                     scales: Scales) -> tuple:
        """Full checks of k/v, and the launch arguments (and compiled kernel) for their kind."""
        num_tokens = checks.check_new_kv(k, v, self._geo, self.device)
        if num_tokens != self.num_tokens:
            raise ValueError(f"k: expected {self.num_tokens} tokens (the length of the prepared "
                             f"slots), got {num_tokens}")
        grid, tail, num_warps = _launch_args(k, v, self._geo, scales, self.num_receivers > 0,
                                             self._num_routes, self._dst_stride_page)
        runner = None
        if self._compile and num_tokens:
            runner = _compiled(self._kernel, self.device, grid, self._args(layer, k, v, scales), tail,
                               num_warps)
        variant = (runner, grid, tail, num_warps)
        if key is not None:
            self._variants[key] = variant
        return variant

    def _args(self, layer: int, k: torch.Tensor, v: torch.Tensor, scales: Scales) -> tuple:
        return (k, v, self._layers[layer], self._slots, self._dst_slots, self._dst_index,
                self._tables[layer], scales.k, scales.v)

    def _launch_slow(self, layer, k, v, scales, grid, tail, num_warps, stream) -> None:
        """The torch reference, or Triton's usual launch (interpreter, or no compiled kernel)."""
        if self._reference:
            if self._dst_layers is not None and self._routes is not None:
                reference.append_push_heads(k, v, self._layers[layer], self._slots, self._dst_layers[layer],
                                            self._dst_slots, self._dst_index.view(-1, self.num_tokens),
                                            self._routes, *scales.host())
            elif self._dst_layers is not None:
                reference.append_push_kv(k, v, self._layers[layer], self._slots, self._dst_layers[layer],
                                         self._dst_slots, self._dst_index, *scales.host())
            else:
                reference.append_kv(k, v, self._layers[layer], self._slots, *scales.host())
            return
        if stream is None:
            self._kernel[grid](*self._args(layer, k, v, scales), *tail, num_warps=num_warps)
            return
        with torch.cuda.stream(stream):
            self._kernel[grid](*self._args(layer, k, v, scales), *tail, num_warps=num_warps)

    def _check_layer(self, layer: object) -> int:
        try:
            index = operator.index(layer)
        except TypeError:
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}") from None
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {index}")
        return index

    def _check_stream(self, stream: object) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"stream: expected None for a {self.device.type} cache, got {stream!r}")
        index = getattr(stream, "device_index", None)
        if index != self.device.index or not hasattr(stream, "cuda_stream"):
            raise ValueError(f"stream: expected a torch.cuda.Stream of {self.device}, got {stream!r}")
