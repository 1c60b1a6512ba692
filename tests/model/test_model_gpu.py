"""GPU: a llama3-8b-shaped model (2 layers, random weights) built by transformers, loaded by us
in bf16 on CUDA, against transformers; CUDA-graph decode against eager; fp8 KV.

Tolerances (bf16): our logits' max error against transformers run in fp32 on the same bf16
weights is at most 2x transformers' own bf16 error + 0.02 of the logits' scale; over 16 greedy
steps, where tokens first diverge each side's token is in the other's top-5 (vLLM's
check_logprobs_close rule). Run on a GPU host with:

    TRITON_INTERPRET=0 .venv/bin/pytest -q -m gpu tests/model/test_model_gpu.py
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from paged_runner import PagedRunner
from disagg.model import AttentionBatch, load_model

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

NUM_LAYERS = 2
GREEDY_STEPS = 16
TOP_K = 5


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (7, 100, 333, 64)]


def build_llama8b(path):
    """(path, transformers bf16 model, transformers fp32 model of the same bf16 weights): a
    llama3-8b-shaped LlamaForCausalLM of NUM_LAYERS layers, random weights at unit-activation
    scale, saved as bf16 safetensors in `path`; both models on cuda."""
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    model16 = model.to(torch.bfloat16)
    model16.save_pretrained(path)
    return path, model16, copy.deepcopy(model16).float()


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return build_llama8b(tmp_path_factory.mktemp("llama3-8b-2l"))


@pytest.fixture(scope="module")
def ours(llama8b):
    model = load_model(llama8b[0], device="cuda", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.config.num_layers == NUM_LAYERS
    return model


def _hf_last_logits(hf_model, prompts) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([hf_model(torch.tensor([p], device="cuda")).logits[0, -1].float()
                            for p in prompts])


@pytest.mark.parametrize("chunk", [None, 48])
def test_bf16_logits_close_to_transformers(ours, llama8b, chunk):
    _, hf16, hf32 = llama8b
    prompts = _prompts(ours.config.vocab_size)
    mine = PagedRunner(ours, num_pages=128, page_size=16).prefill(prompts, chunk)
    exact, theirs = _hf_last_logits(hf32, prompts), _hf_last_logits(hf16, prompts)
    scale = float(exact.abs().max())
    our_err = float((mine - exact).abs().max()) / scale
    their_err = float((theirs - exact).abs().max()) / scale
    assert our_err <= 2 * their_err + 0.02, f"ours {our_err:.3e} vs transformers bf16 {their_err:.3e}"
    assert (mine.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75


def _top_k_agree(ours_logits, theirs_logits) -> None:
    """vLLM's check_logprobs_close: equal tokens until the first divergence, where each side's
    token must be in the other's top-k; nothing is compared after it."""
    for step, (a, b) in enumerate(zip(ours_logits, theirs_logits)):
        ta, tb = int(a.argmax()), int(b.argmax())
        if ta == tb:
            continue
        assert ta in b.topk(TOP_K).indices.tolist(), f"step {step}: our {ta} not in theirs' top-{TOP_K}"
        assert tb in a.topk(TOP_K).indices.tolist(), f"step {step}: their {tb} not in our top-{TOP_K}"
        return


def test_greedy_16_steps_top5_rule(ours, llama8b):
    _, hf16, _ = llama8b
    prompts = _prompts(ours.config.vocab_size)
    runner = PagedRunner(ours, num_pages=256, page_size=16)
    steps = [runner.prefill(prompts)]
    for _ in range(GREEDY_STEPS - 1):
        steps.append(runner.decode(steps[-1].argmax(-1).tolist()))
    mine = torch.stack(steps, dim=1)  # [n, steps, V]
    for seq, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf16.generate(torch.tensor([prompt], device="cuda"), do_sample=False,
                                max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS,
                                output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        theirs = torch.stack([s[0].float() for s in out.scores])
        _top_k_agree(mine[seq], theirs)


def test_cuda_graph_decode_equals_eager(ours):
    """Capture one decode forward on a static bucket of 8 rows; replay it for 3 steps with 3 live
    sequences (5 padding rows) and compare with eager forwards on a copy of the cache."""
    prompts = _prompts(ours.config.vocab_size)[:3]
    runner = PagedRunner(ours, num_pages=128, page_size=16)
    tokens = runner.prefill(prompts).argmax(-1).tolist()
    static = ours.static_decode_batch(max_batch_size=16, max_pages=128)
    bucket = static.view(8)
    graph_kv = runner.kv.clone()
    # Warm up (Triton compiles) outside the capture, on a throwaway cache, with padding rows only.
    scratch = torch.zeros_like(graph_kv)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ours.forward(bucket.input_ids, bucket, scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_logits = ours.forward(bucket.input_ids, bucket, graph_kv)
    for _ in range(3):
        plan = runner.cache.begin_forward([0, 1, 2], [1, 1, 1])
        try:
            batch = AttentionBatch.from_plan(plan, ours.device, check_indices=False)
            batch.num_splits = bucket.num_splits  # same split count: the same arithmetic
            eager = ours.forward(torch.tensor(tokens, device="cuda"), batch, runner.kv)
            static.copy_from_plan(plan, tokens)
            graph.replay()
        finally:
            runner.cache.end_forward()
        torch.testing.assert_close(graph_logits[:3], eager, atol=0, rtol=0)
        assert torch.equal(graph_kv, runner.kv)
        tokens = eager.argmax(-1).tolist()


def test_fp8_kv_cache(ours):
    prompts = _prompts(ours.config.vocab_size)
    exact = PagedRunner(ours, num_pages=128, page_size=16).prefill(prompts)
    runner = PagedRunner(ours, num_pages=128, page_size=16, kv_dtype=torch.float8_e4m3fn)
    fp8 = runner.prefill(prompts)
    rel = float((fp8 - exact).abs().max() / exact.abs().max())
    assert rel < 0.1, f"fp8 KV moved the logits by {rel:.3f} of their scale"
    decode = runner.decode(fp8.argmax(-1).tolist())
    assert torch.isfinite(decode).all()
