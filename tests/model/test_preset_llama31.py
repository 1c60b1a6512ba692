"""The llama3.1-8b preset: llama3-8b's shapes, a 131072-token context and llama3 RoPE scaling.

The whole preset's random weights (16 GB in bf16) do not fit a CPU test, so the model is built
from a narrow copy of it (fewer layers, heads and vocabulary; the same head_dim and RoPE): what
it rotates with must be transformers' llama3 frequencies of the full preset's config.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from disagg.model import load_model
from disagg.model.config import ModelConfig
from disagg.model.layers import rope_inv_freq
from disagg.model.presets import PRESETS, preset_config

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192.0}


def test_llama31_preset_is_llama3_8b_with_a_128k_context():
    old, new = preset_config("llama3-8b"), preset_config("llama3.1-8b")
    differ = {f.name for f in fields(ModelConfig) if getattr(old, f.name) != getattr(new, f.name)}
    assert differ == {"name", "max_position_embeddings", "rope_scaling", "eos_token_ids"}
    assert new.name == "dummy:llama3.1-8b" and new.max_position_embeddings == 131072
    assert new.rope_theta == 500000.0 and new.rope_scaling == LLAMA3_SCALING
    assert set(old.eos_token_ids) < set(new.eos_token_ids)


def test_llama31_model_rotates_with_llama3_scaled_frequencies(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    narrow = dict(PRESETS["llama3.1-8b"], num_hidden_layers=1, hidden_size=256, intermediate_size=512,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
    monkeypatch.setitem(PRESETS, "llama3.1-8b-narrow", narrow)
    model = load_model("dummy:llama3.1-8b-narrow", device="cpu", dtype="float32")
    assert model.config.rope_scaling == LLAMA3_SCALING and model.config.head_dim == 128

    full = {key: value for key, value in PRESETS["llama3.1-8b"].items() if key != "architectures"}
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**full), "cpu")
    torch.testing.assert_close(model.inv_freq, want.float(), rtol=1e-6, atol=0)

    # Wavelengths under 8192 / 4 tokens keep Llama 3's frequency, those over 8192 are 8x slower,
    # the band between is interpolated.
    plain = rope_inv_freq(128, 500000.0, None, torch.device("cpu"))
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 2048, wavelen > 8192
    assert short.any() and long.any() and (~short & ~long).any()
    torch.testing.assert_close(model.inv_freq[short], plain[short], rtol=0, atol=0)
    torch.testing.assert_close(model.inv_freq[long], plain[long] / 8, rtol=1e-6, atol=0)
    band = ~short & ~long
    assert (model.inv_freq[band] < plain[band]).all() and (model.inv_freq[band] > plain[band] / 8).all()
