"""Writes a tiny model directory WITH a tokenizer and a chat template, for the chat route's tests.

Shapes are the `dummy:tiny` preset's; the vocabulary is 256 byte-level tokens (no merges) plus
"<s>" and "</s>"; the weights are seeded random (fp32 safetensors); tokenizer_config.json carries
a small chat template. A few hundred KB, written to a pytest tmp dir, never committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from disagg.model.config import ModelConfig
from disagg.model.presets import PRESETS
from disagg.model.weights import expected_shapes

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
BOS, EOS = "<s>", "</s>"


def write_tiny_hf_dir(folder: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])  # ids 256, 257
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}))
    hf = dict(PRESETS["tiny"], vocab_size=264, bos_token_id=256, eos_token_id=257, torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_dir(folder)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=generator) * (0.02 if len(shape) == 2 else 0.0) +
               (0.0 if len(shape) == 2 else 1.0) for name, shape in expected_shapes(config).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
