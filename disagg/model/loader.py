"""`load_model(source, *, dtype=None, device=None, tp=None, num_layers=None) -> Model`: the one entry
point to a model.

`source` is an HF directory (config.json, *.safetensors, optional tokenizer files) or
"dummy:<preset>" (see `disagg.model.presets`). Called once per worker process (engine actors,
tests, benchmarks); weights are read straight to `device`. A tensor-parallel rank passes its
`disagg.parallel.TPGroup` and gets its shard of the model (`disagg.model.shard`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from disagg.model.config import ModelConfig
from disagg.model.errors import ModelConfigError
from disagg.model.llama import Model
from disagg.model.presets import preset_config
from disagg.model.tokenizer import Tokenizer
from disagg.model.weights import load_checkpoint, random_weights
from disagg.parallel import SINGLE, TPGroup
from disagg.settings import Settings

logger = logging.getLogger(__name__)

DUMMY_PREFIX = "dummy:"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model(source: str | Path, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None, seed: int = 0,
               settings: Settings | None = None, tp: TPGroup | None = None,
               num_layers: int | None = None) -> Model:
    """Load a model directory or build a dummy preset.

    Args:
        source: an HF model directory, or "dummy:<preset>" (seeded random weights).
        dtype: torch dtype or its name ("bfloat16", "float16", "float32", "auto"/None). Default:
            float32 on CPU; on CUDA the checkpoint's bf16/fp16, else bfloat16.
        device: default "cuda" when available, else "cpu".
        seed: dummy presets only: the weights' seed.
        settings: the kernel switches (`disagg.settings.Settings`); default: the defaults
            overridden by the DISAGG_* environment variables, read now, once.
        tp: this process's tensor-parallel group (`SINGLE` when None): the model is rank
            `tp.rank`'s shard, its forwards communicate over `tp`. Every rank of a group loads
            the same source with the same seed.
        num_layers: dummy presets only: decoder layers instead of the preset's, every other
            shape unchanged (`preset_config`; the config's ``model.num_layers``). None: the
            preset's.

    Raises:
        ModelConfigError, UnsupportedArchitecture: bad or unsupported config / preset / dtype,
            ``num_layers`` with a source that is no dummy preset, or a `tp.size` that does not
            split the model's heads or MLP width.
        WeightsError: missing or unreadable weights, missing/unexpected/misshaped tensors.
        ConfigError: a DISAGG_* kernel switch holds a value it does not have.
    """
    settings = Settings.from_env() if settings is None else settings  # before any weight is read
    tp = SINGLE if tp is None else tp
    device = _resolve_device(device)
    source = str(source)
    if source.startswith(DUMMY_PREFIX):
        config = preset_config(source[len(DUMMY_PREFIX):], num_layers)
        dtype = _resolve_dtype(dtype, config, device)
        weights = random_weights(config, dtype, device, seed=seed, tp=tp)
        tokenizer = None
    elif num_layers is not None:
        raise ModelConfigError(f"num_layers ({num_layers}): applies to '{DUMMY_PREFIX}<preset>' sources only, "
                               f"got source {source!r}; leave it None to load the checkpoint's layers")
    else:
        model_dir = Path(source).expanduser()
        if not model_dir.is_dir():
            raise ModelConfigError(f"source {source!r}: expected an HF model directory or "
                                   f"'{DUMMY_PREFIX}<preset>', got a path that is not a directory")
        config = ModelConfig.from_dir(model_dir)
        dtype = _resolve_dtype(dtype, config, device)
        weights = load_checkpoint(model_dir, config, dtype, device, tp=tp)
        tokenizer = Tokenizer.from_dir(model_dir, config) if (model_dir / "tokenizer.json").is_file() else None
    logger.info("model %s: %d layers, %s on %s, tensor-parallel rank %d of %d", config.name,
                config.num_layers, dtype, device, tp.rank, tp.size)
    return Model(config, weights, dtype=dtype, device=device, tokenizer=tokenizer, settings=settings,
                 tp=tp)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig,
                   device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ModelConfigError(f"dtype: expected one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelConfigError(f"dtype: expected float32, bfloat16 or float16, got {resolved}")
    return resolved
