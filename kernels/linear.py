"""Skinny GEMM for decode steps: `out = x @ weight.T (+ bias)` for a few rows and large weights.

A decode step multiplies at most a few dozen rows by every weight matrix once, so its GEMMs are
weight reads: the time to beat is the weight bytes over the memory bandwidth. cuBLAS picks
tiles for compute and reads such weights well above that bound at a few dozen rows
(benchmarks/records/tuning-notes.md). This kernel streams the weight in `[BLOCK_N, BLOCK_K]`
tiles, deep-pipelined, with enough programs in flight to cover the latency: small `BLOCK_N`, and
split-K where N alone gives too few programs. Split-K partials go to a float32 workspace; the
last program of an output tile to arrive (an atomic counter, as `paged_decode` merges its
splits) sums them in split order, so results do not depend on timing.

`disagg.model.layers.linear` calls it for decode-sized batches of 16-bit models: by default
(`DISAGG_LINEAR=auto`) for vocabulary-wide weights, where it beats cuBLAS (it reads an LM head
at about its weight-read bound at 1-64 rows, cuBLAS well above it), and for every projection
inside the decode graphs of <= 16 sequences, where under PDL it overlaps the kernels around it;
for every projection with `DISAGG_LINEAR=triton` (slower than cuBLAS on the layers' smaller
weights at 32-64 rows). `benchmarks/sweep_linear.py` times the launch options per weight shape
against cuBLAS and the bound; `CONFIGS` records its winners. The launcher allocates only
value-independent buffers and never reads values on the host: it runs inside CUDA-graph capture,
on the caller's current stream; where `dispatch.layer_pdl` says so it launches with programmatic
dependent launch, as the fused layer kernels do.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from disagg.kernels import checks, dispatch
from disagg.kernels.paged_tile import gdc_launch_dependents, gdc_wait

# Rows this kernel takes (one BLOCK_M tile; the wgmma tile is 64 rows on Hopper).
MAX_ROWS = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LinearConfig:
    """Launch options of one weight shape: output columns and reduction slice per program, the
    split-K factor (programs per output tile), warps and pipeline stages."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Per weight shape `(N, K)`; other shapes get `default_config`. Entries are copied here by hand
# from `benchmarks/sweep_linear.py --quick`; what chose them: benchmarks/records/tuning-notes.md.
CONFIGS: dict[tuple[int, int], LinearConfig] = {
    # llama3-8b's LM head: 128-column tiles, no split (the bound at 32-64 rows; 64 columns tie
    # at 1-16 rows).
    (128256, 4096): LinearConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3),
}


def default_config(n: int, k: int, num_sms: int) -> LinearConfig:
    """A first guess, until the sweep fills `CONFIGS`: BLOCK_N 64, then split K (slices of at
    least 1024) until about two programs per SM are in flight (`N / 64 * split_k >= 2 * SMs`).

    Why 64 columns: each program re-reads the `[M, BLOCK_K]` rows of x (from L2) per weight tile,
    so at 64 rows BLOCK_N 32 would read twice the weight's bytes of x from L2. Three stages of
    128-deep tiles hold 96 KB of shared memory: two programs fit on an SM.
    """
    tiles = triton.cdiv(n, 64)
    split_k = 1
    while tiles * split_k < 2 * num_sms and k // (2 * split_k) >= 1024:
        split_k *= 2
    return LinearConfig(block_n=64, block_k=128, split_k=split_k, num_warps=4, num_stages=3)


@triton.jit
def _prefetch_weights_l2(w_ptr, cols, N, k_lo, K, stride_wn, BLOCK_N: tl.constexpr,
                         PREFETCH_K: tl.constexpr):
    """`prefetch.global.L2` of the 128-byte lines of `w[cols, k_lo : k_lo + PREFETCH_K]` (16-bit
    weights: 64 elements a line); rows and columns clamped into the matrix, never past it."""
    lines = tl.arange(0, PREFETCH_K // 64) * 64
    row = tl.minimum(cols, N - 1).to(tl.int64)
    col = tl.minimum(k_lo + lines, K - 1)
    ptrs = w_ptr + row[:, None] * stride_wn + col[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


# M (rows) is not specialized: a new batch size must not compile a new kernel mid-serving (only
# BLOCK_M, one of 16/32/64, picks a variant; `row_tiles` gives one row count per variant).
@triton.jit(do_not_specialize=["M"])
def linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
):
    # Program (j, s) computes out[:, j*BLOCK_N : (j+1)*BLOCK_N] over the K slice
    # [s*k_per_split, (s+1)*k_per_split) (k_per_split a multiple of BLOCK_K). Masks cover rows
    # past M (BLOCK_M is a power of two >= M), columns past N, and, unless EVEN_K, the K tail.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_lo = split * k_per_split
    if PDL:
        # Scheduled while the kernel before still runs: the weights do not depend on it, so the
        # first PREFETCH_K columns of this program's rows head for L2 now; x (its output) and
        # everything else wait for it.
        _prefetch_weights_l2(w_ptr, cols, N, k_lo, K, stride_wn, BLOCK_N, PREFETCH_K)
        gdc_wait()
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_lo + ks)[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k_lo + ks)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k_lo + k + ks) < K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bfloat16 dot reads the bits as integers; float32 is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PDL:
        gdc_launch_dependents()
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        # Partials are [SPLIT_K, BLOCK_M, N] float32. Every thread's stores precede the (release)
        # arrival; the last arrival (acquire) reads all SPLIT_K partials of this tile through L2
        # (.cg: this SM's L1 may hold nothing of them, but never trust it) and sums them in split
        # order, then leaves the counter at zero for the next launch.
        tile = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + split * BLOCK_M * N + tile, acc, mask=out_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=out_ok, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def row_tiles(max_rows: int) -> list[int]:
    """One row count per compiled variant (`BLOCK_M` 16, 32, 64) that calls of at most
    ``max_rows`` rows can pick: run `linear` once with each to compile them all ahead of serving."""
    return [rows for rows in (1, 17, 33) if rows <= min(max_rows, MAX_ROWS)]


_counters: dict[torch.device, torch.Tensor] = {}
_counters_lock = threading.Lock()


def _arrival_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's zeroed int32 arrival counters (one per output tile), grown on demand.

    Every launch leaves them at zero, so one buffer serves every call on the device as long as
    split launches do not overlap in time (calls on one stream never do; the engines run their
    forwards on one stream). Growing replaces the buffer: a graph captured earlier keeps the old
    one alive through its own reference.
    """
    with _counters_lock:
        counters = _counters.get(device)
        if counters is None or counters.numel() < num_tiles:
            counters = torch.zeros(max(num_tiles, 4096), dtype=torch.int32, device=device)
            _counters[device] = counters
        return counters


def _prefetch_columns(config: LinearConfig, element_size: int) -> int:
    """Weight columns prefetched under PDL: about what the pipeline's first stages load (a power
    of two, whole 128-byte lines of 16-bit weights; one line for other dtypes)."""
    if element_size != 2:
        return 64
    return max(64, 1 << (config.block_k * config.num_stages).bit_length() - 1)


def _check_linear_inputs(x, weight, bias, out) -> None:
    checks.check_tensor("x", x, dims="[num_rows, in_features]", shape=(None, None), dtypes=DTYPES)
    device = x.device
    checks.check_tensor("weight", weight, dims="[out_features, in_features]",
                        shape=(None, x.shape[1]), dtypes=(x.dtype,), device=device)
    if bias is not None:
        checks.check_tensor("bias", bias, dims="[out_features]", shape=(weight.shape[0],),
                            dtypes=(x.dtype,), device=device)
        if bias.stride(0) != 1:
            raise ValueError(f"bias: expected a contiguous tensor, got stride {bias.stride()}")
    if out is not None:
        checks.check_tensor("out", out, dims="[num_rows, out_features]",
                            shape=(x.shape[0], weight.shape[0]), dtypes=(x.dtype,), device=device)
        if out.stride(1) != 1:
            raise ValueError(f"out: expected a contiguous last dim, got strides {out.stride()}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x: expected 1..{MAX_ROWS} rows (a decode batch; larger ones belong to "
                         f"cuBLAS), got {x.shape[0]}")
    for name, tensor in (("x", x), ("weight", weight)):
        if tensor.stride(1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides "
                             f"{tensor.stride()}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None, config: LinearConfig | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` (torch's `F.linear`) for at most `MAX_ROWS` rows, float32 accumulation.

    Args:
        x: `[M, K]` float16/bfloat16/float32, 1 <= M <= MAX_ROWS, last dim contiguous.
        weight: `[N, K]`, x's dtype, last dim contiguous (torch's Linear layout).
        bias: optional `[N]`, x's dtype.
        out: optional `[M, N]` output of x's dtype, last dim contiguous.
        config: launch options; default `CONFIGS[(N, K)]` or `default_config`.

    Returns:
        `[M, N]` in x's dtype (`out` when given). float32 inputs multiply in IEEE float32.

    Raises:
        TypeError, ValueError: a tensor of the wrong shape, dtype, device or layout, or M out of
            range; a config whose split leaves a slice empty.
    """
    _check_linear_inputs(x, weight, bias, out)
    kernel = dispatch.runnable(linear_kernel) if dispatch.use_triton(x) else None
    if kernel is None:
        raise ValueError(f"x: expected a CUDA tensor, or a CPU one with TRITON_INTERPRET=1, got a "
                         f"{x.device.type} tensor; torch.nn.functional.linear runs anywhere")
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        config = CONFIGS.get((n, k)) or default_config(n, k, dispatch.device_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    if config.split_k > 1 and k_per_split * (config.split_k - 1) >= k:
        raise ValueError(f"config: split_k={config.split_k} x {k_per_split} leaves a K slice of "
                         f"in_features={k} empty; use fewer splits or a smaller block_k")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    interpreting = dispatch.interpreting()
    block_m = max(16, triton.next_power_of_2(m))
    num_tiles = triton.cdiv(n, config.block_n)
    if config.split_k > 1:
        partials = torch.empty(config.split_k * block_m * n, dtype=torch.float32, device=x.device)
        counters = _arrival_counters(x.device, num_tiles)
    else:
        partials = counters = out  # unused
    kernel[(num_tiles, config.split_k)](
        x, weight, bias if bias is not None else out, out, partials, counters,
        m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=config.split_k, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0 and k_per_split * config.split_k == k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interpreting else "tf32",
        UPCAST=interpreting,
        PREFETCH_K=_prefetch_columns(config, weight.element_size()),
        num_warps=config.num_warps, num_stages=config.num_stages, **dispatch.pdl_options(x.device),
    )
    return out
