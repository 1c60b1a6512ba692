"""The skinny GEMM (`kernels.linear: triton`, `DISAGG_LINEAR=triton`) in the model: logits close to cuBLAS's (`F.linear`),
the attention kernels the same in both runs, so only the projections differ.

CPU (Triton's interpreter, dummy:tiny, float32): within 1e-5 of the logits' scale and the same
greedy tokens; every projection of a decode-sized batch goes through the kernel. GPU (2 layers of
llama3-8b in bf16, random weights): relative L2 error below 1e-2 and the same greedy tokens.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from disagg.kernels import linear as skinny
from disagg.model import layers, load_model
from disagg.model.llama import Model
from disagg.model.presets import preset_config
from disagg.model.weights import random_weights
from disagg.settings import Settings
from paged_runner import PagedRunner

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels: needs TRITON_INTERPRET=1")
PROMPTS = [[5, 17, 33, 2, 9, 11, 40, 41, 42, 7], [100, 3, 8], [250, 251, 4, 60, 61, 62, 63]]


def _generate(model, prompts, num_pages: int = 64, page_size: int = 4) -> torch.Tensor:
    """Prefill logits then one greedy decode step's, `[2, n, vocab]` float32."""
    runner = PagedRunner(model, num_pages=num_pages, page_size=page_size)
    first = runner.prefill(prompts)
    return torch.stack([first, runner.decode(first.argmax(-1).tolist())]).float()


@needs_interpreter
def test_triton_linear_forward_close_to_cublas(monkeypatch):
    model = load_model("dummy:tiny", device="cpu", settings=Settings(linear="cublas"))
    want = _generate(model, PROMPTS)
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    model.settings = Settings(linear="triton")
    got = _generate(model, PROMPTS)
    # prefill (20 tokens; 3 rows reach the head) and decode (3 rows): 4 per layer + the head each
    per_forward = 4 * model.config.num_layers + 1
    assert len(calls) == 2 * per_forward and set(calls) == {20, 3}
    err = float((got - want).abs().max()) / float(want.abs().max())
    assert err <= 1e-5, f"logits differ by {err:.2e} of their scale"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_interpreter
def test_auto_linear_takes_the_skinny_kernel_for_vocabulary_wide_weights_only(monkeypatch):
    """Outside a forward the layer ops read the environment: `DISAGG_LINEAR` unset (auto): the skinny kernel for weights of >= 65536 output features
    (an LM head), cuBLAS for narrower ones (every layer projection); `cublas` and `triton` force
    one side; an unknown value is refused by name."""
    x = torch.zeros(4, 8)
    head, layer = torch.zeros(layers.AUTO_MIN_OUT_FEATURES, 8), torch.zeros(28672, 8)
    monkeypatch.delenv(layers.LINEAR_ENV, raising=False)
    assert layers.use_skinny_linear(x, head) and not layers.use_skinny_linear(x, layer)
    assert not layers.use_skinny_linear(torch.zeros(skinny.MAX_ROWS + 1, 8), head)  # not a decode batch
    monkeypatch.setenv(layers.LINEAR_ENV, "cublas")
    assert not layers.use_skinny_linear(x, head)
    monkeypatch.setenv(layers.LINEAR_ENV, "triton")
    assert layers.use_skinny_linear(x, layer)
    monkeypatch.setenv(layers.LINEAR_ENV, "cuda")
    with pytest.raises(ValueError, match="DISAGG_LINEAR: expected one of"):
        layers.use_skinny_linear(x, head)


@pytest.mark.gpu
def test_llama8b_shaped_bf16_triton_linear_close_to_cublas(monkeypatch):
    config = dataclasses.replace(preset_config("llama3-8b"), num_layers=2)
    cuda = torch.device("cuda")
    model = Model(config, random_weights(config, torch.bfloat16, cuda), dtype=torch.bfloat16, device=cuda,
                  settings=Settings(linear="cublas"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (1, 7, 30)]
    want = _generate(model, prompts, num_pages=128, page_size=16)
    model.settings = Settings(linear="triton")
    got = _generate(model, prompts, num_pages=128, page_size=16)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-2, f"triton vs cuBLAS projections: relative error {rel:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_interpreter
def test_warm_lm_head_runs_one_call_per_row_tile(monkeypatch):
    """`Model.warm_lm_head(max_rows)` runs the head once per BLOCK_M variant that batches of up to
    max_rows sequences can pick (16 / 32 / 64 rows), so none compiles while serving."""
    model = load_model("dummy:tiny", device="cpu", settings=Settings(linear="triton"))
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    model.warm_lm_head(64)
    assert calls == [1, 17, 33]
    calls.clear()
    model.warm_lm_head(20)
    assert calls == [1, 17]
    assert skinny.row_tiles(1) == [1] and skinny.row_tiles(1000) == [1, 17, 33]


def test_blas_library_by_token_count(monkeypatch):
    """`DISAGG_BLAS=auto` (the default): cuBLASLt for forwards of 17-128 tokens (where it measured
    faster), cuBLAS otherwise; an explicit library holds for every count; a bad value names the
    variable and the choices."""
    monkeypatch.delenv(layers.BLAS_ENV, raising=False)
    assert [layers.blas_library(n) for n in (1, 16, 17, 64, 128, 129, 8192)] == \
        ["cublas", "cublas", "cublaslt", "cublaslt", "cublaslt", "cublas", "cublas"]
    monkeypatch.setenv(layers.BLAS_ENV, "cublas")
    assert layers.blas_library(64) == "cublas"
    monkeypatch.setenv(layers.BLAS_ENV, "cublaslt")
    assert layers.blas_library(1) == "cublaslt"
    monkeypatch.setenv(layers.BLAS_ENV, "rocblas")
    with pytest.raises(ValueError, match="DISAGG_BLAS: expected one of"):
        layers.blas_library(1)
    with layers.preferred_blas(torch.device("cpu"), 64):  # a no-op off CUDA, even for a bad value
        pass


@pytest.mark.gpu
def test_preferred_blas_sets_and_restores_the_library(monkeypatch):
    monkeypatch.delenv(layers.BLAS_ENV, raising=False)
    before = torch.backends.cuda.preferred_blas_library()
    with layers.preferred_blas(torch.device("cuda"), 64):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    assert torch.backends.cuda.preferred_blas_library() == before
    with layers.preferred_blas(torch.device("cuda"), 8):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublas
    assert torch.backends.cuda.preferred_blas_library() == before


@needs_interpreter
def test_small_batch_graph_mark_routes_every_projection_to_the_skinny_kernel(monkeypatch):
    """Inside `small_batch_graph()` (the decode graphs of <= 16 sequences), `DISAGG_LINEAR=auto`
    sends every projection to the skinny kernel; outside, only vocabulary-wide weights; the mark
    nests and is restored; `DISAGG_LINEAR=cublas` still wins."""
    from disagg.kernels import dispatch

    x, layer = torch.zeros(4, 8), torch.zeros(28672, 8)
    monkeypatch.delenv(layers.LINEAR_ENV, raising=False)
    assert not layers.use_skinny_linear(x, layer)
    with dispatch.small_batch_graph():
        assert layers.use_skinny_linear(x, layer)
        with dispatch.small_batch_graph(False):
            assert not layers.use_skinny_linear(x, layer)
        assert dispatch.in_small_batch_graph()
        monkeypatch.setenv(layers.LINEAR_ENV, "cublas")
        assert not layers.use_skinny_linear(x, layer)
    assert not dispatch.in_small_batch_graph()


def test_layer_pdl_setting(monkeypatch):
    """`DISAGG_LAYER_PDL`: never on CPU tensors; `auto` is off outside a small-batch graph; a bad
    value names the variable."""
    from disagg.kernels import dispatch

    cpu = torch.device("cpu")
    for setting in ("auto", "1", "0"):
        monkeypatch.setenv(dispatch.LAYER_PDL_ENV, setting)
        with dispatch.small_batch_graph():
            assert not dispatch.layer_pdl(cpu)
    monkeypatch.setenv(dispatch.LAYER_PDL_ENV, "yes")
    with pytest.raises(ValueError, match="DISAGG_LAYER_PDL: expected one of"):
        dispatch.layer_pdl(cpu)


@pytest.mark.gpu
def test_small_batch_graphs_take_skinny_gemms_and_pdl(monkeypatch):
    """Capturing the decode graphs (bf16, llama3-8b shape, 1 layer): buckets of <= 16 sequences run
    every projection through the skinny kernel and the layer kernels under PDL; larger buckets
    keep cuBLAS(Lt) for the layer weights and plain launches."""
    from disagg.engine import ColocatedEngine, EngineOptions
    from disagg.engine.graphs import SMALL_BATCH_MAX_ROWS
    from disagg.kernels import dispatch

    config = dataclasses.replace(preset_config("llama3-8b"), num_layers=1)
    cuda = torch.device("cuda")
    model = Model(config, random_weights(config, torch.bfloat16, cuda), dtype=torch.bfloat16, device=cuda,
                  settings=Settings())  # linear and layer_pdl auto
    seen = {"skinny": set(), "pdl": set()}
    real_linear, real_pdl = skinny.linear, dispatch.layer_pdl

    def counted_linear(x, weight, *a, **kw):
        if weight.shape[0] < layers.AUTO_MIN_OUT_FEATURES:  # a layer weight, not the head
            seen["skinny"].add(x.shape[0])
        return real_linear(x, weight, *a, **kw)

    def counted_pdl(device):
        on = real_pdl(device)
        if on:
            seen["pdl"].add(dispatch.in_small_batch_graph())
        return on

    monkeypatch.setattr(skinny, "linear", counted_linear)
    monkeypatch.setattr(dispatch, "layer_pdl", counted_pdl)
    engine = ColocatedEngine(model, num_pages=256, page_size=16, max_num_seqs=64,
                             max_num_batched_tokens=256, options=EngineOptions(use_cuda_graphs=True))
    engine.runner.capture_graphs(None, 256)
    assert seen["skinny"] == {b for b in (1, 2, 4, 8, 16) if b <= SMALL_BATCH_MAX_ROWS}
    assert seen["pdl"] == {True}
