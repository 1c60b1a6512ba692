"""The fused layer kernels (disagg.kernels.fused) in the model: logits equal those of the torch
layer ops, with the attention kernels the same in both runs, so only the layer ops differ.

CPU (Triton's interpreter, dummy:tiny): float32 logits within 1e-5 of their scale (the norms'
float32 sums run in another order); bfloat16 within 2 ulp of the logits' scale (bf16 ops round as
torch does; a norm element may still round the other way and move the rest). GPU (2 layers of
llama3-8b in bf16, random weights): relative L2 error below 1e-2 and the same greedy tokens; run
with `TRITON_INTERPRET=0 .venv/bin/pytest -q -m gpu tests/model/test_model_fused.py`.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from disagg.kernels import fused
from disagg.model import layers, load_model
from disagg.model.llama import Model
from disagg.model.presets import preset_config
from disagg.model.weights import random_weights
from disagg.settings import Settings
from paged_runner import PagedRunner

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels: needs TRITON_INTERPRET=1")
PROMPTS = [[5, 17, 33, 2, 9, 11, 40, 41, 42, 7], [100, 3, 8], [250, 251, 4, 60, 61, 62, 63]]


def _generate(model, steps: int = 1) -> torch.Tensor:
    """Prefill logits then `steps` greedy decode logits, `[steps + 1, n, vocab]`."""
    runner = PagedRunner(model, page_size=4)
    logits = [runner.prefill(PROMPTS)]
    for _ in range(steps):
        logits.append(runner.decode(logits[-1].argmax(-1).tolist()))
    return torch.stack(logits)


def _torch_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's layer ops run their torch versions; the attention kernels still interpret."""
    monkeypatch.setattr(layers, "dispatch", SimpleNamespace(use_triton=lambda tensor: False))


@needs_interpreter
def test_model_launches_each_fused_kernel(monkeypatch):
    """Every fused layer kernel runs, as often as the layers need it (RoPE as its own launch:
    `kernels.rope_append: false`; the default's single RoPE + append launch is counted below)."""
    model = load_model("dummy:tiny", device="cpu", settings=Settings(rope_append=False))
    calls = {name: 0 for name in ("add_rms_norm", "rms_norm", "silu_mul", "apply_rope")}
    for name in calls:
        def counted(*args, _name=name, _fn=getattr(fused, name)):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(fused, name, counted)
    PagedRunner(model).forward({0: PROMPTS[0], 1: PROMPTS[1]})
    layers_ = model.config.num_layers
    assert calls == {"add_rms_norm": 2 * layers_ + 1, "rms_norm": 0, "silu_mul": layers_,
                     "apply_rope": layers_}


@needs_interpreter
@pytest.mark.parametrize("dtype,ulps", [(torch.float32, None), (torch.bfloat16, 2)])
def test_fused_forward_equals_torch_layers(monkeypatch, dtype, ulps):
    model = load_model("dummy:tiny", device="cpu", dtype=dtype)
    got = _generate(model).float()
    _torch_layers(monkeypatch)
    want = _generate(model).float()
    scale = float(want.abs().max())
    err = float((got - want).abs().max()) / scale
    bound = 1e-5 if ulps is None else ulps * 2.0 ** -8
    assert err <= bound, f"logits differ by {err:.2e} of their scale (bound {bound:.1e})"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.gpu
def test_llama8b_shaped_bf16_fused_close_to_torch_layers(monkeypatch):
    config = dataclasses.replace(preset_config("llama3-8b"), num_layers=2)
    cuda = torch.device("cuda")
    model = Model(config, random_weights(config, torch.bfloat16, cuda), dtype=torch.bfloat16, device=cuda,
                  settings=Settings(fused_layers=True))  # the default; given so the test says what it runs
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (1, 7, 100, 333)]

    def prefill_and_decode() -> torch.Tensor:
        runner = PagedRunner(model, num_pages=128, page_size=16)
        first = runner.prefill(prompts)
        return torch.stack([first, runner.decode(first.argmax(-1).tolist())])

    got = prefill_and_decode()
    _torch_layers(monkeypatch)
    want = prefill_and_decode()
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-2, f"fused vs torch layer ops: relative error {rel:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_append_forward_equals_two_launches(monkeypatch, dtype):
    """RoPE + append in one launch (the default; `rope_append: false` runs apply_rope +
    append_kv): one launch per layer instead of two, and the logits (prefill and decode) bit for
    bit the same."""
    from disagg.kernels import rope_append as rope_append_mod
    from disagg.model import llama

    model = load_model("dummy:tiny", device="cpu", dtype=dtype, settings=Settings(rope_append=False))
    want = _generate(model, steps=2)
    calls = []
    real = rope_append_mod.rope_append
    monkeypatch.setattr(llama, "rope_append", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(llama, "apply_rope", lambda *a, **kw: pytest.fail("apply_rope ran"))
    model.settings = Settings()  # the default
    got = _generate(model, steps=2)
    assert len(calls) == 3 * model.config.num_layers
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_llama8b_shaped_bf16_rope_append_equals_two_launches():
    config = dataclasses.replace(preset_config("llama3-8b"), num_layers=2)
    cuda = torch.device("cuda")
    model = Model(config, random_weights(config, torch.bfloat16, cuda), dtype=torch.bfloat16, device=cuda,
                  settings=Settings(rope_append=False))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (1, 7, 100)]

    def prefill_and_decode() -> torch.Tensor:
        runner = PagedRunner(model, num_pages=128, page_size=16)
        first = runner.prefill(prompts)
        return torch.stack([first, runner.decode(first.argmax(-1).tolist())])

    want = prefill_and_decode()
    model.settings = Settings(rope_append=True)
    assert torch.equal(prefill_and_decode(), want)


@needs_interpreter
def test_a_forward_checks_its_launch_arguments_on_the_first_layer_only(monkeypatch):
    """The attention launchers check shapes, dtypes and strides once per forward (layer 0): every
    later layer passes tensors of the same metadata (~75 us of host time per layer otherwise)."""
    from disagg.kernels import checks

    model = load_model("dummy:tiny", dtype=torch.float32, device="cpu")
    assert model.config.num_layers >= 2
    calls = []
    checked = checks.check_kv_layer
    monkeypatch.setattr(checks, "check_kv_layer", lambda *a, **k: calls.append(1) or checked(*a, **k))
    baseline = _generate(model, steps=1)  # a prefill forward, then a decode forward
    assert 0 < len(calls) <= 2 * 3, f"{len(calls)} kv checks over {model.config.num_layers} layers"
    monkeypatch.setattr(checks, "check_kv_layer", checked)
    torch.testing.assert_close(_generate(model, steps=1), baseline, rtol=0, atol=0)
