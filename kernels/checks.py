"""Input checks shared by the kernel launchers (after flashinfer's `check_shape_dtype_device`).

Each check raises before anything is launched, naming the argument and stating what was expected
and what was got (shape, dtype, device; never a tensor's repr). Shape, dtype, device and stride
checks read only metadata. Value checks (`check_*_values`) read index values and therefore sync a
CUDA device; launchers call them only when `dispatch.should_check_values` allows, and each does
one device-to-host copy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    tensor: object,
    *,
    dims: str,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check a tensor's shape (None matches any size), dtype and device.

    Args:
        name: the argument's name, used in the message.
        tensor: the value passed.
        dims: the expected shape in words, e.g. "[num_tokens, num_kv_heads, head_dim]".
        shape: expected sizes, None where any size is allowed.
        dtypes: allowed dtypes, or None for any.
        device: the device it must live on, or None for any.

    Returns:
        The tensor, for chaining.

    Raises:
        TypeError: not a tensor, or a dtype outside `dtypes`.
        ValueError: wrong number of dims, a size mismatch, or another device.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {dims}, got {type(tensor).__name__}")
    got = tuple(tensor.shape)
    if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{name}: expected shape {dims} = {want}, got {got}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_names(dtypes)}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {tensor.device}")
    return tensor


def check_index(name: str, tensor: object, *, length: int | None, device: torch.device) -> torch.Tensor:
    """Check a 1-D contiguous int32/int64 index tensor (page table, slots) on `device`."""
    dims = "[n]" if length is None else f"[{length}]"
    check_tensor(name, tensor, dims=dims, shape=(length,), dtypes=INDEX_DTYPES, device=device)
    if tensor.numel() > 1 and tensor.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous index tensor, got stride {tensor.stride()}")
    return tensor


def check_rows(name: str, tensor: torch.Tensor) -> None:
    """Check that the last dim of `tensor` is contiguous (kernels read head_dim rows as vectors)."""
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name}: expected stride 1 along head_dim, got strides {tensor.stride()}")


@dataclass(frozen=True)
class CacheLayout:
    """What a launcher needs to know about a `[num_pages, 2, H_kv, P, D]` cache (or a stack of them):
    its memory layout, strides included (the transfer layer's whole-tensor shape is a different
    concept: `disagg.transfer.segments.KVGeometry`).

    `stride_page` and `stride_lead` are in elements; inside a page the layout is packed
    (`[2, H_kv, P, D]` contiguous), which every kernel relies on.
    """

    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype
    stride_page: int
    num_lead: int = 1
    stride_lead: int = 0

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def same_layout(self, other: "CacheLayout") -> bool:
        """Same heads, page size, head_dim and dtype (num_pages and strides may differ)."""
        return (self.num_kv_heads, self.page_size, self.head_dim, self.dtype) == (
            other.num_kv_heads, other.page_size, other.head_dim, other.dtype
        )


def check_kv_layer(name: str, kv: object, *, lead_ok: bool = False) -> CacheLayout:
    """Check a paged cache view and return its geometry.

    Args:
        name: argument name for messages.
        kv: `[num_pages, 2, H_kv, P, D]`, or with `lead_ok` any `[..., num_pages, 2, H_kv, P, D]`
            whose leading dims collapse into one stride (e.g. a whole `[num_layers, ...]` cache).
        lead_ok: allow leading dims.

    Raises:
        TypeError: not a tensor, or a dtype outside float16/bfloat16/float32/float8_e4m3fn.
        ValueError: wrong rank, axis 1 not of size 2, or a page that is not packed.
    """
    dims = "[..., num_pages, 2, num_kv_heads, page_size, head_dim]" if lead_ok else (
        "[num_pages, 2, num_kv_heads, page_size, head_dim]")
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {dims}, got {type(kv).__name__}")
    if kv.dim() < 5 or (kv.dim() > 5 and not lead_ok):
        raise ValueError(f"{name}: expected shape {dims}, got {tuple(kv.shape)}")
    check_tensor(name, kv, dims=dims, shape=(None,) * (kv.dim() - 4) + (2, None, None, None),
                 dtypes=KV_DTYPES)
    _, num_kv_heads, page_size, head_dim = kv.shape[-4:]
    packed = (num_kv_heads * page_size * head_dim, page_size * head_dim, head_dim, 1)
    if tuple(kv.stride()[-4:]) != packed:
        raise ValueError(
            f"{name}: expected each page packed ([2, H_kv, P, D] contiguous, strides {packed}), "
            f"got strides {tuple(kv.stride()[-4:])}"
        )
    return kv_layout(kv, name)


def kv_layout(kv: torch.Tensor, name: str = "kv_layer") -> CacheLayout:
    """The geometry of a paged cache view, read without `check_kv_layer`'s checks (for a view of
    the same shape, dtype and strides as one already checked, e.g. the next layer of a forward)."""
    _, num_kv_heads, page_size, head_dim = kv.shape[-4:]
    num_lead, stride_lead = _collapse_lead(name, kv)
    return CacheLayout(kv.shape[-5], num_kv_heads, page_size, head_dim, kv.dtype,
                      kv.stride(-5), num_lead, stride_lead)


def _collapse_lead(name: str, kv: torch.Tensor) -> tuple[int, int]:
    """Count and stride of the dims before num_pages, which must collapse into one stride."""
    lead_shape, lead_strides = kv.shape[:-5], kv.stride()[:-5]
    if not lead_shape:
        return 1, 0
    num_lead = 1
    for size in lead_shape:
        num_lead *= size
    dims = [(n, s) for n, s in zip(lead_shape, lead_strides) if n != 1]
    stride = dims[-1][1] if dims else 0
    for (_, outer), (inner_n, inner) in zip(dims, dims[1:]):
        if outer != inner * inner_n:
            raise ValueError(
                f"{name}: expected leading dims {tuple(lead_shape)} to collapse into one stride, "
                f"got strides {tuple(lead_strides)}"
            )
    return num_lead, stride


def check_new_kv(k: object, v: object, geo: CacheLayout, device: torch.device) -> int:
    """Check new keys/values `[T, H_kv, D]` against a cache of geometry `geo`; return T.

    Raises:
        TypeError: not tensors, a dtype outside float16/bfloat16/float32, v's dtype not k's, or
            (caches other than fp8) not the cache's dtype.
        ValueError: a shape other than `[T, H_kv, D]` (v: k's T), another device, or head_dim
            not contiguous.
    """
    dims = "[num_tokens, num_kv_heads, head_dim]"
    shape = (None, geo.num_kv_heads, geo.head_dim)
    check_tensor("k", k, dims=dims, shape=shape, dtypes=ATTN_DTYPES, device=device)
    check_tensor("v", v, dims=dims, shape=(k.shape[0],) + shape[1:], dtypes=(k.dtype,), device=device)
    if geo.dtype != torch.float8_e4m3fn and k.dtype != geo.dtype:
        raise TypeError(f"k: expected the cache's dtype {geo.dtype}, got {k.dtype}")
    check_rows("k", k)
    check_rows("v", v)
    return k.shape[0]


def check_receivers(name: str, kv: torch.Tensor, geo: CacheLayout, dst: object, *,
                    local: str = "kv_layer", stacked: bool = False, routed: bool = False) -> list[CacheLayout]:
    """Check receiver caches against the local cache `kv` (geometry `geo`); return theirs.

    Args:
        name: the argument's name, e.g. "dst_layers".
        kv: the local cache, `[num_pages, 2, H_kv, P, D]` or, with `stacked`, `[L, ...]`.
        geo: `kv`'s geometry.
        dst: a sequence of R receiver caches shaped like `kv` (num_pages may differ).
        local: `kv`'s argument name, for messages.
        stacked: receivers are `[L, num_pages_r, 2, H_kv, P, D]` stacks with kv's L.
        routed: receivers of head routes: their pages may hold another number of heads than kv's
            (one number for all of them), with kv's page size, head_dim and dtype.

    Raises:
        TypeError: `dst` not a sequence of tensors, or a receiver of another dtype.
        ValueError: another page layout or page stride, another number of layers, or another
            device type.
    """
    if isinstance(dst, torch.Tensor) or not isinstance(dst, Sequence):
        raise TypeError(f"{name}: expected a sequence of tensors, got {type(dst).__name__}")
    geos = []
    for i, tensor in enumerate(dst):
        item = f"{name}[{i}]"
        if stacked and isinstance(tensor, torch.Tensor) and tensor.dim() != kv.dim():
            raise ValueError(f"{item}: expected shape [num_layers, num_pages, 2, num_kv_heads, "
                             f"page_size, head_dim], got {tuple(tensor.shape)}")
        dst_geo = check_kv_layer(item, tensor, lead_ok=stacked)
        if routed:
            heads = geos[0].num_kv_heads if geos else dst_geo.num_kv_heads
            like = replace(geo, num_kv_heads=heads, stride_page=2 * heads * geo.page_size * geo.head_dim)
        else:
            like = geo
        if not dst_geo.same_layout(like) or dst_geo.stride_page != like.stride_page:
            raise ValueError(
                f"{item}: expected {local}'s geometry (H_kv={like.num_kv_heads}, "
                f"P={like.page_size}, D={like.head_dim}, {like.dtype}, page stride {like.stride_page}), "
                f"got (H_kv={dst_geo.num_kv_heads}, P={dst_geo.page_size}, D={dst_geo.head_dim}, "
                f"{dst_geo.dtype}, page stride {dst_geo.stride_page})"
            )
        if stacked and dst_geo.num_lead != geo.num_lead:
            raise ValueError(f"{item}: expected {geo.num_lead} layers (as {local}), "
                             f"got {dst_geo.num_lead}")
        if tensor.device.type != kv.device.type:
            raise ValueError(f"{item}: expected a {kv.device.type} tensor, got {tensor.device}")
        geos.append(dst_geo)
    return geos


def check_push_values(dst_slots: torch.Tensor, dst_index: torch.Tensor,
                      geos: Sequence[CacheLayout]) -> None:
    """Check dst_index in [-1, R) and each pushed token's dst slot in [-1, its receiver's num_slots).

    Reads values (a host sync on CUDA, like `check_slot_values`).

    Raises:
        ValueError: naming dst_index or dst_slots, with the first offending position.
    """
    if dst_index.numel() == 0:
        return
    check_slot_values("dst_index", dst_index, len(geos))
    limits = torch.tensor([g.num_slots for g in geos] or [0], dtype=torch.int64,
                          device=dst_index.device)
    receiver = dst_index.clamp(min=0).to(torch.int64)
    bad = (dst_slots < -1) | ((dst_index >= 0) & (dst_slots >= limits[receiver]))
    any_bad, t = _to_host([bad.any(), bad.to(torch.int8).argmax()])
    if any_bad:
        r = int(dst_index[t])
        raise ValueError(
            f"dst_slots: expected -1 or a slot of receiver {r} in "
            f"[0, {geos[r].num_slots if r >= 0 else 0}), got {int(dst_slots[t])} at position {t}"
        )


def check_attention_q(q: object, geo: CacheLayout, device: torch.device, dims: str) -> None:
    """Check an attention query `[rows, num_qo_heads, head_dim]` against the cache it reads.

    Raises:
        ValueError/TypeError: naming q, when its head_dim, heads (a multiple of the cache's KV
            heads), dtype (the cache's, or any attention dtype over an fp8 cache), device or
            row layout do not fit.
    """
    check_tensor("q", q, dims=dims, shape=(None, None, geo.head_dim), dtypes=ATTN_DTYPES, device=device)
    check_rows("q", q)
    if q.shape[1] % geo.num_kv_heads:
        raise ValueError(f"q: expected num_qo_heads divisible by num_kv_heads={geo.num_kv_heads}, "
                         f"got {q.shape[1]}")
    if geo.dtype != torch.float8_e4m3fn and q.dtype != geo.dtype:
        raise TypeError(f"q: expected the cache's dtype {geo.dtype}, got {q.dtype}")


def check_page_table(page_indptr: object, page_indices: object, last_page_len: object,
                     batch_size: int, device: torch.device) -> None:
    """Check the CSR page table's shapes, dtypes and device (values: `check_page_table_values`)."""
    check_index("page_indptr", page_indptr, length=batch_size + 1, device=device)
    check_index("page_indices", page_indices, length=None, device=device)
    check_index("last_page_len", last_page_len, length=batch_size, device=device)


def check_out(out: object | None, q: torch.Tensor) -> None:
    """Check an optional output buffer: q's shape, dtype and device, rows laid out like q's."""
    if out is None:
        return
    check_tensor("out", out, dims="like q", shape=tuple(q.shape), dtypes=(q.dtype,), device=q.device)
    check_rows("out", out)


def check_same_device(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> torch.device:
    """Check that all tensors live on the first one's device; return it."""
    device = tensors[0].device
    for name, tensor in zip(names[1:], tensors[1:]):
        if tensor.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (like {names[0]}), got {tensor.device}")
    return device


def _to_host(values: list[torch.Tensor]) -> list[int]:
    """One device-to-host copy of several int64 scalars."""
    return [int(v) for v in torch.stack([v.to(torch.int64) for v in values]).tolist()]


def check_slot_values(name: str, slots: torch.Tensor, num_slots: int) -> None:
    """Check every slot is -1 (skip) or in [0, num_slots).

    Raises:
        ValueError: a slot out of range; the message gives the first offending position.
    """
    if slots.numel() == 0:
        return
    bad = (slots < -1) | (slots >= num_slots)
    any_bad, first = _to_host([bad.any(), bad.to(torch.int8).argmax()])
    if any_bad:
        value = int(slots[first])
        raise ValueError(
            f"{name}: expected slots in [-1, {num_slots}) (-1 skips), got {value} at position {first}"
        )


def check_disjoint_copy(src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Check a copy within one cache can run as one parallel batch (one device-to-host copy).

    Pairs where either slot is -1 are ignored. Destinations must be distinct, and no destination
    may also be a source: the pairs run in parallel, so such a batch would race (an ordered chain
    of copies must be resolved to its original sources first, as `disagg.copies` does).

    Raises:
        ValueError: names the first repeated destination or destination that is also a source.
    """
    keep = (src_slots >= 0) & (dst_slots >= 0)
    src = src_slots[keep].to(torch.int64).cpu().numpy()
    dst = dst_slots[keep].to(torch.int64).cpu().numpy()
    check_disjoint_copy_host(src, dst, "copy_slots")


def check_disjoint_copy_host(src: np.ndarray, dst: np.ndarray, where: str) -> None:
    """`check_disjoint_copy` on host int arrays (numpy); ``where`` prefixes the message."""
    src, dst = np.asarray(src), np.asarray(dst)
    values, counts = np.unique(dst, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"{where}: expected distinct destination slots, got slot {int(values[counts > 1][0])} "
            f"{int(counts.max())} times"
        )
    both = np.intersect1d(src, dst)
    if both.size:
        first = int(np.flatnonzero(np.isin(dst, both))[0])
        raise ValueError(
            f"{where}: expected no destination slot to be a source in the same cache (pairs run in "
            f"parallel; resolve ordered chains to their original sources), got slot {int(dst[first])} "
            f"at pair {first} written and read"
        )


def check_page_table_values(
    page_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    *,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """Check a CSR page table against a cache of `num_pages` pages of `page_size` slots.

    Returns:
        kv_lens: `[B]` int64, tokens of each sequence (0 for a sequence with no page).

    Raises:
        ValueError: indptr not starting at 0, decreasing, or past `len(page_indices)`; a page id
            outside [0, num_pages); a last_page_len outside [1, page_size] for a sequence that
            has pages.
    """
    num_pages_per_seq = (page_indptr[1:] - page_indptr[:-1]).to(torch.int64)
    kv_lens = torch.where(
        num_pages_per_seq > 0,
        (num_pages_per_seq - 1) * page_size + last_page_len.to(torch.int64),
        torch.zeros_like(num_pages_per_seq),
    )
    has = num_pages_per_seq > 0
    zero = torch.zeros((), dtype=torch.int64, device=page_indptr.device)
    bad_len = has & ((last_page_len < 1) | (last_page_len > page_size))
    stats = [
        page_indptr[0], page_indptr[-1], (num_pages_per_seq < 0).any(),
        page_indices.min() if page_indices.numel() else zero,
        page_indices.max() if page_indices.numel() else zero,
        bad_len.any(), bad_len.to(torch.int8).argmax() if bad_len.numel() else zero,
    ]
    first, last, decreasing, lo, hi, any_bad_len, bad_seq = _to_host(stats)
    if first != 0 or decreasing or last > page_indices.numel():
        raise ValueError(
            f"page_indptr: expected non-decreasing offsets from 0 to at most "
            f"len(page_indices)={page_indices.numel()}, got first={first}, last={last}, "
            f"decreasing={bool(decreasing)}"
        )
    if lo < 0 or hi >= num_pages:
        raise ValueError(
            f"page_indices: expected page ids in [0, {num_pages}), got min {lo}, max {hi}"
        )
    if any_bad_len:
        raise ValueError(
            f"last_page_len: expected values in [1, {page_size}] for sequences with pages, got "
            f"{int(last_page_len[bad_seq])} for sequence {bad_seq}"
        )
    return kv_lens


def check_qo_indptr_values(qo_indptr: torch.Tensor, num_tokens: int, kv_lens: torch.Tensor) -> None:
    """Check ragged query offsets: 0 .. num_tokens, non-decreasing, each q_len <= its kv_len.

    Raises:
        ValueError: naming qo_indptr, with the first offending sequence.
    """
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    over = q_lens > kv_lens
    zero = torch.zeros((), dtype=torch.int64, device=qo_indptr.device)
    first, last, decreasing, any_over, seq = _to_host([
        qo_indptr[0], qo_indptr[-1], (q_lens < 0).any(), over.any(),
        over.to(torch.int8).argmax() if over.numel() else zero,
    ])
    if first != 0 or last != num_tokens or decreasing:
        raise ValueError(
            f"qo_indptr: expected non-decreasing offsets from 0 to num_tokens={num_tokens}, got "
            f"first={first}, last={last}, decreasing={bool(decreasing)}"
        )
    if any_over:
        raise ValueError(
            f"qo_indptr: sequence {seq} has {int(q_lens[seq])} queries but only "
            f"{int(kv_lens[seq])} tokens in its pages; append the new tokens' KV before prefill"
        )
