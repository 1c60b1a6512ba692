"""GPU: the skinny GEMM (disagg.kernels.linear) at llama3-8b's decode shapes against float64, with
the default launch options (split-K included), and replayed from a CUDA graph. Run on a GPU host:

    TRITON_INTERPRET=0 .venv/bin/pytest -q -m gpu tests/kernels/test_linear_gpu.py \
        tests/model/test_model_linear.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from disagg.kernels import linear as skinny

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the CPU test's helper by name
from test_linear import _assert_close_to_exact  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# (N, K): qkv, o, gate_up, down, lm_head of llama3-8b.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 17, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_llama8b_shapes(dtype, m, n, k):
    gen = torch.Generator(CUDA).manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=CUDA) / k ** 0.5).to(dtype)
    _assert_close_to_exact(skinny.linear(x, w), x, w, None)


def test_linear_split_k_in_a_cuda_graph_equals_eager():
    gen = torch.Generator(CUDA).manual_seed(0)
    x = torch.randn(64, 14336, generator=gen, device=CUDA).to(torch.bfloat16)
    w = (torch.randn(4096, 14336, generator=gen, device=CUDA) / 120).to(torch.bfloat16)
    config = skinny.LinearConfig(block_n=32, block_k=128, split_k=4)
    want = skinny.linear(x, w, config=config)
    out = torch.empty_like(want)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny.linear(x, w, out=out, config=config)
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), "split-K is not deterministic across launches"
    assert int(skinny._arrival_counters(CUDA, 128)[:128].abs().sum()) == 0
