"""Small random checkpoints written by transformers, loaded by us, logits against transformers.

Covers what SmolLM2 does not: llama3 rope scaling, untied embeddings, sharded safetensors with an
index (Llama case); q/k/v bias and tied embeddings (Qwen2 case); the transformers 4.x config
spelling (rope_theta + rope_scaling). Weights are re-drawn at a scale where every feature moves
the logits (transformers zero-initializes biases). fp32 on CPU; tolerance 1e-4 of the logits'
scale (measured ~1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from paged_runner import hf_logits_at, paged_vs_full
from disagg.model import ModelConfig, load_model

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4
SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
PROMPTS = [[3, 50, 7, 9, 100, 12, 13, 77, 21, 4, 5, 6, 90, 91, 92, 93, 8, 30, 31, 32, 33, 34],
           [10, 11], [120, 1, 2, 3, 60, 61, 62, 63, 64]]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def _save(model_cls, config, path, seed: int, **save_kwargs):
    model = model_cls(config).eval()
    _randomize(model, seed)
    model.save_pretrained(path, **save_kwargs)
    return model


def _check_parity(model_dir, hf_model, chunk):
    ours_model = load_model(model_dir, device="cpu")
    ours, positions, tokens = paged_vs_full(ours_model, PROMPTS, chunk=chunk, num_decode=3)
    theirs = hf_logits_at(hf_model, tokens, positions)
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    assert rel <= REL_TOL, f"max |ours - transformers| is {rel:.2e} of the logits' scale"
    return ours_model


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """Llama, llama3 rope scaling, untied head, sharded into several files with an index."""
    path = tmp_path_factory.mktemp("llama3-rope")
    config = transformers.LlamaConfig(**SHAPES, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)
    model = _save(transformers.LlamaForCausalLM, config, path, seed=1, max_shard_size="100KB")
    return path, model


def test_llama3_rope_untied_sharded(llama3_dir, reference_kernels):
    path, hf_model = llama3_dir
    assert (path / "model.safetensors.index.json").is_file()
    model = _check_parity(path, hf_model, chunk=5)
    assert model.config.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert not model.config.tie_word_embeddings
    assert model.weights.lm_head is not model.weights.embed


def test_qwen2_bias_tied(tmp_path, reference_kernels):
    config = transformers.Qwen2Config(**SHAPES, tie_word_embeddings=True, rope_theta=1e6)
    hf_model = _save(transformers.Qwen2ForCausalLM, config, tmp_path, seed=2)
    model = _check_parity(tmp_path, hf_model, chunk=4)
    assert model.config.attention_bias and model.config.tie_word_embeddings
    assert model.weights.layers[0].qkv_bias is not None


def test_transformers4_config_spelling(llama3_dir, tmp_path):
    """rope_theta + rope_scaling (4.x) parse like rope_parameters (5.x); eos lists are kept."""
    path, _ = llama3_dir
    v5 = json.loads((path / "config.json").read_text())
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = LLAMA3_ROPE["rope_theta"]
    v4["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in LLAMA3_ROPE.items()
                          if k != "rope_theta"}
    v4["eos_token_id"] = [2, 7]
    (tmp_path / "config.json").write_text(json.dumps(v4))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    old, new = ModelConfig.from_dir(tmp_path), ModelConfig.from_dir(path)
    assert old.eos_token_ids == (2, 7, 9)
    assert dataclasses.replace(old, name=new.name, eos_token_ids=new.eos_token_ids) == new


def test_defaults_head_dim_and_plain_rope():
    hf = dict(architectures=["MistralForCausalLM"], hidden_size=64, num_attention_heads=8,
              num_hidden_layers=1, intermediate_size=32, vocab_size=10, sliding_window=None)
    config = ModelConfig.from_hf_dict(hf, name="m")
    assert config.head_dim == 8 and config.num_kv_heads == 8 and config.rope_theta == 10000.0
    assert config.rope_scaling is None and config.eos_token_ids == () and not config.attention_bias
