"""PNG plots of a comparison (matplotlib, Agg backend: no display needed).

`write_all` draws, from the stored results of every side: SLO attainment vs offered rate per GPU
(the DistServe figure, with the 90% line), output throughput per GPU vs the same axis, TTFT and
TPOT CDFs at a common rate, and attainment vs SLO scale at the common rate ("GPU" reads
"instance" on a CPU fleet). The common rate is the highest
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


STYLES = [dict(marker=m, linestyle=ls, markersize=size, fillstyle=fill) for m, ls, size, fill in (
    ("o", "-", 11, "none"), ("s", "--", 7, "full"), ("^", ":", 6, "full"), ("D", "-.", 5, "full"),
    ("v", "-", 5, "full"), ("x", "--", 6, "full"))]  # first hollow and largest: equal series stay visible


def _style(index: int) -> dict[str, Any]:
    return STYLES[index % len(STYLES)]


def write_all(by_label: Mapping[str, Sequence[Mapping[str, Any]]], summary: dict[str, Any],
              out_dir: str | Path) -> list[str]:
    """Draw every plot of the comparison into `out_dir`; return the file paths.

    Every title names the workload and the SLOs; every rate axis is the offered rate per GPU (per
    instance on a CPU fleet); attainment axes run 0-100% and throughput axes start at 0, so a
    small gap looks small. Also stores the common rate and each side's p99 TTFT/TPOT there into
    `summary["at_common_rate"]`.
    """
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slos = summary["slos_ms"]
    sides = {side["label"]: side for side in summary["sides"]}
    what = _what(summary)
    files = [_attainment_vs_rate(plt, sides, what, out_dir / "attainment_vs_rate.png"),
             _throughput_vs_rate(plt, sides, what, out_dir / "throughput_vs_rate.png")]
    rate = common_rate(by_label, slos)
    if rate is not None:
        at_rate = {label: _at(results, rate) for label, results in by_label.items()}
        summary["at_common_rate"] = {"rate": rate, **{label: {
            "p99_ttft_ms": r["p99_ttft_ms"], "p99_tpot_ms": r["p99_tpot_ms"],
            "attainment": attainment_of(r, slos), "busy_fraction": r.get("busy_fraction"),
            "gpu_utilization": r.get("gpu_utilization"), "host_cpu": r.get("host_cpu"),
            "prefix_hit_rate": (r.get("prefix_cache") or {}).get("hit_rate"),
            "mean_client_overhead_ms": r.get("mean_client_overhead_ms"),
            "slo_scale_curve": slo_scale_curve(r, slos, summary["slo_scales"])}
            for label, r in at_rate.items()}}
        at = f"at {rate:g} req/s offered"
        files.append(_cdf(plt, at_rate, "ttft", f"{what}\nTTFT CDF {at}", slos, out_dir / "ttft_cdf.png"))
        files.append(_cdf(plt, at_rate, "tpot", f"{what}\nTPOT CDF {at}", slos, out_dir / "tpot_cdf.png"))
        files.append(_slo_scale(plt, at_rate, slos, summary["slo_scales"], f"{what}\nattainment vs SLO scale {at}",
                                out_dir / "attainment_vs_slo_scale.png"))
    return [str(f) for f in files]


def _what(summary: Mapping[str, Any]) -> str:
    """The first title line: workload and SLOs."""
    from disagg.cluster.bench.tables import fmt_slos

    return f"workload {summary.get('dataset', '?')}; SLOs {fmt_slos(summary['slos_ms'])}"


def _unit(sides: Mapping[str, Mapping[str, Any]]) -> str:
    units = {side.get("device_unit", "GPU") for side in sides.values()}
    return units.pop() if len(units) == 1 else "GPU or instance"


def _count(num: int, unit: str) -> str:
    return f"{num} {unit}{'' if num == 1 else 's'}"


def _per_unit(side: Mapping[str, Any], values: Sequence[float]) -> list[tuple[float, float]]:
    num = side.get("num_gpus") or 1
    return sorted((r / num, v) for r, v in zip(side["rates"], values) if math.isfinite(r))


def _attainment_vs_rate(plt, sides: Mapping[str, Mapping[str, Any]], what: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    unit = _unit(sides)
    for index, (label, side) in enumerate(sides.items()):
        points = _per_unit(side, side["attainment"])
        if points:
            ax.plot(*zip(*points), label=f"{label} ({_count(side.get('num_gpus') or 1, unit)})", **_style(index))
    ax.axhline(TARGET_ATTAINMENT, color="grey", linestyle="--", linewidth=1, label="90% target")
    ax.set(xlabel=f"offered rate per {unit} (req/s per {unit})", ylabel="SLO attainment (all requests)",
           ylim=(0, 1.05), title=f"{what}\nSLO attainment vs offered rate")
    _percent_axis(ax)
    _rate_axis(ax, sides, per_unit=True)
    return _save(plt, fig, ax, path)


def _throughput_vs_rate(plt, sides: Mapping[str, Mapping[str, Any]], what: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    unit = _unit(sides)
    for index, (label, side) in enumerate(sides.items()):
        num = side.get("num_gpus") or 1
        points = _per_unit(side, [t / num for t in side["output_throughput"]])
        if points:
            ax.plot(*zip(*points), label=f"{label} ({_count(num, unit)})", **_style(index))
    ax.set(xlabel=f"offered rate per {unit} (req/s per {unit})", ylabel=f"output tokens/s per {unit}",
           title=f"{what}\noutput throughput vs offered rate")
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-9) * 1.1)  # from 0: a 0.2% gap looks like one
    _rate_axis(ax, sides, per_unit=True)
    return _save(plt, fig, ax, path)


def _rate_axis(ax, sides: Mapping[str, Mapping[str, Any]], per_unit: bool) -> None:
    """From 0, with room past the highest rate (a single-rate run is a point, not an empty plot)."""
    rates = [r / ((side.get("num_gpus") or 1) if per_unit else 1) for side in sides.values()
             for r in side["rates"] if math.isfinite(r)]
    if rates:
        ax.set_xlim(0, max(rates) * 1.15)


def _percent_axis(ax) -> None:
    from matplotlib.ticker import PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def _cdf(plt, at_rate: Mapping[str, Mapping[str, Any]], metric: str, title: str,
         slos: Mapping[str, float], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, (label, result) in enumerate(at_rate.items()):
        outputs = [out for out in outputs_from_result(result) if out.success]
        values = [out.ttft if metric == "ttft" else out.tpot for out in outputs]
        values = np.sort([v * 1e3 for v in values if v is not None])
        if len(values):
            style = _style(index)
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label,
                    linestyle=style["linestyle"], linewidth=2.5 if index == 0 else 1.5)
    if metric in slos:
        ax.axvline(slos[metric], color="grey", linestyle="--", linewidth=1, label=f"SLO {slos[metric]:g} ms")
    ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of requests at or below", ylim=(0, 1.02),
           title=title)
    ax.set_xlim(left=0)
    _percent_axis(ax)
    return _save(plt, fig, ax, path)


def _slo_scale(plt, at_rate: Mapping[str, Mapping[str, Any]], slos: Mapping[str, float],
               scales: Sequence[float], title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, (label, result) in enumerate(at_rate.items()):
        ax.plot(*zip(*slo_scale_curve(result, slos, scales)), label=label, **_style(index))
    ax.axhline(TARGET_ATTAINMENT, color="grey", linestyle="--", linewidth=1, label="90% target")
    ax.set(xlabel="SLO scale (each SLO multiplied by it)", ylabel="SLO attainment (all requests)",
           ylim=(0, 1.05), title=title)
    _percent_axis(ax)
    return _save(plt, fig, ax, path)


def _save(plt, fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    ax.title.set_fontsize(10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
