"""Pure-torch references of every kernel in `disagg.kernels`.

They define what the Triton kernels compute: the launchers run them for CPU tensors (unless
`TRITON_INTERPRET=1`) and the tests compare the kernels against them. Plain loops over sequences,
float32 math, no performance intent. They take already-validated arguments (the launchers check)
and float scales. Slot -1 means "skip this token"; a slot is `page_id * page_size + offset`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from disagg.kernels.fp8 import FP8_DTYPE, quantize


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return quantize(x, scale) if dtype == FP8_DTYPE else x.to(dtype)


def _from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    y = x.to(torch.float32)
    return y * scale if x.dtype == FP8_DTYPE else y


def _write_slots(kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_scale: float, v_scale: float) -> None:
    """kv_layer[page, 0|1, :, offset, :] = k|v for every token whose slot is not -1."""
    page_size = kv_layer.shape[-2]
    keep = slots >= 0
    slots = slots[keep].to(torch.int64)
    pages, offsets = slots // page_size, slots % page_size
    kv_layer[pages, 0, :, offsets] = _to_cache(k[keep], kv_layer.dtype, k_scale)
    kv_layer[pages, 1, :, offsets] = _to_cache(v[keep], kv_layer.dtype, v_scale)


def append_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor,
              k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write `k`, `v` `[T, H_kv, D]` into `kv_layer` `[N, 2, H_kv, P, D]` at `slots` `[T]`."""
    _write_slots(kv_layer, slots, k, v, k_scale, v_scale)


def append_push_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor,
                   dst_layers: Sequence[torch.Tensor], dst_slots: torch.Tensor,
                   dst_index: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`append_kv` locally, and token t also into `dst_layers[dst_index[t]]` at `dst_slots[t]`."""
    _write_slots(kv_layer, slots, k, v, k_scale, v_scale)
    for receiver, dst in enumerate(dst_layers):
        mine = dst_index == receiver
        _write_slots(dst, torch.where(mine, dst_slots, -1), k, v, k_scale, v_scale)


def append_push_heads(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor,
                      dst_layers: Sequence[torch.Tensor], dst_slots: torch.Tensor, dst_index: torch.Tensor,
                      heads: Sequence[tuple[int, int, int]], k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`append_kv` locally, and for each route row r of `dst_index` `[routes, T]`, token t's heads
    `[first, first + count)` into `dst_layers[dst_index[r, t]]` at `dst_slots[t]`, heads from
    `dst_first` (`heads[receiver] = (first, count, dst_first)`)."""
    _write_slots(kv_layer, slots, k, v, k_scale, v_scale)
    for row in dst_index:
        for receiver, (dst, (first, count, dst_first)) in enumerate(zip(dst_layers, heads)):
            mine = row == receiver
            _write_slots(dst[:, :, dst_first:dst_first + count], torch.where(mine, dst_slots, -1),
                         k[:, first:first + count], v[:, first:first + count], k_scale, v_scale)


def copy_slots(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """dst[..., slot d] = src[..., slot s] for every pair where neither slot is -1, all leading dims."""
    page_size = src.shape[-2]
    keep = (src_slots >= 0) & (dst_slots >= 0)
    s, d = src_slots[keep].to(torch.int64), dst_slots[keep].to(torch.int64)
    dst[..., d // page_size, :, :, d % page_size, :] = src[..., s // page_size, :, :, s % page_size, :]


def gather_kv(kv_layer: torch.Tensor, pages: torch.Tensor, kv_len: int, k_scale: float,
              v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V as float32 `[H_kv, kv_len, D]`, dequantized."""
    num_kv_heads, page_size, head_dim = kv_layer.shape[-3:]
    blocks = kv_layer[pages.to(torch.int64)]  # [n, 2, H, P, D]
    k = blocks[:, 0].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
    v = blocks[:, 1].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
    return _from_cache(k, k_scale), _from_cache(v, v_scale)


def _kv_lens(page_indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
    num_pages = (page_indptr[1:] - page_indptr[:-1]).tolist()
    return [(n - 1) * page_size + int(last) if n > 0 else 0
            for n, last in zip(num_pages, last_page_len.tolist())]


def _scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
            causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled scores `[H_q, M, L]` float32 (causally masked with ``causal_offset``) and v repeated
    to the q heads `[H_q, L, D]` (GQA by repetition), for `_attend` and `_attend_lse`."""
    group = q.shape[1] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("mhd,hld->hml", q.to(torch.float32), k) * sm_scale
    if causal_offset is not None:
        rows = torch.arange(q.shape[0], device=q.device).unsqueeze(1) + causal_offset
        keys = torch.arange(k.shape[1], device=q.device).unsqueeze(0)
        scores = scores.masked_fill(keys > rows, -math.inf)
    return scores, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
            causal_offset: int | None) -> torch.Tensor:
    """q `[M, H_q, D]`, k/v `[H_kv, L, D]` float32 -> `[M, H_q, D]` float32 (GQA by repetition)."""
    scores, v = _scores(q, k, v, sm_scale, causal_offset)
    if k.shape[1] == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return torch.einsum("hml,hld->mhd", torch.softmax(scores, dim=-1), v)


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, page_indptr: torch.Tensor,
                 page_indices: torch.Tensor, last_page_len: torch.Tensor, sm_scale: float,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query per sequence: q `[B, H_q, D]` -> o `[B, H_q, D]` (q's dtype); empty sequence -> 0."""
    out = torch.empty_like(q)
    kv_lens = _kv_lens(page_indptr, last_page_len, kv_layer.shape[-2])
    for b, kv_len in enumerate(kv_lens):
        pages = page_indices[int(page_indptr[b]):int(page_indptr[b + 1])]
        k, v = gather_kv(kv_layer, pages, kv_len, k_scale, v_scale)
        out[b] = _attend(q[b:b + 1], k, v, sm_scale, None)[0].to(q.dtype)
    return out


def paged_prefill(q: torch.Tensor, kv_layer: torch.Tensor, qo_indptr: torch.Tensor,
                  page_indptr: torch.Tensor, page_indices: torch.Tensor,
                  last_page_len: torch.Tensor, sm_scale: float, causal: bool = True,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Ragged queries q `[T, H_q, D]` over paged KV that already holds them -> o `[T, H_q, D]`.

    With `causal`, query i of a sequence of q_len queries and kv_len keys sees keys 0 ..
    kv_len - q_len + i.
    """
    out = torch.empty_like(q)
    kv_lens = _kv_lens(page_indptr, last_page_len, kv_layer.shape[-2])
    for b, kv_len in enumerate(kv_lens):
        start, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if end == start:
            continue
        pages = page_indices[int(page_indptr[b]):int(page_indptr[b + 1])]
        k, v = gather_kv(kv_layer, pages, kv_len, k_scale, v_scale)
        offset = kv_len - (end - start) if causal else None
        out[start:end] = _attend(q[start:end], k, v, sm_scale, offset).to(q.dtype)
    return out


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attend` that also returns each query's natural-log log-sum-exp `[H_q, M]` (-inf, and
    an output of 0, for a query that sees no key)."""
    scores, v = _scores(q, k, v, sm_scale, causal_offset)
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    weights = torch.where(seen[..., None], torch.exp(scores - torch.where(seen, lse, 0.0)[..., None]), 0.0)
    return torch.einsum("hml,hld->mhd", weights, v), lse


def paged_prefill_lse(q: torch.Tensor, kv_layer: torch.Tensor, qo_indptr: torch.Tensor,
                      page_indptr: torch.Tensor, page_indices: torch.Tensor,
                      last_page_len: torch.Tensor, sm_scale: float, causal: bool = True,
                      k_scale: float = 1.0, v_scale: float = 1.0, *, prefix_only: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_prefill` in float32 with each query's log-sum-exp: (o `[T, H_q, D]` float32,
    lse `[H_q, T]` float32). With `prefix_only`, each sequence's queries see the keys before
    them, 0 .. kv_len - q_len - 1, all of them."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    kv_lens = _kv_lens(page_indptr, last_page_len, kv_layer.shape[-2])
    for b, kv_len in enumerate(kv_lens):
        start, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if end == start:
            continue
        pages = page_indices[int(page_indptr[b]):int(page_indptr[b + 1])]
        num_keys = kv_len - (end - start) if prefix_only else kv_len
        k, v = gather_kv(kv_layer, pages, num_keys, k_scale, v_scale)
        offset = kv_len - (end - start) if causal and not prefix_only else None
        out[start:end], lse[:, start:end] = _attend_lse(q[start:end], k, v, sm_scale, offset)
    return out, lse


def causal_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
                         sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's queries over its own keys, causal (query i sees keys 0 .. i of its run):
    q `[T, H_q, D]`, k/v `[T, H_kv, D]` -> (o `[T, H_q, D]` float32, lse `[H_q, T]` float32)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    bounds = qo_indptr.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        keys = k[start:end].transpose(0, 1).to(torch.float32)
        values = v[start:end].transpose(0, 1).to(torch.float32)
        out[start:end], lse[:, start:end] = _attend_lse(q[start:end], keys, values, sm_scale, 0)
    return out, lse


def merge_state(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                lse_b: torch.Tensor) -> torch.Tensor:
    """Two attention outputs `[T, H, D]` of the same queries over disjoint key sets, merged by
    their natural-log LSE `[H, T]` (-inf: no key, weight 0) -> float32 `[T, H, D]`: the attention
    over the union of the keys (FlashInfer's merge_state)."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, 0.0)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    total = torch.where(total > 0, total, 1.0)
    w_a, w_b = (w_a / total).t()[..., None], (w_b / total).t()[..., None]
    return o_a.to(torch.float32) * w_a + o_b.to(torch.float32) * w_b
