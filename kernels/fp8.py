"""FP8 (e4m3) KV cache: per-tensor scales on the host side, quantize/dequantize inside kernels.

A float8_e4m3fn cache stores `clamp(x / scale, -448, 448)` rounded to nearest; readers multiply
by the same scale. Scales are per tensor (one for K, one for V), given as a Python float or a
one-element float32 tensor on the cache's device (the tensor form keeps a CUDA-graph capture free
of host values: the kernel reads it). Caches of other dtypes take no scale. Used by the append,
decode and prefill launchers; `quantize` is the torch reference's rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _check_positive(name: str, scale: object) -> None:
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a float or a float32 tensor, got {type(scale).__name__}") from None
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name}: expected a finite scale > 0, got {value}")


@dataclass(frozen=True)
class Scales:
    """Resolved K/V scales for one launch: kernel arguments plus the constexpr flags."""

    k: float | torch.Tensor
    v: float | torch.Tensor
    is_fp8: bool
    is_tensor: bool

    def host(self) -> tuple[float, float]:
        """Scales as floats (reads tensors: for the CPU reference path only)."""
        as_float = lambda s: float(s.reshape(-1)[0]) if isinstance(s, torch.Tensor) else float(s)
        return as_float(self.k), as_float(self.v)


def resolve_scales(
    kv_dtype: torch.dtype,
    device: torch.device,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    *,
    check_values: bool | None = None,
) -> Scales:
    """Validate `k_scale`/`v_scale` for a cache of `kv_dtype` on `device`.

    Float scales must be finite and > 0. Tensor scales' values are checked the same way when
    ``check_values`` (one device-to-host copy for both); None checks CPU tensors only (a CUDA
    read would sync the host, and is illegal during graph capture): launchers pass their
    `dispatch.should_check_values` decision.

    Raises:
        ValueError: a scale given for a non-fp8 cache, a scale that is not finite and positive
            (inf, nan, <= 0), a tensor scale on another device or of size != 1, or one scale a
            float and the other a tensor.
        TypeError: a tensor scale that is not float32.
    """
    is_fp8 = kv_dtype == FP8_DTYPE
    if not is_fp8:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(
                    f"{name}: scales apply to a float8_e4m3fn KV cache only, got one for a "
                    f"{kv_dtype} cache; pass None"
                )
        return Scales(1.0, 1.0, is_fp8=False, is_tensor=False)
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    is_tensor = isinstance(k_scale, torch.Tensor)
    if is_tensor != isinstance(v_scale, torch.Tensor):
        raise ValueError("k_scale, v_scale: expected both floats or both tensors, got one of each")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if is_tensor:
            if scale.numel() != 1 or scale.device != device:
                raise ValueError(
                    f"{name}: expected a 1-element tensor on {device}, got shape "
                    f"{tuple(scale.shape)} on {scale.device}"
                )
            if scale.dtype != torch.float32:
                raise TypeError(f"{name}: expected float32, got {scale.dtype}")
        else:
            _check_positive(name, scale)
    if is_tensor and (device.type == "cpu" if check_values is None else check_values):
        values = torch.stack([k_scale.reshape(()), v_scale.reshape(())]).tolist()
        for name, value in zip(("k_scale", "v_scale"), values):
            _check_positive(name, value)
    return Scales(k_scale, v_scale, is_fp8=True, is_tensor=is_tensor)


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference fp8 rounding: `clamp(x / scale, -448, 448)` in float32, then e4m3 (nearest even)."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@triton.jit
def load_scale(scale, IS_TENSOR: tl.constexpr):
    """The scale as an fp32 scalar: read from a 1-element tensor, or the float argument."""
    if IS_TENSOR:
        return tl.load(scale).to(tl.float32)
    else:
        return tl.full([], scale, tl.float32)


@triton.jit
def quantize_fp8(x, scale):
    """fp32 `x / scale` (IEEE division, as torch), clamped to e4m3's finite range."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def fp8_words_to_f16(w, USE_ASM: tl.constexpr):
    """int32 words `[R, W]`, each four e4m3 bytes, widened to float16 `[R, 4W]` (byte j of word
    i is column 4i+j, the order of the bytes in memory).

    Why: a K/V tile cast to float16 at the dot lets Triton move the cast behind the
    shared-memory round trip of the dot operand, and an fp8 V operand (transposed for P @ V)
    is then read back one byte per value. Words widened where they land reach shared memory as
    16-bit data, which `ldmatrix` reads (transposed) whole. USE_ASM: two
    `cvt.rn.f16x2.e4m3x2` per word (CUDA, opaque to Triton's layout passes); else the bytes are
    picked out with shifts (the interpreter, for tests).
    """
    if USE_ASM:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    else:
        e0 = _byte_to_f16(w, 0)
        e1 = _byte_to_f16(w, 8)
        e2 = _byte_to_f16(w, 16)
        e3 = _byte_to_f16(w, 24)
    # join appends its pair as the minor dimension: join(join(e0, e2), join(e1, e3))[.., i, p]
    # is e(2i + p), so the flattened row reads e0 e1 e2 e3.
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), [w.shape[0], w.shape[1] * 4])


@triton.jit
def _byte_to_f16(w, shift: tl.constexpr):
    byte = ((w >> shift) & 0xFF).to(tl.uint8)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
