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
import hashlib
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
    """HEAD of the repository the bench runs from; when tracked files are modified, "-dirty-"
    and the first 10 hex digits of the SHA-1 of their diff against HEAD: two runs of one tree
    read the same (the GPU hosts receive the working tree with a .git that may lag behind it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=REPO_ROOT, capture_output=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (f"-dirty-{hashlib.sha1(diff).hexdigest()[:10]}" if diff.strip() else "")


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


def run_context(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """When, where and on what a set of runs was made (the head of summary.md): date, commit,
    device, models, rates, prompts per run and the workloads."""
    first = results[0] if results else {}
    rates = sorted({rate_from_json(r["request_rate"]) for r in results})
    return {"date": first.get("date"), "git_commit": first.get("git_commit"),
            "device": describe_device(first.get("device") or {}),
            "models": sorted({f"{r.get('model_id')} ({r.get('dtype') or 'dtype not recorded'})" for r in results
                              if r.get("model_id")}),
            "rates": [rate_to_json(r) for r in rates], "num_prompts": sorted({r["num_prompts"] for r in results}),
            "workloads": {r["workload"].get("dataset_name"): r["workload"] for r in results if r.get("workload")}}


def describe_device(device: Mapping[str, Any]) -> str:
    """'2 x NVIDIA H200, 143771 MiB (host h)' or 'CPU only (host h)'."""
    gpus = list(device.get("gpus") or [])
    host = f" (host {device['host']})" if device.get("host") else ""
    if not gpus:
        return f"CPU only{host}"
    kinds = sorted(set(gpus))
    return ", ".join(f"{gpus.count(kind)} x {kind}" for kind in kinds) + host


def write_markdown(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
