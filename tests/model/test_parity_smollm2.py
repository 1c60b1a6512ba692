"""Our forward on the real SmolLM2-135M-Instruct (fp32, CPU) against transformers' LlamaForCausalLM.

Tolerance: max |ours - theirs| over every compared logit <= 1e-4 x max |theirs| (fp32 throughout;
measured 1.9e-6 .. 2.7e-6 relative, i.e. <= 9e-5 absolute on logits of magnitude ~30). Greedy
tokens are compared too. The 30-layer model runs the kernels' torch references
(TRITON_INTERPRET=0); dummy:tiny covers the Triton kernels themselves.
"""

from __future__ import annotations

import pytest
import torch

from paged_runner import hf_logits_at, paged_vs_full
from disagg.model import load_model

REL_TOL = 1e-4
QUESTIONS = ["Hi", "What is the capital of France? Answer briefly.",
             "Write a short poem about the sea, the wind and the stars over the quiet harbour at night."]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir, device="cpu")


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tok.encode(c, add_special_tokens=False) for c in chats]


def _check_close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    assert rel <= REL_TOL, f"max |ours - transformers| is {rel:.2e} of the logits' scale"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    return rel


def test_smollm2_config_and_tokenizer(smollm2, smollm2_dir, prompts):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_qo_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 1e5 and c.vocab_size == 49152
    assert smollm2.weights.lm_head is smollm2.weights.embed
    assert 2 in smollm2.tokenizer.eos_token_ids
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": QUESTIONS[1]}]
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert smollm2.tokenizer.apply_chat_template(messages) == expected
    ids = smollm2.tokenizer.encode(expected, add_special_tokens=False)
    assert ids == hf_tok(expected, add_special_tokens=False)["input_ids"]
    assert smollm2.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_smollm2_chunked_prefill_then_decode(smollm2, smollm2_hf, prompts, reference_kernels):
    """Prompts of 31, 40 and 50 tokens in 8-token chunks over 16-token pages, then 4 greedy
    decode steps; every step's logits against transformers' full forward of the sequence."""
    ours, positions, tokens = paged_vs_full(smollm2, prompts, chunk=8, num_decode=4, page_size=16)
    _check_close(ours, hf_logits_at(smollm2_hf, tokens, positions))
    assert smollm2.tokenizer.decode(tokens[1][len(prompts[1]):]).startswith("The capital of France")


def test_smollm2_one_shot_prefill(smollm2, smollm2_hf, prompts, reference_kernels):
    """All three prompts in one forward over 4-token pages (partial last pages)."""
    ours, positions, tokens = paged_vs_full(smollm2, prompts, chunk=None, num_decode=0, page_size=4)
    _check_close(ours, hf_logits_at(smollm2_hf, tokens, positions))
