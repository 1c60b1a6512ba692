"""GPU: the fused layer kernels against the model's torch ops on CUDA at llama3-8b's shapes
(hidden 4096, intermediate 14336, 32 q + 8 kv heads of 128) and their CUDA-graph capture (the
model with them: tests/model/test_model_fused.py).

Exactness asked (see test_fused.py): residual sums and RoPE bit-exact; norms and SiLU-mul within
1 ulp on at most 0.1% of the elements in 16-bit dtypes, 1e-6 relative in float32. Run on a GPU
host with:

    TRITON_INTERPRET=0 .venv/bin/pytest -q -m gpu tests/kernels/test_fused_gpu.py \
        tests/model/test_model_fused.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from disagg.kernels import fused
from disagg.model import layers

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the CPU test's helper by name
from test_fused import assert_rounding_close  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
HIDDEN, INTERMEDIATE, NUM_Q, NUM_KV, HEAD_DIM = 4096, 14336, 32, 8, 128
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_llama8b(dtype, num_tokens, with_residual):
    gen = torch.Generator(CUDA).manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device=CUDA).to(dtype)
    residual = torch.randn(num_tokens, HIDDEN, generator=gen, device=CUDA).to(dtype)
    residual = residual if with_residual else None
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=CUDA)).to(dtype)
    want, want_stream = layers.add_rms_norm_torch(x, residual, weight, EPS)
    got, stream = fused.add_rms_norm(x, residual.clone() if with_residual else None, weight, EPS)
    assert torch.equal(stream, want_stream)
    # The float32 statistics are summed in another order than torch's (a block reduction), so
    # rsqrt may differ in its last bit; after the rounding to the dtype and the multiply by the
    # weight (rounded again) that reaches 2 ulp on a few fp16 elements (seen on an H200: 103 of
    # 4M at T=1024; bf16's coarser grid hides it).
    assert_rounding_close(got, want, max_ulp=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_silu_mul_llama8b(dtype, num_tokens):
    gen = torch.Generator(CUDA).manual_seed(num_tokens)
    gate_up = (3 * torch.randn(num_tokens, 2 * INTERMEDIATE, generator=gen, device=CUDA)).to(dtype)
    assert_rounding_close(fused.silu_mul(gate_up), layers.silu_mul_torch(gate_up))


def _qkv_view(num_tokens: int, dtype: torch.dtype, gen: torch.Generator):
    qkv = torch.randn(num_tokens, (NUM_Q + 2 * NUM_KV) * HEAD_DIM, generator=gen, device=CUDA).to(dtype)
    return qkv[:, :(NUM_Q + NUM_KV) * HEAD_DIM].view(num_tokens, NUM_Q + NUM_KV, HEAD_DIM)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_apply_rope_llama8b_bit_exact(dtype, num_tokens):
    gen = torch.Generator(CUDA).manual_seed(num_tokens)
    x = _qkv_view(num_tokens, dtype, gen)
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen, device=CUDA)
    cos, sin = layers.rope_cos_sin(positions, layers.rope_inv_freq(HEAD_DIM, 500000.0, None, CUDA), dtype)
    assert torch.equal(fused.apply_rope(x, cos, sin), layers.apply_rope_torch(x, cos, sin))


def test_cuda_graph_replay_equals_eager():
    """Capture norm (in place into a static residual), RoPE and SiLU-mul once; replay on new inputs."""
    dtype, num_tokens = torch.bfloat16, 64
    gen = torch.Generator(CUDA).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=CUDA).to(dtype)

    x, residual, weight = rand(num_tokens, HIDDEN), rand(num_tokens, HIDDEN), 1 + 0.1 * rand(HIDDEN)
    qk, cos, sin = _qkv_view(num_tokens, dtype, gen), rand(num_tokens, HEAD_DIM), rand(num_tokens, HEAD_DIM)
    gate_up = rand(num_tokens, 2 * INTERMEDIATE)

    def run() -> tuple[torch.Tensor, ...]:
        normed, _ = fused.add_rms_norm(x, residual, weight, EPS)
        return normed, fused.apply_rope(qk, cos, sin), fused.silu_mul(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(2):
        for buffer in (x, residual, qk, cos, sin, gate_up):
            buffer.copy_(rand(*buffer.shape))
        want_norm, want_stream = layers.add_rms_norm_torch(x, residual, weight, EPS)
        want = (layers.apply_rope_torch(qk, cos, sin), layers.silu_mul_torch(gate_up))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(residual, want_stream)
        assert_rounding_close(outs[0], want_norm)
        assert torch.equal(outs[1], want[0])
        assert_rounding_close(outs[2], want[1])
