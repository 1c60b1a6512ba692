"""Copy slots between paged caches: fork copies, page-to-page transfers, all layers in one launch.

Called by the KV storage (copies that forks leave pending, within one cache) and by the KV pusher
(`disagg.transfer`), whose destination may be another GPU's cache seen through a peer view: the
kernel's stores then cross NVLink, so each program moves whole rows of head_dim elements for a
block of consecutive slot pairs (a run inside a page is one contiguous stretch per (K|V, head)),
with 16-byte vector loads and stores. Runs on the caller's current stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels import checks, dispatch, reference

# Elements one program moves per loop step; a power of two.
TILE_ELEMENTS = 2048
BLOCK_SLOTS = 16
NUM_WARPS = 8


@triton.jit(do_not_specialize=["num_pairs"])
def copy_slots_kernel(
    src_ptr, dst_ptr, src_slots_ptr, dst_slots_ptr, num_pairs,
    src_stride_lead, src_stride_page, dst_stride_lead, dst_stride_page,
    NUM_ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Program (i, l) copies slot pairs [i*BLOCK_S, (i+1)*BLOCK_S) of leading index l (a layer).
    # A slot holds NUM_ROWS = 2*H_kv rows of HEAD_DIM elements, PAGE_SIZE*HEAD_DIM apart; the
    # loop walks them BLOCK_R at a time. Masks: the pair tail, skipped pairs (either slot -1),
    # and row/head_dim padding to powers of two.
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    lead = tl.program_id(1).to(tl.int64)
    pair_ok = s < num_pairs
    src_slot = tl.load(src_slots_ptr + s, mask=pair_ok, other=-1).to(tl.int64)
    dst_slot = tl.load(dst_slots_ptr + s, mask=pair_ok, other=-1).to(tl.int64)
    pair_ok = pair_ok & (src_slot >= 0) & (dst_slot >= 0)
    src_base = lead * src_stride_lead + (src_slot // PAGE_SIZE) * src_stride_page
    src_base += (src_slot % PAGE_SIZE) * HEAD_DIM
    dst_base = lead * dst_stride_lead + (dst_slot // PAGE_SIZE) * dst_stride_page
    dst_base += (dst_slot % PAGE_SIZE) * HEAD_DIM
    d = tl.arange(0, BLOCK_D)
    for r0 in tl.static_range(0, NUM_ROWS, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        inner = r[None, :, None] * (PAGE_SIZE * HEAD_DIM) + d[None, None, :]
        mask = pair_ok[:, None, None] & (r[None, :, None] < NUM_ROWS) & (d[None, None, :] < HEAD_DIM)
        x = tl.load(src_ptr + src_base[:, None, None] + inner, mask=mask)
        tl.store(dst_ptr + dst_base[:, None, None] + inner, x, mask=mask)


def copy_slots(
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    check_indices: bool | None = None,
) -> None:
    """dst[..., dst_slots[i]] = src[..., src_slots[i]] for every pair, over all leading dims.

    Pairs where either slot is -1 are skipped. Destination slots must be distinct, and when src
    and dst are the same cache no destination slot may also be a source (pairs run in parallel:
    an ordered chain of copies must be resolved to its original sources first). Both are
    checked, with the slot ranges, whenever values are checked (below).

    Args:
        src: `[..., num_pages, 2, H_kv, P, D]` (e.g. one layer, or `[num_layers, ...]` to copy
            every layer in one launch); pages packed, leading dims collapsible to one stride.
        src_slots: `[M]` int32/int64 on src's device.
        dst: same leading shape, H_kv, P, D and dtype as src; its num_pages may differ. May be a
            peer view into another GPU's memory (same device type as src).
        dst_slots: `[M]` int32/int64 on src's device.
        check_indices: range-check slot values (a host sync on CUDA); see
            `disagg.kernels.dispatch.should_check_values`.

    Raises:
        TypeError, ValueError: mismatched geometry, dtypes, devices, out-of-range slots, a
            repeated destination, or (same cache) a destination that is also a source.
    """
    src_geo = checks.check_kv_layer("src", src, lead_ok=True)
    dst_geo = checks.check_kv_layer("dst", dst, lead_ok=True)
    if not dst_geo.same_layout(src_geo) or src.shape[:-5] != dst.shape[:-5]:
        raise ValueError(
            f"dst: expected src's shape except num_pages ({tuple(src.shape)} with any num_pages) "
            f"and dtype {src.dtype}, got {tuple(dst.shape)} {dst.dtype}"
        )
    if dst.device.type != src.device.type:
        raise ValueError(f"dst: expected a {src.device.type} tensor like src, got {dst.device}")
    num_pairs = checks.check_index("src_slots", src_slots, length=None, device=src.device).numel()
    checks.check_index("dst_slots", dst_slots, length=num_pairs, device=src.device)
    if dispatch.should_check_values(src.device, check_indices):
        checks.check_slot_values("src_slots", src_slots, src_geo.num_slots)
        checks.check_slot_values("dst_slots", dst_slots, dst_geo.num_slots)
        if _same_memory(src, dst):
            checks.check_disjoint_copy(src_slots, dst_slots)
    if num_pairs == 0 or src_geo.num_lead == 0:
        return
    if not dispatch.use_triton(src):
        reference.copy_slots(src, src_slots, dst, dst_slots)
        return
    num_rows = 2 * src_geo.num_kv_heads
    block_d = triton.next_power_of_2(src_geo.head_dim)
    block_r = max(1, min(triton.next_power_of_2(num_rows), TILE_ELEMENTS // (BLOCK_SLOTS * block_d)))
    grid = (triton.cdiv(num_pairs, BLOCK_SLOTS), src_geo.num_lead)
    dispatch.runnable(copy_slots_kernel)[grid](
        src, dst, src_slots, dst_slots, num_pairs,
        src_geo.stride_lead, src_geo.stride_page, dst_geo.stride_lead, dst_geo.stride_page,
        NUM_ROWS=num_rows, PAGE_SIZE=src_geo.page_size, HEAD_DIM=src_geo.head_dim,
        BLOCK_S=BLOCK_SLOTS, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=NUM_WARPS,
    )


def _same_memory(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether src and dst are the same cache (same first element and strides: a slot id names
    the same memory on both sides)."""
    return src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride()
