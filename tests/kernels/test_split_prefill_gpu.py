"""split_prefill on the GPU: the own part in cuDNN (`torch.ops.aten._scaled_dot_product_cudnn_attention`),
the prefix in the paged kernel, against the float32 torch reference by relative error (as
test_kernels_gpu: 16-bit operands bound it near 2^-8). Long chunks with and without a prefix,
equal-length batches (one cuDNN call) and ragged ones (one call per sequence), GQA 1/4/8; it
never runs inside a graph capture. Run: `python3 -m pytest -m gpu tests/kernels/test_split_prefill_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import reference
from disagg.kernels import split_prefill as split_module
from disagg.kernels.split_prefill import split_prefill, use_split

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _case(page_table, q_lens, prefix_lens, num_kv_heads, group, dtype, head_dim=128, page_size=16):
    torch.manual_seed(0)
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 4
    kv = torch.randn(num_pages, 2, num_kv_heads, page_size, head_dim, device=CUDA).to(dtype)
    table = page_table(kv_lens, page_size, num_pages, device=CUDA)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, device=CUDA, dtype=dtype)
    # k and v inside one fused row, strided, as the model's views of its qk and qkv tensors are
    kv_rows = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=CUDA, dtype=dtype)
    k, v = kv_rows[:, :num_kv_heads], kv_rows[:, 2 * num_kv_heads:]
    start = 0
    for slots, p, n in zip(table.seq_slots, prefix_lens, q_lens):
        own = slots[p:p + n].to(CUDA)
        kv[own // page_size, 0, :, own % page_size] = k[start:start + n]
        kv[own // page_size, 1, :, own % page_size] = v[start:start + n]
        start += n
    qo_indptr = torch.tensor([0] + q_lens, device=CUDA).cumsum(0).to(torch.int32)
    return q, k, v, kv, qo_indptr, (table.page_indptr, table.page_indices, table.last_page_len)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,prefix_lens", [
    ([2048], [0]), ([2048], [1000]), ([1500], [4096]),   # one chunk: no prefix, partial page, many pages
    ([512] * 4, [256, 0, 17, 1024]),                      # equal lengths: one batched cuDNN call
    ([300, 1, 777], [0, 50, 1300]),                       # ragged: a call per sequence
])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_split_prefill_gpu(page_table, dtype, q_lens, prefix_lens, group):
    q, k, v, kv, qo_indptr, tables = _case(page_table, q_lens, prefix_lens, 2, group, dtype)
    got = split_prefill(q, k, v, kv, qo_indptr, *tables, 128 ** -0.5, q_lens)
    assert split_module._CudnnState.failed is None, split_module._CudnnState.failed
    want = reference.paged_prefill(q, kv, qo_indptr, *tables, 128 ** -0.5)
    assert _rel_err(got, want) < 2e-2


def test_split_is_never_chosen_inside_a_capture():
    bf16 = torch.bfloat16
    args = dict(device=CUDA, dtype=bf16, kv_dtype=bf16, num_tokens=split_module.SPLIT_MIN_TOKENS, num_seqs=1,
                q_lens_known=True)
    assert use_split("auto", **args)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        capturing = (use_split("auto", **args), use_split("split", **args))
    assert capturing == (False, False)
