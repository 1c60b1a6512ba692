"""The model's prompt attention through `split_prefill` (kernels.prefill_attention: split) gives the
tokens of the paged path: whole and chunked prompts (chunks after a prefix in pages), ragged
batches, mixed steps beside decodes, fp8 and bfloat16 caches. CPU, dummy:tiny; float32 logits
within 2e-5 (the merge adds one rounding of float32 sums), bfloat16 and fp8 within a few ulp of the
logits' scale, greedy tokens equal."""

from __future__ import annotations

import os

import pytest
import torch

from disagg.model import llama, load_model
from disagg.settings import Settings
from paged_runner import PagedRunner

PROMPTS = [[5, 17, 33, 2, 9, 11, 40, 41, 42, 7], [100, 3, 8], [250, 251, 4, 60, 61, 62, 63]]
SPLIT, PAGED = Settings(prefill_attention="split"), Settings(prefill_attention="paged")
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels: needs TRITON_INTERPRET=1")


def _generate(model, settings, chunk=None, steps=6, kv_dtype=None):
    """Prefill logits then `steps` greedy decode logits, `[steps + 1, n, vocab]`."""
    model.settings = settings
    runner = PagedRunner(model, page_size=4, kv_dtype=kv_dtype)
    logits = [runner.prefill(PROMPTS, chunk)]
    for _ in range(steps):
        logits.append(runner.decode(logits[-1].argmax(-1).tolist()))
    return torch.stack(logits)


def _count_split_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = llama.split_prefill
    monkeypatch.setattr(llama, "split_prefill",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    return calls


@pytest.mark.parametrize("chunk", [None, 3])
def test_split_gives_the_paged_tokens(reference_kernels, monkeypatch, chunk):
    tiny = load_model("dummy:tiny", device="cpu")
    calls = _count_split_calls(monkeypatch)
    split = _generate(tiny, SPLIT, chunk)
    assert calls, "the prompt forwards did not take split_prefill"
    paged = _generate(tiny, PAGED, chunk)
    torch.testing.assert_close(split, paged, atol=2e-5, rtol=1e-5)
    assert torch.equal(split.argmax(-1), paged.argmax(-1))


@needs_interpreter
def test_split_gives_the_paged_tokens_with_the_triton_kernels():
    """The prefix part and the merge in the interpreted paged kernel."""
    tiny = load_model("dummy:tiny", device="cpu")
    split = _generate(tiny, SPLIT, chunk=4, steps=2)
    paged = _generate(tiny, PAGED, chunk=4, steps=2)
    torch.testing.assert_close(split, paged, atol=2e-5, rtol=1e-5)


def test_mixed_step_splits_the_prompt_rows_only(reference_kernels, monkeypatch):
    """Two decodes and a prompt chunk in one forward: the chunk's rows take split_prefill, the
    decodes paged_decode; the logits equal the paged path's."""
    tiny = load_model("dummy:tiny", device="cpu")
    logits = {}
    for name, settings in (("split", SPLIT), ("paged", PAGED)):
        tiny.settings = settings
        runner = PagedRunner(tiny)
        runner.prefill(PROMPTS[:2], chunk=4)
        calls = _count_split_calls(monkeypatch)
        logits[name] = runner.forward({0: [7], 1: [8], 2: PROMPTS[2]})
        assert calls == ([len(PROMPTS[2])] * tiny.config.num_layers if name == "split" else [])
    torch.testing.assert_close(logits["split"], logits["paged"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn)])
def test_split_close_to_paged_in_16_and_8_bits(reference_kernels, dtype, kv_dtype):
    """bfloat16: the own part rounds to bfloat16 before the merge; fp8: the own tokens' K/V are
    read unquantized. Both stay within a small fraction of the logits' scale."""
    tiny = load_model("dummy:tiny", device="cpu", dtype=dtype)
    split = _generate(tiny, SPLIT, chunk=4, steps=3, kv_dtype=kv_dtype).float()
    paged = _generate(tiny, PAGED, chunk=4, steps=3, kv_dtype=kv_dtype).float()
    assert (split - paged).abs().max() < 0.05 * paged.abs().max()
    assert torch.equal(split[0].argmax(-1), paged[0].argmax(-1))


@pytest.mark.gpu
def test_llama8b_shaped_bf16_split_close_to_paged(monkeypatch):
    """On the GPU the own part runs in cuDNN: one 2600-token prompt in chunks of 1100 (the second
    and third after a prefix in pages) with `auto` (its threshold lowered to 1024 tokens to keep
    the model small: chunks of 1100 split, the last of 400 stays paged), then a decode, against
    `paged`."""
    import dataclasses

    from disagg.kernels import split_prefill as split_module
    from disagg.model.llama import Model
    from disagg.model.presets import preset_config
    from disagg.model.weights import random_weights

    config = dataclasses.replace(preset_config("llama3-8b"), num_layers=2)
    cuda = torch.device("cuda")
    model = Model(config, random_weights(config, torch.bfloat16, cuda), dtype=torch.bfloat16, device=cuda)
    prompt = torch.randint(0, config.vocab_size, (2600,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(settings) -> torch.Tensor:
        model.settings = settings
        runner = PagedRunner(model, num_pages=256, page_size=16)
        first = runner.prefill([prompt], chunk=1100)
        return torch.stack([first, runner.decode(first.argmax(-1).tolist())])

    calls = _count_split_calls(monkeypatch)
    monkeypatch.setattr(split_module, "SPLIT_MIN_TOKENS", 1024)
    got = run(Settings(prefill_attention="auto"))
    assert split_module._CudnnState.failed is None, split_module._CudnnState.failed
    assert len(calls) == 2 * config.num_layers  # the chunks of 1100 tokens; the last (400) stays paged
    want = run(PAGED)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-2, f"split vs paged: relative error {rel:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
