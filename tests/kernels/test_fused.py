"""The fused layer kernels (disagg.kernels.fused) against the model's torch versions
(disagg.model.layers.*_torch), which define their rounding.

Exactness asked of the kernels: residual sums and RoPE bit-exact in every dtype (elementwise ops
rounded at the same places); norms and SiLU-mul within 1e-6 relative in float32, and in 16-bit
dtypes within 1 ulp on at most 0.1% of the elements (the norm's float32 sum runs in another order
than torch's; exp may differ in its last float32 bit). Under the interpreter they come out exact
in bfloat16 and 1 ulp off on a handful of float16 norm elements.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import fused
from disagg.model import layers

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
# (tokens, hidden): SmolLM2's 576, llama3-8b's 4096, a non-power-of-two 1000; T in {1, 7, 64}.
NORM_SHAPES = [(1, 4096), (7, 576), (7, 1000), (64, 576)]


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers in value order: neighbours differ by 1 (one ulp)."""
    bits = x.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_rounding_close(got: torch.Tensor, want: torch.Tensor, max_ulp: int = 1) -> None:
    """float32: 1e-6 relative; 16-bit: at most `max_ulp` ulp apart, on at most 0.1% of the elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        return
    ulps = (_ordered(got) - _ordered(want)).abs()
    num_off = int((ulps > 0).sum())
    assert int(ulps.max()) <= max_ulp and num_off <= max(1, want.numel() // 1000), (
        f"{num_off} of {want.numel()} elements differ, by up to {int(ulps.max())} ulp")


def _weight(hidden: int, dtype: torch.dtype, device) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(hidden)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", NORM_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(device, dtype, num_tokens, hidden, with_residual):
    torch.manual_seed(hidden + num_tokens)
    # x as the rows of a wider buffer (strided rows); activations ~1e-3 so eps matters.
    x = (1e-3 * torch.randn(num_tokens, hidden + 8)).to(dtype).to(device)[:, :hidden]
    residual = (1e-3 * torch.randn(num_tokens, hidden)).to(dtype).to(device) if with_residual else None
    weight = _weight(hidden, dtype, device)
    want, want_stream = layers.add_rms_norm_torch(x, residual, weight, EPS)
    got, stream = fused.add_rms_norm(x, residual.clone() if with_residual else None, weight, EPS)
    assert torch.equal(stream, want_stream), "the residual sum is not the torch sum, bit for bit"
    assert got.is_contiguous()
    assert_rounding_close(got, want)


def test_add_rms_norm_updates_residual_in_place(device):
    x = torch.randn(3, 1000).to(device)
    residual = torch.randn(3, 1000).to(device)
    want = residual + x
    _, stream = fused.add_rms_norm(x, residual, torch.ones(1000, device=device), EPS)
    assert stream is residual and torch.equal(residual, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 1000).to(dtype).to(device)
    weight = _weight(1000, dtype, device)
    assert_rounding_close(fused.rms_norm(x, weight, EPS), layers.rms_norm_torch(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 1536), (7, 1000), (64, 128)])
def test_silu_mul_matches_torch(device, dtype, num_tokens, intermediate):
    torch.manual_seed(intermediate + num_tokens)
    gate_up = (3 * torch.randn(num_tokens, 2 * intermediate)).to(dtype).to(device)
    assert_rounding_close(fused.silu_mul(gate_up), layers.silu_mul_torch(gate_up))


def test_silu_mul_strided_rows(device):
    gate_up = torch.randn(5, 2 * 300 + 40).to(torch.bfloat16).to(device)[:, :600]
    assert_rounding_close(fused.silu_mul(gate_up), layers.silu_mul_torch(gate_up))


def _qkv_rope_inputs(num_tokens, num_q, num_kv, head_dim, dtype, device):
    """The q and k heads of a fused qkv output (a token-strided view), and cos/sin of positions
    far apart (large angles)."""
    qkv = torch.randn(num_tokens, (num_q + 2 * num_kv) * head_dim).to(dtype).to(device)
    x = qkv[:, :(num_q + num_kv) * head_dim].view(num_tokens, num_q + num_kv, head_dim)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    inv_freq = layers.rope_inv_freq(head_dim, 500000.0, None, device)
    return x, *layers.rope_cos_sin(positions, inv_freq, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("num_q,num_kv,head_dim", [(4, 2, 16), (9, 3, 64), (32, 8, 128)])
def test_apply_rope_matches_torch_bit_exact(device, dtype, num_tokens, num_q, num_kv, head_dim):
    if num_tokens == 64 and head_dim == 128:
        num_tokens = 16  # the interpreter's time, not a limit of the kernel
    torch.manual_seed(num_tokens * head_dim)
    x, cos, sin = _qkv_rope_inputs(num_tokens, num_q, num_kv, head_dim, dtype, device)
    assert num_tokens == 1 or x.stride(0) == (num_q + 2 * num_kv) * head_dim  # as in the model
    got = fused.apply_rope(x, cos, sin)
    want = layers.apply_rope_torch(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, want)


def test_launchers_refuse_bad_inputs(device):
    x = torch.randn(3, 64, device=device)
    w = torch.ones(64, device=device)
    with pytest.raises(ValueError, match=r"weight: expected shape \[hidden\]"):
        fused.add_rms_norm(x, None, w[:32], EPS)
    with pytest.raises(TypeError, match="weight: expected dtype in"):
        fused.rms_norm(x, w.half(), EPS)
    with pytest.raises(ValueError, match=r"residual: expected shape"):
        fused.add_rms_norm(x, x[:2], w, EPS)
    with pytest.raises(ValueError, match="x: expected a contiguous last dim"):
        fused.rms_norm(x.t(), torch.ones(3, device=device), EPS)
    with pytest.raises(ValueError, match="gate_up: expected an even number of columns"):
        fused.silu_mul(torch.randn(2, 7, device=device))
    odd = torch.randn(3, 15, device=device)
    with pytest.raises(ValueError, match="x: expected an even head_dim"):
        fused.apply_rope(torch.randn(3, 2, 15, device=device), odd, odd)
    cos = torch.randn(3, 16, device=device)
    with pytest.raises(ValueError, match=r"sin: expected shape"):
        fused.apply_rope(torch.randn(3, 2, 16, device=device), cos, cos[:2])


def test_zero_tokens(device):
    x = torch.empty(0, 64, device=device)
    out, stream = fused.add_rms_norm(x, x.clone(), torch.ones(64, device=device), EPS)
    assert out.shape == (0, 64) and stream.shape == (0, 64)
    assert fused.silu_mul(torch.empty(0, 8, device=device)).shape == (0, 4)
    assert fused.apply_rope(torch.empty(0, 2, 8, device=device), x[:, :8], x[:, :8]).shape == (0, 2, 8)


def test_cpu_without_interpreter_is_refused_and_layers_run_torch(monkeypatch):
    """No silent fallback in the launchers; the model's plain names pick the torch versions."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor, or a CPU one with TRITON_INTERPRET=1"):
        fused.rms_norm(x, w, EPS)
    assert torch.equal(layers.rms_norm(x, w, EPS), layers.rms_norm_torch(x, w, EPS))
