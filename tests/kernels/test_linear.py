"""The skinny GEMM (disagg.kernels.linear) against torch's `F.linear` computed in float64.

Tolerance: the kernel accumulates in float32 (any order) and rounds once to the output dtype,
so each element is within one output ulp of the exact product plus a float32 accumulation error
(relative 1e-5 of the sum of |terms|): asserted as `|got - exact| <= ulp(exact) + 1e-5 * sum|x w|`.
Split-K must give the same bits on every launch (the last arrival sums partials in split order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.kernels import linear as skinny
from disagg.kernels.linear import LinearConfig, default_config
from disagg.model import layers

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (N, K, config): one tile and no split; columns past N; K not a multiple of BLOCK_K; split-K with
# an even and a ragged last slice; split-K over several tiles.
CASES = [
    (64, 128, LinearConfig(block_n=64, block_k=64, split_k=1)),
    (100, 96, LinearConfig(block_n=32, block_k=32, split_k=1)),
    (48, 200, LinearConfig(block_n=16, block_k=64, split_k=1)),
    (64, 256, LinearConfig(block_n=32, block_k=32, split_k=4)),
    (40, 232, LinearConfig(block_n=16, block_k=32, split_k=3)),
]


def _inputs(m, n, k, dtype, device, bias: bool):
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k).to(dtype).to(device)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n).to(dtype).to(device) if bias else None
    return x, w, b


def _assert_close_to_exact(got, x, w, b):
    exact = F.linear(x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu())
    magnitude = (x.double().cpu().abs() @ w.double().cpu().abs().T)
    eps = torch.finfo(got.dtype).eps
    bound = exact.abs() * eps + 1e-5 * magnitude + 1e-30
    err = (got.double().cpu() - exact).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error up to {worst:.2f}x the bound (dtype {got.dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("n,k,config", CASES)
def test_linear_matches_exact_product(device, dtype, m, n, k, config):
    x, w, _ = _inputs(m, n, k, dtype, device, bias=False)
    got = skinny.linear(x, w, config=config)
    assert got.dtype == dtype and got.shape == (m, n)
    _assert_close_to_exact(got, x, w, None)


@pytest.mark.parametrize("split_k", [1, 4])
def test_linear_bias_strided_rows_and_out(device, split_k):
    x, w, b = _inputs(7, 64, 256, torch.bfloat16, device, bias=True)
    wide = torch.zeros(7, 300, dtype=torch.bfloat16, device=device)
    wide[:, :256] = x
    out = torch.full((7, 64), float("nan"), dtype=torch.bfloat16, device=device)
    got = skinny.linear(wide[:, :256], w, b, out=out,
                        config=LinearConfig(block_n=32, block_k=64, split_k=split_k))
    assert got.data_ptr() == out.data_ptr()
    _assert_close_to_exact(got, x, w, b)


def test_split_k_is_deterministic_and_leaves_counters_at_zero(device):
    x, w, _ = _inputs(64, 96, 512, torch.bfloat16, device, bias=False)
    config = LinearConfig(block_n=32, block_k=64, split_k=4)
    first = skinny.linear(x, w, config=config)
    for _ in range(3):
        assert torch.equal(skinny.linear(x, w, config=config), first)
    assert int(skinny._arrival_counters(x.device, 3)[:3].abs().sum()) == 0


@pytest.mark.parametrize("bad, match", [
    (dict(m=0), "expected 1..64 rows"),
    (dict(m=65), "expected 1..64 rows"),
    (dict(k_w=100), r"weight: expected shape"),
    (dict(w_dtype=torch.float16), "weight: expected dtype"),
    (dict(w_t=True), "weight: expected a contiguous last dim"),
    (dict(split_k=8), "leaves a K slice"),
])
def test_linear_rejects_bad_inputs(device, bad, match):
    m, k = bad.get("m", 4), 128
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(64, bad.get("k_w", k), dtype=bad.get("w_dtype", torch.bfloat16), device=device)
    if bad.get("w_t"):
        w = torch.randn(k, 64, dtype=torch.bfloat16, device=device).T
    config = LinearConfig(block_n=32, block_k=64, split_k=bad.get("split_k", 1))
    with pytest.raises((ValueError, TypeError), match=match):
        skinny.linear(x, w, config=config)


def test_default_config_fills_the_sms():
    # llama3-8b at 132 SMs: about 2 programs per SM, or K slices already at the 1024 floor.
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        config = default_config(n, k, 132)
        programs = -(-n // config.block_n) * config.split_k
        assert programs >= 264 or k // config.split_k < 2048, (n, k, config)
        assert k // config.split_k >= 1024, (n, k, config)
    assert default_config(4096, 4096, 132).split_k == 4
    assert default_config(4096, 14336, 132).split_k == 8
    assert default_config(28672, 4096, 132).split_k == 1


def test_model_linear_dispatch(device, monkeypatch):
    x, w, b = _inputs(3, 64, 128, torch.bfloat16, device, bias=True)
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv(layers.LINEAR_ENV, raising=False)
    torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b))
    assert not calls, "cuBLAS is the default"
    monkeypatch.setenv(layers.LINEAR_ENV, "triton")
    _assert_close_to_exact(layers.linear(x, w, b), x, w, b)
    assert calls == [1]
    big = torch.randn(65, 128, dtype=torch.bfloat16, device=device)
    layers.linear(big, w, b)
    assert calls == [1], "more rows than a decode batch go to cuBLAS"
    monkeypatch.setenv(layers.LINEAR_ENV, "cutlass")
    with pytest.raises(ValueError, match="DISAGG_LINEAR: expected one of"):
        layers.linear(x, w, b)
