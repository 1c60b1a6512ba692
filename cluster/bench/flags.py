"""`disagg bench`'s flags read into values: rates, SLOs, percentiles, overrides, the server to hit.

Every parser here raises `typer.BadParameter` naming the flag, what was expected and what came,
so a bad value exits 2 before anything launches. `Target` gathers what `--base-url` (or vLLM's
`--host`/`--port`), `--api-key`/`OPENAI_API_KEY`, `--header`, `--model` and `--tokenizer` say
about a running server. Called by command.py in the CLI process.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

import typer

from disagg.cluster.bench.arrivals import parse_rates
from disagg.cluster.bench.metrics import LATENCY_METRICS, parse_goodput
from disagg.cluster.bench.workloads import DATASETS

T = TypeVar("T")
GREEDY_FLAGS = {  # vLLM's nargs options: a following token of this form is one more value
    "--goodput": r"[A-Za-z_]+:[^/=]*",
    "--metadata": r"[A-Za-z_][\w.-]*=.*",
    "--header": r"[A-Za-z_][\w-]*=.*",
}
HTTP_BACKENDS = ("openai", "vllm")  # vLLM's two names for the /v1/completions request


def checked(parse: Callable[[Any], T], value: Any, flag: str) -> T:
    """`parse(value)`, its ValueError turned into typer's usage error for `flag`."""
    try:
        return parse(value)
    except ValueError as err:
        raise typer.BadParameter(str(err).removeprefix(f"{flag}: "), param_hint=flag) from None


def rates(value: Optional[str]) -> Optional[list[float]]:
    return None if value is None else checked(parse_rates, value, "--request-rate")


def goodput(pairs: Optional[list[str]]) -> Optional[dict[str, float]]:
    """vLLM's ``--goodput ttft:500 tpot:50`` (also repeated, or comma-separated) -> {name: ms}."""
    return checked(parse_goodput, pairs, "--goodput") if pairs else None


def positive_floats(value: Optional[str], flag: str) -> Optional[list[float]]:
    if value is None:
        return None
    try:
        numbers = [float(item) for item in value.replace(" ", "").split(",") if item]
    except ValueError:
        raise typer.BadParameter(f"expected numbers separated by commas, got {value!r}", param_hint=flag) from None
    if not numbers or any(not (x > 0 and math.isfinite(x)) for x in numbers):
        raise typer.BadParameter(f"expected positive finite numbers, got {value!r}", param_hint=flag)
    return numbers


def percentiles(value: str) -> tuple[float, ...]:
    numbers = positive_floats(value, "--metric-percentiles") or []
    if any(p >= 100 for p in numbers):
        raise typer.BadParameter(f"expected percentiles in (0, 100), got {value!r}", param_hint="--metric-percentiles")
    return tuple(numbers)


def percentile_metrics(value: Optional[str]) -> tuple[str, ...]:
    """vLLM's ``--percentile-metrics ttft,tpot,itl``: which latencies the console tables show."""
    if value is None:
        return LATENCY_METRICS
    names = tuple(name for name in value.replace(" ", "").split(",") if name)
    unknown = [name for name in names if name not in LATENCY_METRICS]
    if unknown or not names:
        raise typer.BadParameter(f"expected some of {','.join(LATENCY_METRICS)} (comma-separated), got {value!r}"
                                 + ("; vLLM's client queue metrics are not measured here" if unknown else ""),
                                 param_hint="--percentile-metrics")
    return names


def choices(value: str, known: Sequence[str], flag: str, distinct: bool = False) -> list[str]:
    """``a,b,c`` -> [a, b, c], each one of ``known`` (and, with ``distinct``, none twice)."""
    names = [name for name in value.replace(" ", "").split(",") if name]
    if not names or any(name not in known for name in names) or (distinct and len(set(names)) < len(names)):
        raise typer.BadParameter(f"expected one or more{' distinct' if distinct else ''} of {', '.join(known)} "
                                 f"(comma-separated), got {value!r}", param_hint=flag)
    return names


def datasets(value: str) -> list[str]:
    return choices(value, DATASETS, "--dataset-name")


def key_values(specs: Optional[list[str]], flag: str, example: str) -> dict[str, str]:
    """vLLM's ``--metadata k=v k2=v2`` / ``--header k=v`` -> {k: v} (strings, as vLLM keeps them)."""
    pairs = {}
    for spec in specs or []:
        key, sep, value = spec.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected KEY=VALUE such as {example}, got {spec!r}", param_hint=flag)
        pairs[key.strip()] = value.strip()
    return pairs


def overrides(specs: Optional[list[str]]) -> dict[str, Any]:
    """``--set KEY=VALUE`` flags -> dotted overrides of CONFIG (values parsed as YAML scalars)."""
    import yaml

    result = {}
    for spec in specs or []:
        key, sep, value = spec.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE such as router.lease_s=5, got {spec!r}", param_hint="--set")
        result[key] = yaml.safe_load(value)
    return result


def variants(specs: Optional[list[str]]) -> list[dict[str, Any]]:
    """``--compare-variant KEY=V1,V2`` flags -> every combination as dotted overrides."""
    import yaml

    axes = []
    for spec in specs or []:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise typer.BadParameter(f"expected KEY=V1,V2,... such as scheduler.max_num_batched_tokens="
                                     f"512,2048, got {spec!r}", param_hint="--compare-variant")
        axes.append([(key, yaml.safe_load(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else []


@dataclass
class Target:
    """A running OpenAI-compatible server to benchmark (`--base-url`, or vLLM's `--host`/`--port`).

    Attributes:
        base_url: e.g. "http://127.0.0.1:8000".
        endpoint: the completions path.
        api_key: sent as `Authorization: Bearer`; `--api-key`, else $OPENAI_API_KEY (vLLM's).
        headers: extra headers (`--header KEY=VALUE`); they win over the key's header.
        model: the model name to send (`--served-model-name`, else `--model`; None: the first of
            /v1/models). model_id: what the results record as the model (`--model`).
        tokenizer_id: `--tokenizer`, recorded in the results; a local folder also gives the
            vocabulary size when `--vocab-size` is not given.
        insecure: skip TLS certificate checks (`--insecure`).
        ready_timeout_s: wait this long for the server to answer (`--ready-check-timeout-sec`).
    """

    base_url: str
    endpoint: str = "/v1/completions"
    api_key: Optional[str] = None
    headers: dict[str, str] = field(default_factory=dict)
    model: Optional[str] = None
    model_id: Optional[str] = None
    tokenizer_id: Optional[str] = None
    insecure: bool = False
    ready_timeout_s: float = 0.0


def target(base_url: Optional[str], host: Optional[str], port: Optional[int], **fields: Any) -> Optional[Target]:
    """The server named by `--base-url` or `--host`/`--port` (http://HOST:PORT, vLLM's defaults
    127.0.0.1 and 8000 for the one not given); None when neither names one (CONFIG is launched)."""
    if base_url is None and host is None and port is None:
        return None
    if base_url is not None and (host is not None or port is not None):
        raise typer.BadParameter("give --base-url, or --host/--port, not both", param_hint="--base-url")
    if base_url is None:
        host = host or "127.0.0.1"
        base_url = f"http://{f'[{host}]' if ':' in host else host}:{port or 8000}"
    if not base_url.startswith(("http://", "https://")):
        raise typer.BadParameter(f"expected an http:// or https:// URL, got {base_url!r}", param_hint="--base-url")
    return Target(base_url.rstrip("/"), **fields)


def tokenizer_vocab_size(tokenizer: Optional[str]) -> Optional[int]:
    """The vocabulary size of a local `--tokenizer` folder (its config.json), else None."""
    if tokenizer is None or not (Path(tokenizer) / "config.json").is_file():
        return None
    from disagg.model.config import ModelConfig

    try:
        return ModelConfig.from_dir(tokenizer).vocab_size
    except Exception as err:  # a folder we cannot read: say so at the flag that needs it
        raise typer.BadParameter(f"cannot read the vocabulary size from {tokenizer}/config.json ({err}); "
                                 "give --vocab-size", param_hint="--tokenizer") from None
