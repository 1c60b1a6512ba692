"""The kernel switches of a model, one typed object: `Settings` (the config's `kernels:` section).

Each performance switch is listed once, below: its name in the YAML, its allowed values, its
default, what it changes, and the environment variable that overrides it for benchmarks and A/B
runs (`DISAGG_LINEAR=cublas python benchmarks/bench_engine.py ...`). The environment is read once
per model, by `Settings.from_env(base)`: `disagg.model.load_model` calls it when it builds a model
(base: the defaults), and a fleet's launcher calls it before the config leaves for the actors
(`Config.with_environment`, base: the file's section), so actors on other hosts run with the
launcher's switches and read no environment of their own.

A model's forward makes its settings current on its thread (`active`); the layer ops of
`disagg.model.layers` and the kernel launchers ask `current()`, never `os.environ`. Outside any
forward (a test or a micro-benchmark calling a layer op directly) `current()` reads the
environment at that call.

Environment variables that are not kernel switches stay environment-only: `DISAGG_LOG` (log level
of the CLI and its actors), `DISAGG_CACHE_DIR` (where the converted SmolLM2 weights are cached,
default ~/.cache/disagg), `DISAGG_API_KEY` (the HTTP bearer token when `serve.api_key` is null),
`DISAGG_TRACE_DIR` (event traces of requests and step loops, `disagg.trace`).
Pure Python (pydantic only): imported by the config, the model and the kernels.
"""

from __future__ import annotations

import contextlib
import os
import threading
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from disagg.errors import ConfigError


def _switch(default: Any, env: str, description: str) -> Any:
    return Field(default, description=description, json_schema_extra={"env": env})


class Settings(BaseModel):
    """Which kernels a model's forward runs; every choice gives the same tokens up to rounding.

    Booleans are spelled 1 / 0 in the environment. The defaults are measured on an H200, llama3-8b
    bf16 (`benchmarks/bench_engine.py`; benchmarks/records/tuning-notes.md, `disagg.model.layers`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    linear: Literal["auto", "cublas", "triton"] = _switch(
        "auto", "DISAGG_LINEAR",
        "the projections' GEMM for decode-sized batches (<= 64 rows) of 16-bit models: auto takes "
        "the skinny Triton kernel for vocabulary-wide weights (the LM head) and, inside the decode "
        "graphs of <= 16 sequences, for every projection; cublas: torch's F.linear always; triton: "
        "the skinny kernel for every projection")
    blas: Literal["auto", "cublaslt", "cublas"] = _switch(
        "auto", "DISAGG_BLAS",
        "the library of torch's GEMMs in a CUDA forward: auto takes cuBLASLt for forwards of "
        "17-128 tokens, where it is the faster (benchmarks/records/engine-2026-11-25), and cuBLAS otherwise")
    layer_pdl: Literal["auto", True, False] = _switch(
        "auto", "DISAGG_LAYER_PDL",
        "launch the layer kernels with programmatic dependent launch (where Triton has it): auto "
        "inside the decode graphs of <= 16 sequences, where it shortens the step (larger batches "
        "lose; benchmarks/records/engine-2026-11-25), true everywhere, false never")
    rope_append: bool = _switch(
        True, "DISAGG_ROPE_APPEND",
        "RoPE and the K/V append as one kernel launch per layer when the cache has the "
        "activations' dtype (one launch fewer per layer); false: two launches")
    fused_layers: bool = _switch(
        True, "DISAGG_FUSED_LAYERS",
        "on CUDA, norms, RoPE and the SwiGLU activation as fused Triton kernels (fewer launches "
        "and memory passes than torch's ops); false: torch's ops, for comparison (Triton's "
        "interpreter always runs them)")
    prefill_attention: Literal["auto", "paged", "split"] = _switch(
        "auto", "DISAGG_PREFILL_ATTENTION",
        "the attention of prompt chunks: paged: paged_prefill over the whole sequence in the "
        "pages; split: the chunk's own tokens through cuDNN's dense causal attention and the "
        "cached prefix through paged_prefill, merged by log-sum-exp (disagg.kernels.split_prefill; "
        "eager forwards and piecewise prompt graphs, one prompt per forward); auto: split on CUDA "
        "for 16-bit caches and chunks averaging >= 8192 tokens, paged otherwise")

    @field_validator("layer_pdl", mode="before")
    @classmethod
    def _auto_or_bool(cls, value: object) -> object:
        if value != "auto" and not isinstance(value, bool):  # the Literal alone takes 1 for True
            raise ValueError(f"expected 'auto', true or false, got {value!r}")
        return value

    @classmethod
    def from_env(cls, base: Settings | None = None, environ: Mapping[str, str] | None = None) -> Settings:
        """``base`` (default: the defaults) with each switch whose variable is set replaced.

        Args:
            base: the settings the environment overrides (a config's `kernels` section).
            environ: the variables to read; default `os.environ`, read now, once.

        Raises:
            ConfigError: a variable holds a value the switch does not have; the message names
                the variable, the allowed values and the value given.
        """
        base = cls() if base is None else base
        environ = os.environ if environ is None else environ
        changes = {name: _parse(name, variable, environ[variable])
                   for name, variable in ENV_VARS.items() if variable in environ}
        return base.model_copy(update=changes) if changes else base

    def differences(self, other: Settings) -> dict[str, Any]:
        """The switches whose value here differs from ``other``'s: name -> value here."""
        return {name: getattr(self, name) for name in ENV_VARS if getattr(self, name) != getattr(other, name)}


ENV_VARS: dict[str, str] = {name: field.json_schema_extra["env"]
                            for name, field in Settings.model_fields.items()}


def allowed_values(name: str) -> tuple[Any, ...]:
    """The values switch ``name`` takes (a bool switch: True, False)."""
    annotation = Settings.model_fields[name].annotation
    return (True, False) if annotation is bool else typing.get_args(annotation)


def _parse(name: str, variable: str, text: str) -> Any:
    """The value of switch ``name`` spelled ``text`` in the environment (booleans as 1 / 0)."""
    spelled = {"1" if value is True else "0" if value is False else value: value
               for value in allowed_values(name)}
    if text not in spelled:
        raise ConfigError(f"{variable}: expected one of {', '.join(spelled)} (the kernels.{name} "
                          f"switch), got {text!r}")
    return spelled[text]


_current = threading.local()


@contextlib.contextmanager
def active(settings: Settings) -> Iterator[None]:
    """Make ``settings`` what `current()` returns on this thread inside the block; nests."""
    previous = getattr(_current, "settings", None)
    _current.settings = settings
    try:
        yield
    finally:
        _current.settings = previous


def current() -> Settings:
    """The settings of the forward running on this thread, else the environment's (read now)."""
    settings = getattr(_current, "settings", None)
    return settings if settings is not None else Settings.from_env()
