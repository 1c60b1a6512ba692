"""Presets for `load_model("dummy:<preset>")`: HF-style config dicts of known model shapes.

A dummy model has the preset's shapes and seeded random weights (see `disagg.model.weights.
random_weights`), no tokenizer. Used by CPU tests ("tiny"), by benchmarks and GPU sizing
("llama3-8b"; "llama3.1-8b" for contexts past 8192 tokens; "qwen2.5-32b", "llama3-70b" and
"llama3.1-70b", the models that need a tensor-parallel instance or a derived profile), and to
run the real SmolLM2's shape without its weights ("smollm2-135m").
"""

from __future__ import annotations

from typing import Any

from disagg.model.config import ModelConfig
from disagg.model.errors import ModelConfigError

PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests: every feature small (GQA 2:1, untied head), Triton-interpreter friendly sizes.
    "tiny": dict(
        architectures=["LlamaForCausalLM"], num_hidden_layers=2, hidden_size=64,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct.
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], num_hidden_layers=30, hidden_size=576,
        intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # meta-llama/Meta-Llama-3-8B(-Instruct).
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], num_hidden_layers=32, hidden_size=4096,
        intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128009],
    ),
    # meta-llama/Llama-3.1-8B(-Instruct): llama3-8b's shapes with a 128k context by llama3 RoPE
    # scaling (the 8k-32k long-prompt workload needs more than llama3-8b's 8192 tokens).
    "llama3.1-8b": dict(
        architectures=["LlamaForCausalLM"], num_hidden_layers=32, hidden_size=4096,
        intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
    # Qwen/Qwen2.5-32B-Instruct (config.json; generation_config.json adds eos 151643).
    "qwen2.5-32b": dict(
        architectures=["Qwen2ForCausalLM"], num_hidden_layers=64, hidden_size=5120,
        intermediate_size=27648, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=131072, attention_bias=True,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=[151645, 151643],
    ),
    # meta-llama/Meta-Llama-3-70B(-Instruct).
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"], num_hidden_layers=80, hidden_size=8192,
        intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128009],
    ),
    # meta-llama/Llama-3.1-70B(-Instruct): llama3-70b's shapes with a 128k context by llama3 RoPE
    # scaling (for planning the 8k-32k long-prompt workload).
    "llama3.1-70b": dict(
        architectures=["LlamaForCausalLM"], num_hidden_layers=80, hidden_size=8192,
        intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
}


def preset_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The `ModelConfig` of preset `name` (named "dummy:<name>").

    Args:
        num_layers: decoder layers, cut (or grown) from the preset's with every other shape
            unchanged (named "dummy:<name>-<num_layers>l"); None: the preset's.

    Raises:
        ModelConfigError: an unknown preset; the message lists the known ones.
    """
    if name not in PRESETS:
        raise ModelConfigError(f"source 'dummy:{name}': unknown preset {name!r}; expected one of "
                               f"{', '.join(sorted(PRESETS))}")
    if num_layers is None:
        return ModelConfig.from_hf_dict(PRESETS[name], name=f"dummy:{name}", source=f"preset {name!r}")
    return ModelConfig.from_hf_dict(dict(PRESETS[name], num_hidden_layers=num_layers),
                                    name=f"dummy:{name}-{num_layers}l", source=f"preset {name!r}")
