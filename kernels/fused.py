"""Fused elementwise kernels of the decoder layer: RMSNorm (with the residual add), RoPE, SiLU-mul.

`disagg.model.layers` calls these launchers wherever `dispatch.use_triton` says the Triton kernel
runs (CUDA tensors; CPU tensors under Triton's interpreter); elsewhere it runs its own torch
versions, which define the numerics. Each kernel replaces a chain of eager torch ops (about 8
launches for a norm, 6 for RoPE, 2 for the gated activation) by one launch and rounds at the same
places as that chain: every intermediate torch keeps in the activations' dtype is rounded to that
dtype here too, and float32 math stands where torch computes in float32 ("opmath"). What cannot
match bit for bit is the order of the float32 sum in the norm's mean square. Launchers allocate
only value-independent outputs and never read values on the host: they run inside CUDA-graph
capture, on the caller's current stream. Where `dispatch.layer_pdl` says so (by default inside
the decode graphs of small batches) they launch with programmatic dependent launch: a kernel is scheduled while the one before it ends,
waits for it before touching memory, and lets the next one launch once its loads are issued.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from disagg.kernels import checks, dispatch
from disagg.kernels.paged_tile import gdc_launch_dependents, gdc_wait

# Elements per program of the elementwise kernels (a power of two).
SILU_BLOCK = 1024
ROPE_TILE_ELEMENTS = 2048
# torch runs each op separately, so no multiply-add is ever contracted into an fma: neither here.
_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """float32 `x` rounded to the nearest DTYPE value (ties to even), kept as float32: where torch
    stores an intermediate. bfloat16 rounds on the float32 bits, because Triton's interpreter
    casts float32 to bfloat16 by truncation; the GPU's cast would give the same result."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16 << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_residual, stride_out, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    # Program i owns row i: [HIDDEN] elements of x (and of residual, out). The mask covers the
    # padding of BLOCK (a power of two) past HIDDEN; padded lanes load 0 and add 0 to the sum.
    # PDL: every access waits for the kernels before (gdc_wait is the first thing).
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        # torch's `residual + x`: float32 sum rounded to x's dtype; the norm reads the rounded sum.
        x32 = round_to_dtype(residual.to(tl.float32) + x.to(tl.float32), dtype)
        tl.store(residual_ptrs, x32.to(dtype), mask=mask)
    else:
        x32 = x.to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    # torch's mean on CUDA multiplies the sum by float32(1 / HIDDEN).
    mean_sq = tl.sum(x32 * x32, axis=0) * (1.0 / HIDDEN)
    normed = round_to_dtype(x32 * tl.rsqrt(mean_sq + eps), dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to_dtype(weight * normed, dtype)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)


@triton.jit
def silu_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out,
    INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr, PDL: tl.constexpr,
):
    # Program (t, j) writes out[t, j*BLOCK : (j+1)*BLOCK] from gate = gate_up[t, c] and
    # up = gate_up[t, INTERMEDIATE + c]. The mask covers the column tail past INTERMEDIATE.
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    row = gate_up_ptr + t * stride_in
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + INTERMEDIATE + cols, mask=mask, other=0.0)
    if PDL:
        gdc_launch_dependents()
    g = gate.to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in float32 with IEEE division and (on CUDA) expf, which is
    # libdevice's exp; the interpreter has no libdevice, and its exp is numpy's.
    if PRECISE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = round_to_dtype(tl.div_rn(g, 1.0 + e), gate.dtype)
    out = round_to_dtype(silu * up.to(tl.float32), gate.dtype)
    tl.store(out_ptr + t * stride_out + cols, out.to(gate.dtype), mask=mask)


@triton.jit
def apply_rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_cos, stride_sin, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (t, j) rotates heads [j*BLOCK_H, (j+1)*BLOCK_H) of token t. A head's dims split in
    # lo = [0, HALF) and hi = [HALF, 2*HALF); rotate-half gives
    #     out_lo = x_lo * cos_lo + (-x_hi) * sin_lo      out_hi = x_hi * cos_hi + x_lo * sin_hi
    # rounded after each product and after the sum, as torch's `x * cos + rotated * sin` is.
    # Masks cover the head tail past NUM_HEADS and BLOCK_HALF's padding past HALF.
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (h[:, None] < NUM_HEADS) & d_ok[None, :]
    src = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh + d[None, :]
    x_lo = tl.load(src, mask=mask, other=0.0)
    x_hi = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x_lo.dtype
    cos_lo = tl.load(cos_ptr + t * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_ptr + t * stride_cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_ptr + t * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_ptr + t * stride_sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if PDL:
        gdc_launch_dependents()
    lo, hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    out_lo = round_to_dtype(
        round_to_dtype(lo * cos_lo, dtype) + round_to_dtype(-hi * sin_lo, dtype), dtype)
    out_hi = round_to_dtype(
        round_to_dtype(hi * cos_hi, dtype) + round_to_dtype(lo * sin_hi, dtype), dtype)
    dst = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(dst, out_lo.to(dtype), mask=mask)
    tl.store(dst + HALF, out_hi.to(dtype), mask=mask)


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _check_rows(name: str, tensor: object, dims: str, shape: tuple, dtypes, device) -> torch.Tensor:
    """A `[rows, n]` (or `[rows, heads, n]`) tensor whose last dim is contiguous."""
    checks.check_tensor(name, tensor, dims=dims, shape=shape, dtypes=dtypes, device=device)
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides "
                         f"{tensor.stride()}")
    return tensor


def _kernel_for(kernel, name: str, tensor: torch.Tensor):
    """`kernel`, refusing tensors on which only the torch versions run (no silent fallback)."""
    if not dispatch.use_triton(tensor):
        raise ValueError(f"{name}: expected a CUDA tensor, or a CPU one with TRITON_INTERPRET=1, "
                         f"got a {tensor.device.type} tensor; the torch versions in "
                         "disagg.model.layers run anywhere")
    return dispatch.runnable(kernel)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = residual + x` (in x's dtype), then `(weight * rms_norm(s), s)`, in one launch.

    Without a residual `s` is x itself. With one, `s` is written into `residual` in place and
    `residual` is returned: the caller's old residual values are gone.

    Args:
        x: `[T, H]` float32/float16/bfloat16; rows may be strided, H contiguous.
        residual: None or `[T, H]` of x's dtype and device (rows may be strided).
        weight: `[H]` of x's dtype, contiguous.
        eps: added to the mean square.

    Returns:
        normed `[T, H]` (new, contiguous) and the residual stream `[T, H]`.

    Raises:
        TypeError, ValueError: shapes, dtypes, devices or strides as above; CPU tensors without
            `TRITON_INTERPRET=1`. Nothing is written then.
    """
    _check_rows("x", x, "[num_tokens, hidden]", (None, None), checks.ATTN_DTYPES, None)
    num_tokens, hidden = x.shape
    if residual is not None:
        _check_rows("residual", residual, "[num_tokens, hidden]", (num_tokens, hidden), (x.dtype,),
                    x.device)
    _check_rows("weight", weight, "[hidden]", (hidden,), (x.dtype,), x.device)
    kernel = _kernel_for(add_rms_norm_kernel, "x", x)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, x if residual is None else residual
    block = triton.next_power_of_2(hidden)
    stream = x if residual is None else residual
    kernel[(num_tokens,)](
        x, stream, weight, out, x.stride(0), stream.stride(0), out.stride(0), float(eps),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=_norm_warps(block), **_OPTIONS, **dispatch.pdl_options(x.device),
    )
    return out, stream


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim in one launch (`add_rms_norm` without residual).

    Args:
        x: `[T, H]` float32/float16/bfloat16, H contiguous. weight: `[H]` of x's dtype.
        eps: added to the mean square.

    Returns:
        `[T, H]` of x's dtype, new.
    """
    return add_rms_norm(x, None, weight, eps)[0]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the fused gate/up projection, in one launch.

    Args:
        gate_up: `[T, 2 I]` float32/float16/bfloat16 (gate columns first), rows may be strided,
            columns contiguous.

    Returns:
        `[T, I]` of gate_up's dtype, new.

    Raises:
        TypeError, ValueError: shape, dtype or strides as above; CPU tensors without
            `TRITON_INTERPRET=1`.
    """
    _check_rows("gate_up", gate_up, "[num_tokens, 2 * intermediate]", (None, None),
                checks.ATTN_DTYPES, None)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up: expected an even number of columns (gate then up), got {width}")
    kernel = _kernel_for(silu_mul_kernel, "gate_up", gate_up)
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(intermediate))
    grid = (num_tokens, triton.cdiv(intermediate, block))
    kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), INTERMEDIATE=intermediate,
                 BLOCK=block, PRECISE_EXP=gate_up.is_cuda, num_warps=4, **_OPTIONS,
                 **dispatch.pdl_options(gate_up.device))
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE `x * cos + rotate_half(x) * sin` into a new contiguous tensor, one launch.

    Args:
        x: `[T, heads, head_dim]` float32/float16/bfloat16 with head_dim even and contiguous;
            token and head strides are free (e.g. the q and k heads of the fused qkv output).
        cos, sin: `[T, head_dim]` of x's dtype (from `rope_cos_sin`), head_dim contiguous.

    Returns:
        `[T, heads, head_dim]` of x's dtype, contiguous.

    Raises:
        TypeError, ValueError: shapes, dtypes, devices or strides as above; CPU tensors without
            `TRITON_INTERPRET=1`.
    """
    _check_rows("x", x, "[num_tokens, heads, head_dim]", (None, None, None), checks.ATTN_DTYPES, None)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: expected an even head_dim (rotate-half), got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table, "[num_tokens, head_dim]", (num_tokens, head_dim), (x.dtype,), x.device)
    kernel = _kernel_for(apply_rope_kernel, "x", x)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, ROPE_TILE_ELEMENTS // block_half))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    kernel[grid](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                 out.stride(0), out.stride(1), NUM_HEADS=num_heads, HALF=half, BLOCK_H=block_h,
                 BLOCK_HALF=block_half, num_warps=4, **_OPTIONS, **dispatch.pdl_options(x.device))
    return out
