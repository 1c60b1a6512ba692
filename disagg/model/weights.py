"""Model weights: read an HF checkpoint's safetensors straight to the device, or make random ones.

`load_model` calls `load_checkpoint` for a model directory and `random_weights` for a preset.
Either way the result is a `ModelWeights` whose projections are already fused the way the model
runs them: q/k/v as one `[q + 2 kv, hidden]` matrix (one GEMM per layer), gate/up as one
`[2 * intermediate, hidden]` matrix. Every HF tensor name is checked before anything is read:
a missing, unexpected or misshaped tensor is a `WeightsError` naming the file and the tensor.

A tensor-parallel rank holds only its slices (`disagg.model.shard`): `load_checkpoint` reads
them alone from the files (safetensors `get_slice`), `random_weights` makes each full tensor of
the one-rank model from the same seeded stream and keeps the rank's part, so every degree runs
the same model and at most one full tensor is alive at a time.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from disagg.model.config import ModelConfig
from disagg.model.errors import WeightsError
from disagg.model.shard import Shard, pad_vocab_rows, take
from disagg.parallel import SINGLE, TPGroup

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes; read past, never an error.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    """One decoder layer, `H` = hidden, `I` = intermediate, `Q`/`KV` = q/kv projection widths
    (a tensor-parallel rank's own: its heads' and its MLP columns').

    Attributes:
        input_norm: `[H]` RMSNorm before attention.
        qkv: `[Q + 2 KV, H]` q, k, v projections stacked (rows in that order).
        qkv_bias: `[Q + 2 KV]` or None.
        o_proj: `[H, Q]`.
        post_norm: `[H]` RMSNorm before the MLP.
        gate_up: `[2 I, H]` gate and up projections stacked.
        down: `[H, I]`.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class ModelWeights:
    """Every tensor of the model: `embed` `[V, H]`, `layers`, final `norm` `[H]`, `lm_head`
    `[V, H]` (the same tensor as `embed` when the embeddings are tied). A tensor-parallel rank's
    `embed` and `lm_head` are its `[Shard.vocab_rows, H]` rows."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a checkpoint of `config` (lm_head only when untied)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                          "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for proj, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (rows, c.hidden_size)
            if c.attention_bias:
                shapes[p + f"self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def load_checkpoint(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device, tp: TPGroup | None = None) -> ModelWeights:
    """Read every tensor of an HF checkpoint (one file, several, or sharded with an index), or
    only tensor-parallel rank `tp.rank`'s slices of them.

    Args:
        model_dir: directory with `*.safetensors` (and `model.safetensors.index.json` if sharded).
        config: the checkpoint's config (gives the expected names and shapes).
        dtype: the model's dtype; tensors are cast after loading on `device`.
        device: where the tensors are loaded (safetensors reads straight to it).
        tp: the rank's group (`SINGLE`, the whole model, when None).

    Raises:
        WeightsError: no weights, a missing or unreadable file, a missing, unexpected or
            misshaped tensor (the message names the file and the tensor).
        ModelConfigError: `tp.size` cannot split the model (`disagg.model.shard`).
    """
    tp = SINGLE if tp is None else tp
    shard = Shard.of(config, tp.rank, tp.size)
    locations = _tensor_locations(Path(model_dir))
    _check_names_and_shapes(locations, expected_shapes(config), config.tie_word_embeddings)
    by_file: dict[Path, list[str]] = {}
    for name, path in locations.items():
        by_file.setdefault(path, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    target = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
    for path, names in by_file.items():
        with _open(path, target) as f:
            for name in names:
                if not name.endswith(IGNORED_SUFFIXES):
                    tensors[name] = _read(f, name, shard).to(dtype)
    logger.info("loaded %d tensors from %d file(s) in %s (rank %d of %d)", len(tensors),
                len(by_file), model_dir, tp.rank, tp.size)
    return _fuse(tensors, config, shard)


def _read(f, name: str, shard: Shard) -> torch.Tensor:
    """Tensor `name` of open file `f`, or only the rows or columns of it that `shard` holds."""
    part = shard.hf_slice(name)
    if part is None:
        return f.get_tensor(name)
    dim, (start, stop) = part
    rows = f.get_slice(name)
    return rows[start:stop] if dim == 0 else rows[:, start:stop]


def _open(path: Path, device: str):
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (OSError, SafetensorError) as exc:
        raise WeightsError(f"{path}: cannot read safetensors file: {exc}") from exc


def check_checkpoint_present(model_dir: Path) -> None:
    """Raises WeightsError when ``model_dir`` holds neither the shard index nor a *.safetensors file
    (checked before Ray starts by the cluster's preflight, and again when the weights load)."""
    if not (model_dir / INDEX_FILE).is_file() and not any(model_dir.glob("*.safetensors")):
        raise WeightsError(f"{model_dir} has no *.safetensors files (nor {INDEX_FILE}); an HF model "
                           "directory holds config.json and its weights")


def _tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the shard index or by listing every file."""
    if not model_dir.is_dir():
        raise WeightsError(f"{model_dir}: not a directory")
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: cannot read the shard index ('weight_map'): {exc}") from exc
        locations = {name: model_dir / file for name, file in weight_map.items()}
        for name, path in locations.items():
            if not path.is_file():
                raise WeightsError(f"{index}: tensor {name!r} is in {path.name}, which does not exist")
        return locations
    check_checkpoint_present(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    locations = {}
    for path in files:
        with _open(path, "cpu") as f:
            for name in f.keys():
                if name in locations:
                    raise WeightsError(f"{path}: tensor {name!r} is also in {locations[name]}")
                locations[name] = path
    return locations


def _check_names_and_shapes(locations: dict[str, Path], expected: dict[str, tuple[int, ...]],
                            tied: bool) -> None:
    for name, shape in expected.items():
        if name not in locations:
            where = ", ".join(sorted({p.name for p in locations.values()}))
            raise WeightsError(f"tensor {name!r} (shape {list(shape)}) is missing from {where}")
    for name, path in locations.items():
        allowed = name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")
        if name not in expected and not allowed:
            raise WeightsError(f"{path}: unexpected tensor {name!r} (not part of this architecture)")
    opened: dict[Path, list[str]] = {}
    for name, path in locations.items():
        if name in expected:
            opened.setdefault(path, []).append(name)
    for path, names in opened.items():
        with _open(path, "cpu") as f:
            for name in names:
                got = tuple(f.get_slice(name).get_shape())
                if got != expected[name]:
                    raise WeightsError(f"{path}: tensor {name!r} has shape {list(got)}, expected "
                                       f"{list(expected[name])}")


def _fuse(t: dict[str, torch.Tensor], config: ModelConfig, shard: Shard) -> ModelWeights:
    """Stack q/k/v and gate/up per layer (the HF tensors are dropped as they are consumed); pad
    a short vocabulary shard."""
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = [t.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        bias = [t.pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"] if config.attention_bias else None
        gate_up = [t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")]
        layers.append(LayerWeights(
            input_norm=t.pop(p + "input_layernorm.weight"), qkv=torch.cat(qkv),
            qkv_bias=torch.cat(bias) if bias else None, o_proj=t.pop(p + "self_attn.o_proj.weight"),
            post_norm=t.pop(p + "post_attention_layernorm.weight"), gate_up=torch.cat(gate_up),
            down=t.pop(p + "mlp.down_proj.weight"),
        ))
    embed = pad_vocab_rows(t.pop("model.embed_tokens.weight"), shard)
    lm_head = embed if config.tie_word_embeddings else pad_vocab_rows(t.pop("lm_head.weight"), shard)
    return ModelWeights(embed=embed, layers=layers, norm=t.pop("model.norm.weight"), lm_head=lm_head)


def random_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                   seed: int = 0, tp: TPGroup | None = None) -> ModelWeights:
    """Seeded random weights of `config`'s shapes, made on `device` in `dtype`; with `tp`, rank
    `tp.rank`'s slices of the same weights (each full tensor made, sliced, dropped in turn).

    Scaled so activations keep unit size through any depth: projections ~ N(0, 1/fan_in), norms
    ~ 1 + N(0, 0.1^2), embeddings N(0, 1) (untied) or N(0, 1/hidden) (tied, so the head's logits
    have unit size too). Logits are then O(1) and differ from token to token, so greedy decoding
    does not collapse onto one token.

    Raises:
        ModelConfigError: `tp.size` cannot split the model (`disagg.model.shard`).
    """
    tp = SINGLE if tp is None else tp
    shard = Shard.of(config, tp.rank, tp.size)
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def part(full: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
        return full if shard.size == 1 else take(full, dim, spans)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(std)

    def linear(rows: int, fan_in: int) -> torch.Tensor:
        return normal(rows, fan_in, std=1.0 / math.sqrt(fan_in))

    def norm() -> torch.Tensor:
        return normal(c.hidden_size, std=0.1).add_(1.0)

    def vocab_rows(full: torch.Tensor) -> torch.Tensor:
        return full if shard.size == 1 else pad_vocab_rows(take(full, 0, [shard.vocab_range]), shard)

    # Drawn in the one-rank order (the stream decides the values): layer by layer, then the rest.
    qkv_rows, qkv_spans = c.q_size + 2 * c.kv_size, shard.qkv_spans()
    mlp_spans, q_cols, mlp_cols = shard.gate_up_spans(), [shard.q_span()], [shard.mlp_span()]
    layers = [LayerWeights(
        input_norm=norm(), qkv=part(linear(qkv_rows, c.hidden_size), 0, qkv_spans),
        qkv_bias=part(normal(qkv_rows, std=0.1), 0, qkv_spans) if c.attention_bias else None,
        o_proj=part(linear(c.hidden_size, c.q_size), 1, q_cols), post_norm=norm(),
        gate_up=part(linear(2 * c.intermediate_size, c.hidden_size), 0, mlp_spans),
        down=part(linear(c.hidden_size, c.intermediate_size), 1, mlp_cols),
    ) for _ in range(c.num_layers)]
    embed_std = 1.0 / math.sqrt(c.hidden_size) if c.tie_word_embeddings else 1.0
    embed = vocab_rows(normal(c.vocab_size, c.hidden_size, std=embed_std))
    lm_head = embed if c.tie_word_embeddings else vocab_rows(linear(c.vocab_size, c.hidden_size))
    return ModelWeights(embed=embed, layers=layers, norm=norm(), lm_head=lm_head)
