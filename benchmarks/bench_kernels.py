"""Benchmark the paged-cache kernels on one GPU; every figure comes with its anchor from the same run.

    python3 benchmarks/bench_kernels.py --out results/bench_kernels.json [--only decode]

Anchors: the GPU's own device-to-device copy bandwidth (bytes read + written), and torch's
`scaled_dot_product_attention` on the same shapes stored densely. The prefill rows time our
`paged_prefill` and `split_prefill` (own tokens in cuDNN, prefix in pages) on chunks after a cached
prefix of 0 and of half the prompt against cuDNN's SDPA over the whole prompt, dense, no prefix. Each timing captures the calls
in a CUDA graph (as the decode engine runs them) and takes the median of replays timed with CUDA
events; inputs rotate over enough copies that their total exceeds L2, so small cases are not
measured out of cache. Launch options are tuned with `benchmarks/sweep_kernels.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from disagg.kernels import append as append_mod
from disagg.kernels import copy as copy_mod
from disagg.kernels import decode as decode_mod
from disagg.kernels import split_prefill as split_mod
from disagg.kernels import (append_kv, copy_slots, decode_workspace, paged_decode,
                            paged_prefill)
from disagg.kernels.split_prefill import split_prefill

CUDA = torch.device("cuda")
L2_ROTATION_BYTES = 512 << 20  # rotate inputs until this much data is touched per graph
GiB = 1 << 30


def graph_seconds(calls, reps: int = 20) -> float:
    """Median seconds per call of `calls` (run in sequence) captured in one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del graph
    return statistics.median(times) / len(calls)


def copies_for(num_bytes: int) -> int:
    return max(1, math.ceil(L2_ROTATION_BYTES / max(num_bytes, 1)))


def warm_up(seconds: float = 2.0) -> None:
    """Keep the GPU busy until its clocks have ramped up (idle H200s sit at a few hundred MHz)."""
    src = torch.randn(GiB // 4, device=CUDA)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            dst.copy_(src)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def copy_bandwidth() -> dict:
    """Device copy bandwidth in bytes/s (read + write) of a 1 GiB buffer, two ways: eager
    `copy_` timed with CUDA events (a copy kernel), and the same copy as a CUDA-graph memcpy node
    (which the driver may hand to a copy engine). The anchor is the faster of the two."""
    src = torch.randn(GiB // 4, device=CUDA)
    dst = torch.empty_like(src)
    graph = 2 * GiB / graph_seconds([lambda: dst.copy_(src)] * 4, reps=30)
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    eager = 2 * GiB / statistics.median(times)
    return dict(eager=eager, graph=graph, anchor=max(eager, graph))


def paged_batch(batch, ctx, num_kv_heads, head_dim, page_size, dtype, copies, shuffle=True):
    """A cache holding `copies` disjoint batches of `batch` x `ctx` tokens on shuffled pages
    (``shuffle``, the worst case), or on pages in order, one run per sequence (what
    `disagg.pages` hands out when the free space allows)."""
    pages_per_seq = ctx // page_size
    num_pages = batch * pages_per_seq * copies
    kv = torch.randn(num_pages, 2, num_kv_heads, page_size, head_dim, device=CUDA)
    kv = (kv * 8).to(dtype) if dtype == torch.float8_e4m3fn else kv.to(dtype)
    perm = (torch.randperm(num_pages, device=CUDA) if shuffle
            else torch.arange(num_pages, device=CUDA)).to(torch.int32)
    tables = []
    for c in range(copies):
        indices = perm[c * batch * pages_per_seq:(c + 1) * batch * pages_per_seq]
        indptr = torch.arange(0, batch + 1, device=CUDA, dtype=torch.int32) * pages_per_seq
        last = torch.full((batch,), page_size, device=CUDA, dtype=torch.int32)
        tables.append((indptr, indices.contiguous(), last))
    return kv, tables


def decode_cache(batch, ctx, dtype=torch.bfloat16, num_kv_heads=8, head_dim=128, page_size=16,
                 shuffle=True):
    """`paged_batch` with the decode benchmarks' shapes, enough copies to rotate past L2."""
    kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * torch.finfo(dtype).bits // 8
    return paged_batch(batch, ctx, num_kv_heads, head_dim, page_size, dtype, copies_for(kv_bytes),
                       shuffle)


def bench_decode(batch, ctx, dtype=torch.bfloat16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                 page_size=16, num_splits=None, cache=None):
    """Seconds per paged decode call (CUDA graph, copies rotated past L2); ``cache``: a
    `decode_cache` result to run over instead of a fresh one."""
    kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * torch.finfo(dtype).bits // 8
    kv, tables = cache or decode_cache(batch, ctx, dtype, num_kv_heads, head_dim, page_size)
    qdtype = torch.bfloat16
    qs = [torch.randn(batch, num_qo_heads, head_dim, device=CUDA, dtype=qdtype) for _ in tables]
    outs = [torch.empty_like(q) for q in qs]
    splits = num_splits or decode_mod.choose_num_splits(
        batch, num_kv_heads, ctx, torch.cuda.get_device_properties(0).multi_processor_count)
    ws = [decode_workspace(batch, num_qo_heads, head_dim, splits, CUDA) for _ in tables]
    scales = dict(k_scale=0.125, v_scale=0.125) if dtype == torch.float8_e4m3fn else {}
    calls = [lambda q=q, t=t, o=o, w=w: paged_decode(
        q, kv, *t, head_dim ** -0.5, out=o, num_splits=splits, workspace=w, check_indices=False,
        **scales) for q, t, o, w in zip(qs, tables, outs, ws)]
    seconds = graph_seconds(calls)
    io_bytes = kv_bytes + 2 * batch * num_qo_heads * head_dim * 2
    del kv
    return dict(seconds=seconds, bytes_per_s=io_bytes / seconds, num_splits=splits)


@triton.jit
def stream_kv_kernel(kv_ptr, page_indptr_ptr, page_indices_ptr, out_ptr, stride_page, num_splits,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, PAGED: tl.constexpr, WORDS: tl.constexpr):
    # The decode kernel's memory traffic and nothing else: program (kv head, sequence, split)
    # reads the K and V rows of its share of full pages (through the page table when PAGED,
    # else pages page_start.. in order) and writes one sum. The floor any decode kernel of this
    # grid and size can reach. WORDS: the cache is viewed as int32 words (fp8: 4 per word),
    # summed as integers so that no conversion competes with the loads.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    page_start = tl.load(page_indptr_ptr + seq)
    kv_len = (tl.load(page_indptr_ptr + seq + 1) - page_start) * PAGE_SIZE
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.int32 if WORDS else tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_ok = tok < hi
        if PAGED:
            page = tl.load(page_indices_ptr + page_start + tok // PAGE_SIZE, mask=tok_ok, other=0)
        else:
            page = page_start + tok // PAGE_SIZE
        rows = (page.to(tl.int64) * stride_page + kv_head * (PAGE_SIZE * HEAD_DIM)
                + (tok % PAGE_SIZE) * HEAD_DIM)
        k = tl.load(kv_ptr + rows[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        v = tl.load(kv_ptr + NUM_KV_HEADS * PAGE_SIZE * HEAD_DIM + rows[:, None] + d[None, :],
                    mask=tok_ok[:, None], other=0.0)
        if WORDS:
            acc += k + v
        else:
            acc += k.to(tl.float32) + v.to(tl.float32)
    pid = (seq * NUM_KV_HEADS + kv_head) * num_splits + split
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0).to(tl.float32))


def bench_stream_floor(batch, ctx, dtype=torch.bfloat16, num_kv_heads=8, head_dim=128,
                       page_size=16, num_splits=4, paged=True, block_n=64, num_warps=4,
                       num_stages=3, cache=None):
    """`stream_kv_kernel` over the decode benchmark's cache and tables (same rotation);
    ``cache``: a `decode_cache` result to read instead of a fresh one."""
    kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * torch.finfo(dtype).bits // 8
    kv, tables = cache or decode_cache(batch, ctx, dtype, num_kv_heads, head_dim, page_size)
    words = dtype == torch.float8_e4m3fn
    if words:
        kv = kv.view(torch.int32)
    outs = [torch.empty(num_kv_heads * batch * num_splits, device=CUDA) for _ in tables]
    calls = [lambda t=t, o=o: stream_kv_kernel[(num_kv_heads, batch, num_splits)](
        kv, t[0], t[1], o, kv.stride(0), num_splits, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=kv.shape[-1], PAGE_SIZE=page_size, BLOCK_N=block_n, PAGED=paged, WORDS=words,
        num_warps=num_warps, num_stages=num_stages) for t, o in zip(tables, outs)]
    seconds = graph_seconds(calls)
    del kv
    return dict(seconds=seconds, bytes_per_s=kv_bytes / seconds)


def bench_sdpa_decode(batch, ctx, num_qo_heads=32, num_kv_heads=8, head_dim=128, storage=None):
    """Seconds per dense SDPA decode call; ``storage``: a bf16 tensor whose bytes hold the K and V
    of every copy (read as dense K then V per copy), so that it reads the very memory a paged
    run read, instead of fresh tensors."""
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * 2
    copies = copies_for(kv_bytes)
    shape = (batch, num_kv_heads, ctx, head_dim)
    numel = batch * num_kv_heads * ctx * head_dim
    if storage is None:
        dense = [(torch.randn(shape, device=CUDA, dtype=torch.bfloat16),
                  torch.randn(shape, device=CUDA, dtype=torch.bfloat16)) for _ in range(copies)]
    else:
        flat = storage.view(-1)
        dense = [(flat[(2 * c) * numel:(2 * c + 1) * numel].view(shape),
                  flat[(2 * c + 1) * numel:(2 * c + 2) * numel].view(shape)) for c in range(copies)]
    sets = [(torch.randn(batch, num_qo_heads, 1, head_dim, device=CUDA, dtype=torch.bfloat16), k, v)
            for k, v in dense]
    calls = [lambda s=s: F.scaled_dot_product_attention(*s, enable_gqa=True) for s in sets]
    seconds = graph_seconds(calls)
    return dict(seconds=seconds, bytes_per_s=kv_bytes / seconds)


def bench_prefill(num_seqs=8, seq_len=2048, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                  page_size=16, dtype=torch.bfloat16, reps=10):
    kv, (table,) = paged_batch(num_seqs, seq_len, num_kv_heads, head_dim, page_size, dtype, 1)
    q = torch.randn(num_seqs * seq_len, num_qo_heads, head_dim, device=CUDA, dtype=dtype)
    out = torch.empty_like(q)
    qo_indptr = torch.arange(0, num_seqs + 1, device=CUDA, dtype=torch.int32) * seq_len
    seconds = graph_seconds([lambda: paged_prefill(q, kv, qo_indptr, *table, head_dim ** -0.5,
                                                   out=out, check_indices=False)], reps=reps)
    flops = 2 * num_seqs * num_qo_heads * seq_len * seq_len * head_dim  # causal half of 4*S^2*D
    return dict(seconds=seconds, flops_per_s=flops / seconds)


def bench_sdpa_prefill(backend, num_seqs=8, seq_len=2048, num_qo_heads=32, head_dim=128):
    shape = (num_seqs, num_qo_heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=CUDA, dtype=torch.bfloat16) for _ in range(3))

    def call():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    seconds = graph_seconds([call], reps=10)
    flops = 2 * num_seqs * num_qo_heads * seq_len * seq_len * head_dim
    return dict(seconds=seconds, flops_per_s=flops / seconds)


def bench_append(num_tokens=65536, num_kv_heads=8, head_dim=128, page_size=16):
    num_pages = num_tokens // page_size * 2
    kv = torch.empty(num_pages, 2, num_kv_heads, page_size, head_dim, device=CUDA, dtype=torch.bfloat16)
    pages = torch.randperm(num_pages, device=CUDA)[: num_tokens // page_size]
    slots = (pages[:, None] * page_size + torch.arange(page_size, device=CUDA)).flatten()
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, device=CUDA, dtype=torch.bfloat16)
            for _ in range(2))
    seconds = graph_seconds([lambda: append_kv(k, v, kv, slots, check_indices=False)])
    moved = 2 * 2 * num_tokens * num_kv_heads * head_dim * 2  # K and V, read + written
    return dict(seconds=seconds, bytes_per_s=moved / seconds)


def bench_copy_slots(num_layers=32, num_kv_heads=8, page_size=16, head_dim=128):
    page_bytes = num_layers * 2 * num_kv_heads * page_size * head_dim * 2
    num_copied = GiB // page_bytes
    shape = (num_layers, 2 * num_copied, 2, num_kv_heads, page_size, head_dim)
    src = torch.randn(shape, device=CUDA, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    offsets = torch.arange(page_size, device=CUDA)
    pick = lambda: (torch.randperm(2 * num_copied, device=CUDA)[:num_copied, None] * page_size + offsets).flatten()
    src_slots, dst_slots = pick(), pick()
    seconds = graph_seconds([lambda: copy_slots(src, src_slots, dst, dst_slots, check_indices=False)])
    return dict(seconds=seconds, bytes_per_s=2 * GiB / seconds)


def figure(name, ours, anchor, unit, target, anchor_name, **extra):
    return dict(name=name, ours=ours, anchor=anchor, ratio=ours / anchor, unit=unit,
                target=target, anchor_name=anchor_name, **extra)


def run_decode(copy_bw):
    figs = []
    for batch, ctx, target in ((64, 4096, 0.80), (8, 1024, 0.60)):
        ours = bench_decode(batch, ctx)
        figs.append(figure(f"decode bf16 B={batch} ctx={ctx} bandwidth", ours["bytes_per_s"] / 1e12,
                           copy_bw / 1e12, "TB/s", target, "device copy", num_splits=ours["num_splits"],
                           seconds=ours["seconds"]))
    splits = figs[-1]["num_splits"]
    floor = bench_stream_floor(8, 1024, num_splits=splits)
    figs.append(figure("stream floor B=8 ctx=1024 (KV read only, same grid) bandwidth",
                       floor["bytes_per_s"] / 1e12, copy_bw / 1e12, "TB/s", None, "device copy",
                       seconds=floor["seconds"], num_splits=splits))
    figs.append(figure("decode bf16 B=8 ctx=1024 speed vs stream floor", 1 / figs[1]["seconds"],
                       1 / floor["seconds"], "calls/s", None, "stream floor (same grid)"))
    for batch, ctx in ((64, 4096), (8, 1024), (32, 32768)):
        figs += sdpa_rows(batch, ctx)
    figs += fp8_rows()
    return figs


def sdpa_rows(batch, ctx) -> list[dict]:
    """bf16 decode against dense SDPA, like for like: each round allocates one cache and times,
    over its very bytes, our kernel with the pages in order (one run per sequence, as the page
    allocator hands them out when it can), our kernel with the same pages shuffled (the worst
    case), and SDPA reading them as dense K and V. The same call swings by ~12% with the memory
    its allocation lands in (B=64 x 4096: 253 or 284 us for ours, 247 or 278 for SDPA), so
    separate allocations compared the luck of the draw. Four rounds, each side's median."""
    runs = {"shuffled": [], "in order": [], "sdpa": []}
    for _ in range(4):
        torch.cuda.empty_cache()
        kv, tables = decode_cache(batch, ctx, shuffle=False)
        perm = torch.randperm(kv.shape[0], device=CUDA).to(torch.int32)
        shuffled = [(ptr, perm[idx.long()].contiguous(), last) for ptr, idx, last in tables]
        runs["in order"].append(bench_decode(batch, ctx, cache=(kv, tables)))
        runs["shuffled"].append(bench_decode(batch, ctx, cache=(kv, shuffled)))
        runs["sdpa"].append(bench_sdpa_decode(batch, ctx, storage=kv))
        del kv, tables, shuffled
    sdpa = statistics.median(r["seconds"] for r in runs["sdpa"])
    figs = []
    for label, key in (("", "shuffled"), (", pages in order", "in order")):
        ours = statistics.median(r["seconds"] for r in runs[key])
        figs.append(figure(f"decode bf16 B={batch} ctx={ctx} speed vs SDPA dense{label}",
                           1 / ours, 1 / sdpa, "calls/s", 0.95,
                           "SDPA default (dense, enable_gqa) over the same memory, median of 4",
                           ours_us=[r["seconds"] * 1e6 for r in runs[key]],
                           sdpa_us=[r["seconds"] * 1e6 for r in runs["sdpa"]],
                           num_splits=runs[key][0]["num_splits"]))
    return figs


def fp8_rows(batch=64, ctx=4096) -> list[dict]:
    """fp8 decode against the read-only floor over the very same fp8 cache, and against bf16 on
    fresh allocations; four rounds each (the cache emptied first), medians (see `sdpa_rows`)."""
    fp8_dtype = torch.float8_e4m3fn
    runs = {"bf16": [], "fp8": [], "floor": []}
    for _ in range(4):
        torch.cuda.empty_cache()
        runs["bf16"].append(bench_decode(batch, ctx)["seconds"])
        torch.cuda.empty_cache()
        cache = decode_cache(batch, ctx, fp8_dtype)
        fp8 = bench_decode(batch, ctx, dtype=fp8_dtype, cache=cache)
        runs["fp8"].append(fp8["seconds"])
        runs["floor"].append(bench_stream_floor(batch, ctx, dtype=fp8_dtype,
                                                num_splits=fp8["num_splits"], cache=cache)["seconds"])
        del cache
    bf16, fp8_s, floor = (statistics.median(runs[k]) for k in ("bf16", "fp8", "floor"))
    return [figure(f"decode fp8 B={batch} ctx={ctx} speed vs bf16", 1 / fp8_s, 1 / bf16,
                   "calls/s", 1.6, "our bf16 decode, median of 4 allocations",
                   fp8_us=[t * 1e6 for t in runs["fp8"]], bf16_us=[t * 1e6 for t in runs["bf16"]]),
            figure(f"decode fp8 B={batch} ctx={ctx} speed vs stream floor", 1 / fp8_s, 1 / floor,
                   "calls/s", 0.85, "stream floor (fp8 KV, same grid, same memory)",
                   floor_us=[t * 1e6 for t in runs["floor"]], num_splits=fp8["num_splits"])]


def run_prefill():
    ours = bench_prefill()
    figs = []
    for backend, label, target in ((SDPBackend.FLASH_ATTENTION, "SDPA flash", 1.0), (None, "SDPA default", 0.8)):
        sdpa = bench_sdpa_prefill(backend)
        figs.append(figure(f"prefill causal 8x2048 vs {label}", ours["flops_per_s"] / 1e12,
                           sdpa["flops_per_s"] / 1e12, "TFLOP/s", target, f"{label} (dense, MHA-expanded)"))
    for num_seqs, seq_len in PREFILL_SHAPES:
        dense = bench_cudnn_dense(num_seqs, seq_len)
        for prefix_len in (0, seq_len // 2):
            figs += prefill_path_rows(num_seqs, seq_len, prefix_len, dense)
    figs.append(split_first_call_row())
    return figs


PREFILL_SHAPES = ((8, 2048), (4, 8192), (1, 32768))


def prefill_chunk(num_seqs, seq_len, prefix_len, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                  page_size=16, dtype=torch.bfloat16):
    """`num_seqs` prompts of `seq_len` tokens in shuffled pages, of which the last `seq_len -
    prefix_len` are this chunk's (q, and k/v as the layer appended them, strided views of one
    fused row as the model's are): (q, k, v, kv, qo_indptr, table)."""
    kv, (table,) = paged_batch(num_seqs, seq_len, num_kv_heads, head_dim, page_size, dtype, 1)
    chunk = seq_len - prefix_len
    q = torch.randn(num_seqs * chunk, num_qo_heads, head_dim, device=CUDA, dtype=dtype)
    rows = torch.randn(num_seqs * chunk, 3 * num_kv_heads, head_dim, device=CUDA, dtype=dtype)
    k, v = rows[:, :num_kv_heads], rows[:, 2 * num_kv_heads:]
    qo_indptr = torch.arange(0, num_seqs + 1, device=CUDA, dtype=torch.int32) * chunk
    return q, k, v, kv, qo_indptr, table


def prefill_flops(num_seqs, seq_len, prefix_len, num_qo_heads=32, head_dim=128):
    """FLOPs of causal attention of a chunk after `prefix_len` cached tokens (4 D per visible pair)."""
    chunk = seq_len - prefix_len
    pairs = chunk * prefix_len + chunk * (chunk + 1) / 2
    return 4 * head_dim * num_qo_heads * num_seqs * pairs


def bench_cudnn_dense(num_seqs, seq_len, num_qo_heads=32, num_kv_heads=8, head_dim=128):
    """cuDNN's SDPA (causal, dense [B, H, S, D], no prefix): the figure to beat. K/V keep their 8
    heads (enable_gqa) when the cuDNN backend takes them, else are expanded to 32."""
    def run(kv_heads, gqa):
        q = torch.randn(num_seqs, num_qo_heads, seq_len, head_dim, device=CUDA, dtype=torch.bfloat16)
        k, v = (torch.randn(num_seqs, kv_heads, seq_len, head_dim, device=CUDA, dtype=torch.bfloat16)
                for _ in range(2))

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return graph_seconds([call], reps=10)

    try:
        return dict(seconds=run(num_kv_heads, True), kv_heads=num_kv_heads)
    except RuntimeError:
        return dict(seconds=run(num_qo_heads, False), kv_heads=num_qo_heads)


def prefill_path_rows(num_seqs, seq_len, prefix_len, dense) -> list[dict]:
    """Our paged and split prefill of one chunk shape against cuDNN dense over the whole prompt."""
    q, k, v, kv, qo_indptr, table = prefill_chunk(num_seqs, seq_len, prefix_len)
    out = torch.empty_like(q)
    q_lens = [seq_len - prefix_len] * num_seqs
    scale = q.shape[-1] ** -0.5
    paged = graph_seconds([lambda: paged_prefill(q, kv, qo_indptr, *table, scale, out=out,
                                                 check_indices=False)], reps=10)
    split = graph_seconds([lambda: split_prefill(q, k, v, kv, qo_indptr, *table, scale, q_lens,
                                                 out=out, check_indices=False)], reps=10)
    flops = prefill_flops(num_seqs, seq_len, prefix_len)
    extra = dict(paged_ms=paged * 1e3, split_ms=split * 1e3, cudnn_dense_ms=dense["seconds"] * 1e3,
                 cudnn_kv_heads=dense["kv_heads"], paged_tflops=flops / paged / 1e12,
                 split_tflops=flops / split / 1e12, cudnn_failed=split_mod._CudnnState.failed,
                 cudnn_native_gqa=split_mod._CudnnState.native_gqa)
    anchor = f"cuDNN SDPA dense causal {num_seqs}x{seq_len}, no prefix"
    shape = f"prefill {num_seqs}x{seq_len} prefix {prefix_len}"
    del q, k, v, kv, out
    return [figure(f"{shape} split vs cuDNN dense", 1 / split, 1 / dense["seconds"], "calls/s", 1.0,
                   anchor, **extra),
            figure(f"{shape} paged vs cuDNN dense", 1 / paged, 1 / dense["seconds"], "calls/s", None,
                   anchor, **extra)]


def split_first_call_row(seq_len=8191) -> dict:
    """A split prefill at a length not seen before (cuDNN builds an execution plan per shape)
    against the same call warm: what a new prompt length costs once in serving."""
    import time

    q, k, v, kv, qo_indptr, table = prefill_chunk(1, seq_len, 0)
    call = lambda: split_prefill(q, k, v, kv, qo_indptr, *table, q.shape[-1] ** -0.5, [seq_len],
                                 check_indices=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    warm = graph_seconds([call], reps=10)
    return figure(f"split prefill 1x{seq_len} first call (new shape) vs warm", 1 / first, 1 / warm,
                  "calls/s", None, "the same call warm", first_ms=first * 1e3, warm_ms=warm * 1e3)


def run_copies(copy_bw):
    append = bench_append()
    copy = bench_copy_slots()
    return [figure("append_kv 65536 tokens bandwidth", append["bytes_per_s"] / 1e12, copy_bw / 1e12,
                   "TB/s", 0.70, "device copy"),
            figure("copy_slots 1 GiB in 16-token pages bandwidth", copy["bytes_per_s"] / 1e12,
                   copy_bw / 1e12, "TB/s", 0.85, "device copy")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_kernels.json"))
    parser.add_argument("--only", default="decode,prefill,copies", help="comma list of sections")
    args = parser.parse_args()
    torch.manual_seed(0)
    sections = set(args.only.split(","))
    warm_up()
    copy = copy_bandwidth()
    copy_bw = copy["anchor"]
    figs = []
    print(f"device copy bandwidth {copy_bw / 1e12:.3f} TB/s (eager {copy['eager'] / 1e12:.3f}, "
          f"graph memcpy {copy['graph'] / 1e12:.3f})", flush=True)
    if "decode" in sections:
        figs += run_decode(copy_bw)
    if "prefill" in sections:
        figs += run_prefill()
    if "copies" in sections:
        figs += run_copies(copy_bw)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  copy_bandwidth_TBps={k: v / 1e12 for k, v in copy.items()}, figures=figs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'figure':58s} {'ours':>9s} {'anchor':>9s} {'ratio':>6s} {'target':>6s}")
    for f in figs:
        target = "" if f["target"] is None else f"{f['target']:.2f}"
        print(f"{f['name']:58s} {f['ours']:9.3f} {f['anchor']:9.3f} {f['ratio']:6.2f} {target:>6s} {f['unit']}")


if __name__ == "__main__":
    main()
