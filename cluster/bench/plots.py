"""PNG plots of a comparison (matplotlib, Agg backend: no display needed).

`write_all` draws, from the stored results of every side: SLO attainment vs per-GPU rate (the
DistServe figure, with the 90% line), TTFT and TPOT CDFs at a common rate, output throughput vs
offered rate, and attainment vs SLO scale at the common rate. The common rate is the highest
rate every side ran at while still holding >= 50% attainment (else the lowest common rate), so
the CDFs compare loaded but not collapsed systems. Runs in the bench process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from disagg.cluster.bench.compare import TARGET_ATTAINMENT, attainment_of, slo_scale_curve
from disagg.cluster.bench.report import outputs_from_result, rate_from_json


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def common_rate(by_label: Mapping[str, Sequence[Mapping[str, Any]]], slos_ms: Mapping[str, float]) -> float | None:
    """The rate the CDF plots compare at (see the module docstring); None when sides share none."""
    rate_sets = [{rate_from_json(r["request_rate"]) for r in results} for results in by_label.values()]
    common = sorted(r for r in set.intersection(*rate_sets) if math.isfinite(r)) if rate_sets else []
    if not common:
        return None
    holding = [rate for rate in common
               if all(attainment_of(_at(results, rate), slos_ms) >= 0.5 for results in by_label.values())]
    return holding[-1] if holding else common[0]


def _at(results: Sequence[Mapping[str, Any]], rate: float) -> Mapping[str, Any]:
    return next(r for r in results if rate_from_json(r["request_rate"]) == rate)


def write_all(by_label: Mapping[str, Sequence[Mapping[str, Any]]], summary: dict[str, Any],
              out_dir: str | Path) -> list[str]:
    """Draw every plot of the comparison into `out_dir`; return the file paths.

    Also stores the common rate and each side's p99 TTFT/TPOT there into `summary["at_common_rate"]`.
    """
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slos = summary["slos_ms"]
    sides = {side["label"]: side for side in summary["sides"]}
    files = [_attainment_vs_rate(plt, sides, out_dir / "attainment_vs_rate.png"),
             _throughput_vs_rate(plt, sides, out_dir / "throughput_vs_rate.png")]
    rate = common_rate(by_label, slos)
    if rate is not None:
        at_rate = {label: _at(results, rate) for label, results in by_label.items()}
        summary["at_common_rate"] = {"rate": rate, **{label: {
            "p99_ttft_ms": r["p99_ttft_ms"], "p99_tpot_ms": r["p99_tpot_ms"],
            "attainment": attainment_of(r, slos), "busy_fraction": r.get("busy_fraction"),
            "gpu_utilization": r.get("gpu_utilization"),
            "mean_client_overhead_ms": r.get("mean_client_overhead_ms"),
            "slo_scale_curve": slo_scale_curve(r, slos, summary["slo_scales"])}
            for label, r in at_rate.items()}}
        files.append(_cdf(plt, at_rate, "ttft", rate, slos, out_dir / "ttft_cdf.png"))
        files.append(_cdf(plt, at_rate, "tpot", rate, slos, out_dir / "tpot_cdf.png"))
        files.append(_slo_scale(plt, at_rate, slos, summary["slo_scales"], rate, out_dir / "attainment_vs_slo_scale.png"))
    return [str(f) for f in files]


def _attainment_vs_rate(plt, sides: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, side in sides.items():
        points = sorted((r / side["num_gpus"], a) for r, a in zip(side["rates"], side["attainment"]) if math.isfinite(r))
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.axhline(TARGET_ATTAINMENT, color="grey", linestyle="--", linewidth=1, label="90% target")
    ax.set(xlabel="request rate per GPU (req/s/GPU)", ylabel="SLO attainment", ylim=(0, 1.05),
           title="SLO attainment vs rate")
    return _save(plt, fig, ax, path)


def _throughput_vs_rate(plt, sides: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, side in sides.items():
        points = sorted((r, t) for r, t in zip(side["rates"], side["output_throughput"]) if math.isfinite(r))
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set(xlabel="offered request rate (req/s)", ylabel="output tokens/s", title="Output throughput vs rate")
    return _save(plt, fig, ax, path)


def _cdf(plt, at_rate: Mapping[str, Mapping[str, Any]], metric: str, rate: float,
         slos: Mapping[str, float], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, result in at_rate.items():
        outputs = [out for out in outputs_from_result(result) if out.success]
        values = [out.ttft if metric == "ttft" else out.tpot for out in outputs]
        values = np.sort([v * 1e3 for v in values if v is not None])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
    if metric in slos:
        ax.axvline(slos[metric], color="grey", linestyle="--", linewidth=1, label=f"SLO {slos[metric]:.0f} ms")
    ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of requests", ylim=(0, 1.02),
           title=f"{metric.upper()} CDF at {rate:g} req/s")
    return _save(plt, fig, ax, path)


def _slo_scale(plt, at_rate: Mapping[str, Mapping[str, Any]], slos: Mapping[str, float],
               scales: Sequence[float], rate: float, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, result in at_rate.items():
        ax.plot(*zip(*slo_scale_curve(result, slos, scales)), marker="o", label=label)
    ax.axhline(TARGET_ATTAINMENT, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="SLO scale (x base SLOs)", ylabel="SLO attainment", ylim=(0, 1.05),
           title=f"Attainment vs SLO scale at {rate:g} req/s")
    return _save(plt, fig, ax, path)


def _save(plt, fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
