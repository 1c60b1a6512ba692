"""Coalesce (local slot -> remote slot) lists into contiguous byte runs of the KV tensor.

Used by the KV pusher for peers that are not load/store reachable (another node, or forced): one
host-initiated put per run, never one per page or per token. Pure numpy; no device work.

Layout (docs/ARCHITECTURE.md §2): ``kv [num_layers, num_pages, 2, H, P, D]``, contiguous.
Within one layer a page is ``2*H*P*D`` contiguous elements, so

    whole pages, consecutive on both sides  -> ONE run (k pages * page bytes)
    part of one page (o .. o+n tokens)      -> 2*H runs of n*D elements (one per K/V and head)

A run never crosses a layer: layer ``l``'s runs are layer 0's shifted by ``l`` layer strides.
`coalesce_heads` is the same for a head range into a receiver whose pages hold another number of
heads (prefill and decode at different tensor parallelism): two runs per whole page (K, V).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVGeometry:
    """Shape of a KV tensor ``[num_layers, num_pages, 2, num_kv_heads, page_size, head_dim]``."""

    num_layers: int
    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    itemsize: int

    @classmethod
    def of(cls, shape: tuple[int, ...], itemsize: int) -> KVGeometry:
        if len(shape) != 6 or shape[2] != 2:
            raise ValueError(f"KV tensor must be [num_layers, num_pages, 2, H, P, D], got shape {tuple(shape)}")
        layers, pages, _, heads, page_size, head_dim = (int(s) for s in shape)
        return cls(layers, pages, heads, page_size, head_dim, itemsize)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def page_elems(self) -> int:
        return 2 * self.num_kv_heads * self.page_size * self.head_dim

    @property
    def layer_bytes(self) -> int:
        return self.num_pages * self.page_elems * self.itemsize


@dataclass(frozen=True)
class LayerSegments:
    """Byte runs of one layer (layer 0); `for_layer` shifts them to any layer.

    The two sides' layers may be of different sizes: a receiver whose pages hold another number of
    heads (prefill and decode at different tensor parallelism, `coalesce_heads`) has layers
    ``dst_layer_bytes`` apart where the sender's are ``src_layer_bytes`` apart; `for_layer` shifts
    each side by its own. Same-shaped sides (`coalesce`) have one layer size.

    Attributes:
        runs: int64 ``[num_runs, 3]`` rows ``(src_byte, dst_byte, num_bytes)`` from the KV
            tensor's first byte (for head routes: the start of the symmetric allocation both
            sides' pages begin at), for layer 0.
        src_layer_bytes, dst_layer_bytes: bytes of one layer of each side (the shift between layers).
    """

    runs: np.ndarray
    src_layer_bytes: int
    dst_layer_bytes: int

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def num_bytes(self) -> int:
        return int(self.runs[:, 2].sum()) if len(self.runs) else 0

    def for_layer(self, layer: int) -> np.ndarray:
        """int64 ``[num_runs, 3]`` for ``layer``."""
        shifted = self.runs.copy()
        shifted[:, 0] += layer * self.src_layer_bytes
        shifted[:, 1] += layer * self.dst_layer_bytes
        return shifted

    def for_layers(self, num_layers: int) -> np.ndarray:
        """int64 ``[num_layers * num_runs, 3]``: every layer's runs, layer-major."""
        if not len(self.runs):
            return self.runs.copy()
        return np.concatenate([self.for_layer(layer) for layer in range(num_layers)])


def slot_runs(src_slots: np.ndarray, dst_slots: np.ndarray,
              page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split slot pairs into maximal runs that are consecutive on both sides within one page.

    Args:
        src_slots: int ``[n]`` local slots (no -1).
        dst_slots: int ``[n]`` remote slots, pair ``i`` is ``src_slots[i] -> dst_slots[i]``.
        page_size: tokens per page.

    Returns:
        ``(src_start, dst_start, length)``, int64 ``[num_runs]`` each, ordered by source slot.
    """
    order = np.argsort(src_slots, kind="stable")
    src = np.asarray(src_slots, dtype=np.int64)[order]
    dst = np.asarray(dst_slots, dtype=np.int64)[order]
    if not len(src):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = ((src[1:] != src[:-1] + 1) | (dst[1:] != dst[:-1] + 1)
              | (src[1:] % page_size == 0) | (dst[1:] % page_size == 0))
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return src[starts], dst[starts], lengths


def _checked_slots(src_slots: np.ndarray, dst_slots: np.ndarray, g: KVGeometry,
                   dst_num_slots: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Both slot lists as int64, checked: 1-D, one length, every slot inside ``g``'s pages (the
    receiver's inside ``dst_num_slots`` where its pages differ)."""
    src_slots = np.asarray(src_slots, dtype=np.int64)
    dst_slots = np.asarray(dst_slots, dtype=np.int64)
    if src_slots.shape != dst_slots.shape or src_slots.ndim != 1:
        raise ValueError(f"src_slots and dst_slots must be 1-D of one length, got {src_slots.shape} and "
                         f"{dst_slots.shape}")
    limits = (g.num_slots, g.num_slots if dst_num_slots is None else dst_num_slots)
    for name, slots, limit in (("src_slots", src_slots, limits[0]), ("dst_slots", dst_slots, limits[1])):
        if len(slots) and (slots.min() < 0 or slots.max() >= limit):
            raise ValueError(f"{name} must be in [0, {limit}), got range [{slots.min()}, {slots.max()}]")
    return src_slots, dst_slots


def coalesce(src_slots: np.ndarray, dst_slots: np.ndarray, geometry: KVGeometry) -> LayerSegments:
    """Byte runs that move K/V of ``src_slots`` into ``dst_slots`` of the same-shaped tensor.

    Args:
        src_slots: int ``[n]`` local slots, each in ``[0, num_pages * page_size)``.
        dst_slots: int ``[n]`` remote slots, same range.
        geometry: the KV tensor's shape (identical on both sides).

    Returns:
        The runs for layer 0 (`LayerSegments.for_layer` gives any other layer).

    Raises:
        ValueError: lengths differ or a slot is out of range.
    """
    g = geometry
    src_slots, dst_slots = _checked_slots(src_slots, dst_slots, g)
    src0, dst0, length = slot_runs(src_slots, dst_slots, g.page_size)
    full = length == g.page_size
    runs = [_full_page_runs(src0[full] // g.page_size, dst0[full] // g.page_size, g),
            _partial_page_runs(src0[~full], dst0[~full], length[~full], g)]
    merged = np.concatenate(runs) * np.array([g.itemsize, g.itemsize, g.itemsize], dtype=np.int64)
    return LayerSegments(runs=merged.reshape(-1, 3), src_layer_bytes=g.layer_bytes, dst_layer_bytes=g.layer_bytes)


def _full_page_runs(src_pages: np.ndarray, dst_pages: np.ndarray, g: KVGeometry) -> np.ndarray:
    """Merge whole pages that are consecutive on both sides: rows in elements."""
    if not len(src_pages):
        return np.zeros((0, 3), dtype=np.int64)
    breaks = (src_pages[1:] != src_pages[:-1] + 1) | (dst_pages[1:] != dst_pages[:-1] + 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    counts = np.diff(np.concatenate((starts, [len(src_pages)])))
    return np.stack([src_pages[starts] * g.page_elems, dst_pages[starts] * g.page_elems,
                     counts * g.page_elems], axis=1)


def _partial_page_runs(src0: np.ndarray, dst0: np.ndarray, length: np.ndarray,
                       g: KVGeometry) -> np.ndarray:
    """One row per (run, K/V, head): ``length * head_dim`` elements each."""
    if not len(src0):
        return np.zeros((0, 3), dtype=np.int64)
    head_elems = g.page_size * g.head_dim
    # [2*H] offsets of each (K/V, head) row block inside a page
    block = np.arange(2 * g.num_kv_heads, dtype=np.int64) * head_elems

    def start(slots: np.ndarray) -> np.ndarray:
        base = (slots // g.page_size) * g.page_elems + (slots % g.page_size) * g.head_dim
        return (base[:, None] + block[None, :]).reshape(-1)

    size = np.repeat(length * g.head_dim, 2 * g.num_kv_heads)
    return np.stack([start(src0), start(dst0), size], axis=1)


def coalesce_heads(src_slots: np.ndarray, dst_slots: np.ndarray, src: KVGeometry, dst_num_kv_heads: int,
                   src_head: int, dst_head: int, num_heads: int, dst_num_pages: int | None = None) -> LayerSegments:
    """Byte runs that move heads ``[src_head, src_head + num_heads)`` of ``src_slots`` into heads
    ``[dst_head, ..)`` of ``dst_slots`` of a receiver whose pages hold ``dst_num_kv_heads`` heads.

    A whole page is two runs (its head range of K, and of V: contiguous in the head-major page);
    part of a page (o .. o+n tokens) is one run of ``n * head_dim`` elements per K/V and head.

    Args:
        src_slots, dst_slots: int ``[n]`` slots, pair i is ``src_slots[i] -> dst_slots[i]``; the
            two sides have one page size.
        src: the sender's KV geometry.
        dst_num_kv_heads: the receiver's local KV heads.
        src_head, dst_head, num_heads: the head range on each side (`disagg.transfer.heads.PushRoute`).
        dst_num_pages: the receiver's pages (its layers are that many of its pages apart); None:
            the sender's.

    Raises:
        ValueError: lengths differ, a slot or a head range is out of range.
    """
    g = src
    dst_num_pages = g.num_pages if dst_num_pages is None else dst_num_pages
    src_slots, dst_slots = _checked_slots(src_slots, dst_slots, g, dst_num_pages * g.page_size)
    if num_heads < 1 or src_head < 0 or src_head + num_heads > g.num_kv_heads or dst_head < 0 \
            or dst_head + num_heads > dst_num_kv_heads:
        raise ValueError(f"heads: expected {num_heads} head(s) from {src_head} inside the sender's {g.num_kv_heads} "
                         f"and from {dst_head} inside the receiver's {dst_num_kv_heads}")
    head_elems = g.page_size * g.head_dim
    src_page, dst_page = 2 * g.num_kv_heads * head_elems, 2 * dst_num_kv_heads * head_elems
    src0, dst0, length = slot_runs(src_slots, dst_slots, g.page_size)
    full = length == g.page_size
    # Whole pages: [K heads, V heads] of each, one run each.
    kv_src = np.array([src_head, g.num_kv_heads + src_head], dtype=np.int64) * head_elems
    kv_dst = np.array([dst_head, dst_num_kv_heads + dst_head], dtype=np.int64) * head_elems
    pages_src, pages_dst = src0[full] // g.page_size, dst0[full] // g.page_size
    whole = np.stack([(pages_src[:, None] * src_page + kv_src[None, :]).reshape(-1),
                      (pages_dst[:, None] * dst_page + kv_dst[None, :]).reshape(-1),
                      np.full(2 * len(pages_src), num_heads * head_elems, dtype=np.int64)], axis=1)
    # Parts of pages: one row per (run, K/V, head).
    rows_src = np.concatenate([np.arange(num_heads) + src_head, np.arange(num_heads) + g.num_kv_heads + src_head])
    rows_dst = np.concatenate([np.arange(num_heads) + dst_head, np.arange(num_heads) + dst_num_kv_heads + dst_head])
    s0, d0, n = src0[~full], dst0[~full], length[~full]

    def start(slots: np.ndarray, page: int, rows: np.ndarray) -> np.ndarray:
        base = (slots // g.page_size) * page + (slots % g.page_size) * g.head_dim
        return (base[:, None] + rows[None, :].astype(np.int64) * head_elems).reshape(-1)

    part = np.stack([start(s0, src_page, rows_src), start(d0, dst_page, rows_dst),
                     np.repeat(n * g.head_dim, 2 * num_heads)], axis=1)
    runs = np.concatenate([whole.reshape(-1, 3), part.reshape(-1, 3)]) * g.itemsize
    return LayerSegments(runs=runs.astype(np.int64), src_layer_bytes=g.num_pages * src_page * g.itemsize,
                         dst_layer_bytes=dst_num_pages * dst_page * g.itemsize)
