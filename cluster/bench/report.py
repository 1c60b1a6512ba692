"""Result files and console tables of the bench.

A result is one JSON object per run (one config, one rate): vLLM's aggregate keys, vLLM's
per-request lists (``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``latencies``,
``start_times``, ``errors``) plus ours (``successes``, ``expected_output_lens``,
``client_overheads``), and what produced it (config, workload, git commit, device, date). The
aggregates recompute from the lists (`recompute_metrics`), so a result can be checked, or
re-judged under other SLOs, without the run. Runs in the bench process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import subprocess
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from disagg.cluster.bench.metrics import DEFAULT_PERCENTILES, RequestOutput, compute_metrics
from disagg.cluster.bench.runner import RunResult

REPO_ROOT = Path(__file__).resolve().parents[2]
PER_REQUEST_KEYS = ("input_lens", "output_lens", "expected_output_lens", "ttfts", "itls", "latencies",
                    "start_times", "successes", "errors", "client_overheads")


def git_commit() -> str | None:
    """HEAD of the repository the bench runs from, with "-dirty" when files are modified."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def device_info() -> dict[str, Any]:
    """The host and its GPUs as nvidia-smi names them (an empty list on a CPU-only host)."""
    gpus: list[str] = []
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
        if names.returncode == 0:
            gpus = [line.strip() for line in names.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return {"host": platform.node(), "platform": platform.platform(), "gpus": gpus}


def rate_to_json(rate: float) -> float | str:
    """vLLM writes an infinite rate as "inf" (strict JSON has no infinity); burstiness likewise."""
    return "inf" if math.isinf(rate) else rate


def rate_from_json(rate: float | str) -> float:
    return float(rate)


def build_result(run: RunResult, *, goodput_slos_ms: Mapping[str, float] | None = None,
                 percentiles: Sequence[float] = DEFAULT_PERCENTILES, label: str = "",
                 workload: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The result object of one run (see the module docstring for its keys).

    Times are stored to the microsecond (a decode-heavy run holds ~10^6 gaps); the aggregates
    are computed from those stored values, so they recompute exactly.
    """
    outputs = [_to_microseconds(out) for out in run.outputs]
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "label": label, "backend": "disagg",
        "request_rate": rate_to_json(run.request_rate), "burstiness": rate_to_json(run.burstiness),
        "max_concurrency": run.max_concurrency, "num_prompts": len(outputs),
        "goodput": dict(goodput_slos_ms or {}), "percentiles": list(percentiles),
        "duration": run.duration_s,
    }
    result.update(compute_metrics(outputs, run.duration_s, goodput_slos_ms, percentiles))
    result.update({
        "input_lens": [out.prompt_len for out in outputs],
        "output_lens": [out.output_len for out in outputs],
        "expected_output_lens": [out.expected_output_len for out in outputs],
        "ttfts": [out.ttft for out in outputs],
        "itls": [list(out.itl) for out in outputs],
        "latencies": [out.latency for out in outputs],
        "start_times": [out.start_time for out in outputs],
        "successes": [out.success for out in outputs],
        "errors": [out.error for out in outputs],
        "client_overheads": [list(out.client_overheads) for out in outputs],
        "workload": dict(workload or {}), "config": dict(config or {}),
        "git_commit": git_commit(), "device": device_info(),
    })
    result.update(extra or {})
    return result


def _to_microseconds(out: RequestOutput) -> RequestOutput:
    return dataclasses.replace(out, ttft=round(out.ttft, 6), itl=[round(g, 6) for g in out.itl],
                               latency=round(out.latency, 6), start_time=round(out.start_time, 6),
                               client_overheads=[round(c, 6) for c in out.client_overheads])


def outputs_from_result(result: Mapping[str, Any]) -> list[RequestOutput]:
    """Rebuild the per-request records of a result object.

    Raises:
        ValueError: a per-request list is missing or the lists differ in length.
    """
    missing = [key for key in PER_REQUEST_KEYS if key not in result]
    if missing:
        raise ValueError(f"result: expected per-request lists {list(PER_REQUEST_KEYS)}, missing {missing}")
    lengths = {key: len(result[key]) for key in PER_REQUEST_KEYS}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"result: per-request lists differ in length: {lengths}")
    return [RequestOutput(success=bool(ok), prompt_len=int(n_in), output_len=int(n_out), ttft=float(ttft),
                          itl=[float(g) for g in itl], latency=float(lat), start_time=float(t0),
                          error=str(err or ""), expected_output_len=int(n_exp),
                          client_overheads=[float(c) for c in lags])
            for ok, n_in, n_out, n_exp, ttft, itl, lat, t0, err, lags in zip(
                result["successes"], result["input_lens"], result["output_lens"],
                result["expected_output_lens"], result["ttfts"], result["itls"], result["latencies"],
                result["start_times"], result["errors"], result["client_overheads"])]


def recompute_metrics(result: Mapping[str, Any], goodput_slos_ms: Mapping[str, float] | None = None
                      ) -> dict[str, Any]:
    """Aggregate metrics recomputed from a result's own per-request lists.

    Args:
        goodput_slos_ms: judge under these SLOs instead of the result's own.
    """
    slos = result.get("goodput") if goodput_slos_ms is None else goodput_slos_ms
    percentiles = result.get("percentiles") or DEFAULT_PERCENTILES
    return compute_metrics(outputs_from_result(result), float(result["duration"]), slos, percentiles)


def check_result(result: Mapping[str, Any], rel_tol: float = 1e-9) -> None:
    """Raise ValueError naming every aggregate that does not match its recomputation."""
    again = recompute_metrics(result)
    bad = [f"{key}: stored {result.get(key)!r}, recomputed {value!r}" for key, value in again.items()
           if not _same(result.get(key), value, rel_tol)]
    if bad:
        raise ValueError("result: aggregates do not recompute from the per-request lists: " + "; ".join(bad))


def _same(a: Any, b: Any, rel_tol: float) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)


def save_json(obj: Any, path: str | Path) -> Path:
    """Write `obj` as strict JSON (inf/nan become "inf"/"nan" strings, as vLLM writes an infinite
    rate; directories created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(obj), indent=1, allow_nan=False))
    return path


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Mapping):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    return obj


def load_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def run_table(result: Mapping[str, Any]):
    """A rich table of one run, in the order `vllm bench serve` prints its summary."""
    from rich.table import Table

    table = Table(title=f"{result.get('label', '')} @ {result['request_rate']} req/s", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", result["duration"]), ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", result["request_throughput"]),
            ("Request goodput (req/s)", result["request_goodput"]), ("SLO attainment", result["slo_attainment"]),
            ("Output token throughput (tok/s)", result["output_throughput"]),
            ("Total token throughput (tok/s)", result["total_token_throughput"])]
    for name in ("ttft", "tpot", "itl", "e2el", "client_overhead"):
        rows += [(f"{stat.capitalize()} {name.upper()} (ms)", result.get(f"{stat}_{name}_ms"))
                 for stat in ("mean", "median", "p99")]
    for name, value in rows:
        table.add_row(name, _fmt(value))
    return table


def comparison_table(summary: Mapping[str, Any]):
    """A rich table: per SLO scale, each side's per-GPU goodput and side 0's ratio to the best other."""
    from rich.table import Table

    sides = [side["label"] for side in summary["sides"]]
    table = Table(title=f"Per-GPU goodput (req/s/GPU at >= {summary['comparison']['target_attainment']:.0%} "
                        f"SLO attainment); base SLOs {summary['slos_ms']} ms")
    for header in ["SLO scale", *sides, "ratio (best own / best other)"]:
        table.add_column(header, justify="right")
    for row in summary["comparison"]["rows"]:
        cells = [_fmt(row["scale"])]
        for label in sides:
            value, bound = row["per_gpu_goodput"][label], row["bound"][label]
            cells.append(_fmt(value) + {"at_least": "+", "below_range": " (<min)"}.get(bound, ""))
        own = row.get("best_own", sides[0])
        cells.append(_fmt(row["ratio"]) + (f" ({own} vs {row['best_other']})" if row["best_other"] else ""))
        table.add_row(*cells)
    return table


def markdown_summary(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """One Markdown table over workloads and SLO scales: who wins, by how much (for a README).

    Goodputs are req/s/GPU at >= 90% attainment; "+" marks a lower bound (every swept rate held),
    "<" an upper bound (even the lowest rate missed); p99s are at each workload's common rate.
    """
    lines = ["| workload | SLO scale | SLOs (ms) | under test | goodput | best other | goodput | ratio | "
             "p99 TTFT (ms) | p99 TPOT (ms) |", "|" + " --- |" * 10]
    for dataset, summary in summaries.items():
        common = summary.get("at_common_rate") or {}
        for row in summary["comparison"]["rows"]:
            first = row.get("best_own", summary["sides"][0]["label"])
            other = row["best_other"]
            tails = [common.get(label) or {} for label in (first, other)]
            slos = ", ".join(f"{k} {v:.0f}" for k, v in row["slos_ms"].items())
            lines.append(f"| {dataset} | {row['scale']:g} | {slos} | {first} | {_bounded(row, first)} | "
                         f"{other or '-'} | {_bounded(row, other) if other else '-'} | {_fmt(row['ratio'])} | "
                         + " | ".join(" / ".join(_fmt(t.get(key)) for t in tails) for key in ("p99_ttft_ms", "p99_tpot_ms"))
                         + " |")
    return "\n".join(lines) + "\n"


def _bounded(row: Mapping[str, Any], label: str) -> str:
    mark = {"at_least": "+", "below_range": "<"}.get(row["bound"][label], "")
    return f"{_fmt(row['per_gpu_goodput'][label])}{mark}"


def common_rate_table(summary: Mapping[str, Any]):
    """A rich table of each side at the common rate: p99 TTFT/TPOT, attainment, client overhead,
    busy fraction per instance (from cluster stats' busy_s) and GPU utilization (nvidia-smi)."""
    from rich.table import Table

    common = summary.get("at_common_rate") or {}
    table = Table(title=f"At a common rate ({common.get('rate', '-')} req/s)")
    for header in ("deployment", "p99 TTFT (ms)", "p99 TPOT (ms)", "attainment", "client overhead (ms)",
                   "busy fraction per instance", "GPU utilization (nvidia-smi)"):
        table.add_column(header, justify="right")
    for side in summary["sides"]:
        row = common.get(side["label"]) or {}
        table.add_row(side["label"], _fmt(row.get("p99_ttft_ms")), _fmt(row.get("p99_tpot_ms")),
                      _fmt(row.get("attainment")), _fmt(row.get("mean_client_overhead_ms")),
                      _fractions(row.get("busy_fraction")), _fractions(row.get("gpu_utilization")))
    return table


def _fractions(values: Mapping[str, float] | None) -> str:
    return " ".join(f"{name}={value:.2f}" for name, value in (values or {}).items()) or "-"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
