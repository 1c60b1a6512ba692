"""`ModelConfig`: the shape and numerics of a Llama-family model, read from an HF config.json.

`load_model` builds one from a model directory (`ModelConfig.from_dir`) or from a preset's dict
(`ModelConfig.from_hf_dict`); the model, the engines (page geometry, context limit) and the
cluster's preflight read it. Both transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters` holding `rope_type` and `rope_theta`) spellings are accepted. Supported
architectures: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias), MistralForCausalLM (without a
sliding window shorter than the context).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.model.errors import ModelConfigError, UnsupportedArchitecture

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# Rope types this model computes; "default" is stored as rope_scaling=None.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """What the model and the engines need to know about a checkpoint.

    Attributes:
        name: the model's name (directory name, or "dummy:<preset>").
        architecture: the HF architecture class name.
        num_layers, hidden_size, intermediate_size, num_qo_heads, num_kv_heads, head_dim,
            vocab_size: the shapes.
        max_position_embeddings: the context limit in tokens.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: None (plain RoPE) or a dict with "rope_type" ("llama3" or "linear") and
            its parameters ("factor", and for llama3 "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings").
        tie_word_embeddings: the LM head reuses the input embedding.
        attention_bias: q/k/v projections have a bias (Qwen2).
        eos_token_ids: every token id that ends a generation (config.json and
            generation_config.json together), possibly empty.
        bos_token_id: the begin-of-sequence id, or None.
        torch_dtype: the checkpoint's dtype name ("bfloat16", ...) or None.
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def q_size(self) -> int:
        """Elements of one token's queries (`num_qo_heads * head_dim`)."""
        return self.num_qo_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Elements of one token's keys, or values (`num_kv_heads * head_dim`)."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read `model_dir/config.json` (and generation_config.json for extra EOS ids).

        Raises:
            ModelConfigError: no or unreadable config.json, a missing or invalid field.
            UnsupportedArchitecture: an architecture, rope type or feature this model lacks.
        """
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        hf = _read_json(path, required=True)
        generation = _read_json(model_dir / "generation_config.json", required=False) or {}
        extra_eos = _as_ids(generation.get("eos_token_id"), model_dir / "generation_config.json")
        return cls.from_hf_dict(hf, name=model_dir.name, source=str(path), extra_eos_ids=extra_eos)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, name: str, source: str = "config.json",
                     extra_eos_ids: tuple[int, ...] = ()) -> "ModelConfig":
        """Build from an HF config dict; `source` names it in errors (a file path or preset)."""
        architecture = _architecture(hf, source)
        _check_features(hf, architecture, source)
        get = lambda key: _field(hf, key, source)
        hidden_size, num_qo_heads = int(get("hidden_size")), int(get("num_attention_heads"))
        num_kv_heads = int(hf.get("num_key_value_heads") or num_qo_heads)
        head_dim = int(hf.get("head_dim") or hidden_size // num_qo_heads)
        if num_qo_heads % num_kv_heads:
            raise ModelConfigError(f"{source}: num_attention_heads={num_qo_heads} must be a multiple "
                                   f"of num_key_value_heads={num_kv_heads}")
        rope_theta, rope_scaling = _rope(hf, source)
        eos = _as_ids(hf.get("eos_token_id"), source)
        eos_ids = tuple(dict.fromkeys(eos + tuple(extra_eos_ids)))
        bias = hf.get("attention_bias")  # Qwen2 configs omit it: their q/k/v always have a bias
        bias = architecture == "Qwen2ForCausalLM" if bias is None else bool(bias)
        return cls(
            name=name, architecture=architecture, num_layers=int(get("num_hidden_layers")),
            hidden_size=hidden_size, intermediate_size=int(get("intermediate_size")),
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            vocab_size=int(get("vocab_size")),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias, eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        )


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelConfigError(f"{path}: no such file; a model directory needs an HF config.json")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _field(hf: dict[str, Any], key: str, source: str) -> Any:
    if hf.get(key) is None:
        raise ModelConfigError(f"{source}: missing field {key!r}")
    return hf[key]


def _architecture(hf: dict[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        raise UnsupportedArchitecture(f"{source}: no 'architectures' field; expected one of "
                                      f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(f"{source}: architecture {archs[0]!r} is not supported; "
                                      f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _check_features(hf: dict[str, Any], architecture: str, source: str) -> None:
    """Refuse what the model would silently compute wrong."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitecture(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    if hf.get("mlp_bias"):
        raise UnsupportedArchitecture(f"{source}: mlp_bias=true is not supported")
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", architecture == "MistralForCausalLM")
    max_pos = hf.get("max_position_embeddings") or 0
    if uses_window and window is not None and int(window) < int(max_pos):
        raise UnsupportedArchitecture(f"{source}: sliding_window={window} (shorter than "
                                      f"max_position_embeddings={max_pos}) is not supported")


def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either transformers spelling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"{source}: rope_parameters: expected an object, got {params!r}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitecture(f"{source}: rope type {rope_type!r} is not supported; "
                                      f"expected one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    keys = _LLAMA3_KEYS if rope_type == "llama3" else ("factor",)
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ModelConfigError(f"{source}: {rope_type} rope scaling lacks {', '.join(missing)}")
    scaling = {"rope_type": rope_type, **{k: float(params[k]) for k in keys}}
    return float(theta), scaling


def _as_ids(value: Any, source: str | Path) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ModelConfigError(f"{source}: eos_token_id: expected an int or a list of ints, got {value!r}")
