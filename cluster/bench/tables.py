"""The console tables of `disagg bench`, readable in an 80-column terminal without the source.

`run_table` is one run in `vllm bench serve`'s order; `comparison_table` the per-GPU goodput of
every deployment per SLO scale, and `common_rate_table` their tails at one shared rate. The
deployments are letters (A, B, ...) named in a legend line, every mark ("+", "<min") and unit is
explained in the caption, and cells fold instead of being cut with an ellipsis. Formatting of
SLOs, devices and numbers that the Markdown summary shares lives here too. Runs in the bench
process (rich imported on use).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

from disagg.cluster.bench.metrics import LATENCY_METRICS

MARKS = {"at_least": "+", "below_range": " (<min)"}
MARKS_EXPLAINED = ("'+': every rate swept held the target, so the goodput is at least this (sweep higher "
                   "rates to find it); '(<min)': even the lowest rate swept missed it (sweep lower)")
RATIO_MARKS = {"at_least": ">=", "at_most": "<="}
RATIO_EXPLAINED = ("'>=' / '<=': a goodput is a bound, so the ratio is too; '-': the sweep cannot order them "
                   "(both held every rate, or both missed the lowest)")
GOODPUT_PER_GPU = ("the highest offered rate per {unit} at which >= {target:.0%} of the requests meet every "
                   "SLO, interpolated between the last rate run that held and the first that missed")
REQUEST_GOODPUT = "the requests of one run that met every SLO, per second of that run, at its offered rate"
COMMON_RATE_HELD = "the highest rate every deployment ran at while each held >= 50% SLO attainment"
COMMON_RATE_LOWEST = ("the lowest rate every deployment ran (at no rate they all ran did each hold >= 50% SLO "
                      "attainment)")


def fmt_ratio(row: Mapping[str, Any]) -> str:
    """A comparison row's ratio with its bound: "1.500", ">=2.000", "<=0.500", "-"."""
    if row.get("ratio") is None:
        return "-"
    return RATIO_MARKS.get(row.get("ratio_bound") or "exact", "") + fmt(row["ratio"])


def fmt(value: Any) -> str:
    """A number for a table: 3 decimals below 100, 1 above; '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def fmt_rate(rate: Any) -> str:
    return "inf" if str(rate) == "inf" else f"{float(rate):g}"


def fmt_slos(slos_ms: Mapping[str, float] | None) -> str:
    """{"ttft": 500, "tpot": 50} -> "TTFT 500 ms, TPOT 50 ms"."""
    return ", ".join(f"{name.upper()} {value:g} ms" for name, value in (slos_ms or {}).items()) or "none"


def slo_line(dataset: str, slos_ms: Mapping[str, float] | None, calibration: Mapping[str, Any] | None) -> str:
    """The SLOs one workload was judged by, in words."""
    if not slos_ms:
        return (f"workload {dataset}: no SLOs, so goodput and attainment are not judged "
                "(give --goodput ttft:MS tpot:MS)")
    line = f"workload {dataset}: SLOs {fmt_slos(slos_ms)}"
    if calibration:
        line += (f" (calibrated: {calibration['rule']}; isolated TTFT {calibration['isolated_ttft_ms']:.1f} ms, "
                 f"TPOT {calibration['isolated_tpot_ms']:.2f} ms)")
    return line


def letters(labels: Sequence[str]) -> dict[str, str]:
    """Deployment label -> A, B, ... (AA after Z)."""
    names = list(string.ascii_uppercase)
    names += [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]
    return {label: names[i] for i, label in enumerate(labels)}


def legend(summary: Mapping[str, Any], lettered: bool = True) -> str:
    """'A = tiny-1p1d (2 GPUs), B = tiny-colocated (2 GPUs)' (without the letters: 'tiny-1p1d (2 GPUs), ...')."""
    marks = letters([side["label"] for side in summary["sides"]])
    return ", ".join(f"{marks[side['label']] + ' = ' if lettered else ''}{side['label']} ({_count(side)})"
                     for side in summary["sides"])


def _count(side: Mapping[str, Any]) -> str:
    unit = side.get("device_unit", "GPU")
    num = side.get("num_gpus") or 1
    return f"{num} {unit}{'s' if num != 1 else ''}" + (" on the CPU" if unit == "instance" else "")


def unit_of(summary: Mapping[str, Any]) -> str:
    units = {side.get("device_unit", "GPU") for side in summary["sides"]}
    return units.pop() if len(units) == 1 else "GPU or instance"


def _table(title: str, caption: str | None = None, **kwargs: Any):
    from rich.markup import escape
    from rich.table import Table

    # labels carry "[key=value]" (a variant): escaped, or rich would read them as markup and drop them
    title, caption = escape(title), escape(caption) if caption else None
    # min_width: captions and titles wrap over most of an 80-column line, not a narrow table's width
    return Table(title=title, caption=caption, caption_justify="left", title_justify="left", min_width=64,
                 **kwargs)


def _column(table, header: str, justify: str = "right") -> None:
    table.add_column(header, justify=justify, overflow="fold")


def run_table(result: Mapping[str, Any], metrics: Sequence[str] = LATENCY_METRICS):
    """One run, in the order `vllm bench serve` prints its summary; latencies of `metrics` only."""
    from disagg.cluster.bench.compare import TARGET_ATTAINMENT

    workload = (result.get("workload") or {}).get("dataset_name", "?")
    judged = bool(result.get("goodput"))
    unit = result.get("device_unit") or "GPU"
    # the legend names this goodput apart from a comparison's goodput per GPU, another figure
    caption = None if not judged else (
        f"Request goodput (vLLM's): {REQUEST_GOODPUT}. A comparison's goodput per {unit} is another figure: "
        f"{GOODPUT_PER_GPU.format(unit=unit, target=TARGET_ATTAINMENT)}.")
    table = _table(f"{result.get('label') or 'server'}: workload {workload}, {fmt_rate(result['request_rate'])} "
                   f"req/s offered, {result['num_prompts']} requests", caption=caption, show_header=False)
    _column(table, "metric", "left")
    _column(table, "value")
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", result["duration"]), ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", result["request_throughput"])]
    if judged:
        rows += [(f"Request goodput (req/s) ({fmt_slos(result['goodput'])})", result["request_goodput"]),
                 ("SLO attainment (all requests)", _percent(result["slo_attainment"]))]
    rows += [("Output token throughput (tok/s)", result["output_throughput"]),
             ("Total token throughput (tok/s)", result["total_token_throughput"])]
    cache = result.get("prefix_cache")
    if cache:
        per = ", ".join(f"{name} {_percent(one['hit_rate'])}" for name, one in cache["instances"].items())
        rows.append(("Prefix cache hit rate", f"{_percent(cache['hit_rate'])} ({per})"))
        again = cache.get("preempted") or {}
        if again.get("query_tokens"):  # as vLLM, apart: a preempted request finding its own KV again
            rows.append(("Recompute hits after preemption", f"{again['hit_tokens']} of {again['query_tokens']} "
                         "tokens (their own KV; not in the hit rate)"))
    percentiles = [p for p in result.get("percentiles") or (99,) if p != 50]
    if not result["completed"]:
        rows.append(("Latencies (ms)", "- (no request succeeded)"))
        metrics = ()
    for name in [*metrics, "client_overhead"]:
        word = "client overhead" if name == "client_overhead" else name.upper()
        if name == "client_overhead" and not (metrics and result.get("mean_client_overhead_ms")):
            continue  # a server that sends no emit times: nothing measured
        rows += [(f"Mean {word} (ms)", result.get(f"mean_{name}_ms")),
                 (f"Median {word} (ms)", result.get(f"median_{name}_ms"))]
        rows += [(f"P{_word(p)} {word} (ms)", result.get(f"p{_word(p)}_{name}_ms")) for p in percentiles]
    for name, value in rows:
        table.add_row(name, value if isinstance(value, str) else fmt(value))
    return table


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def failure_lines(result: Mapping[str, Any], most: int = 5) -> list[str]:
    """'3 of 8 requests failed:' and one line per reason with its count (the commonest first)."""
    errors = [error for ok, error in zip(result.get("successes") or [], result.get("errors") or []) if not ok]
    if not errors:
        return []
    counts: dict[str, int] = {}
    for error in errors:
        reason = " ".join(str(error or "no reason given").split())
        counts[reason] = counts.get(reason, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    lines = [f"{len(errors)} of {len(result.get('successes') or [])} requests failed:"]
    lines += [f"  {count} x {reason}" for reason, count in ranked[:most]]
    if len(ranked) > most:
        lines.append(f"  ... and {len(ranked) - most} other reason(s) (the result JSON's 'errors' has them all)")
    return lines


def comparison_table(summary: Mapping[str, Any]):
    """Per SLO scale: each deployment's goodput per GPU and the ratio of the one under test (A) to the best other."""
    sides = [side["label"] for side in summary["sides"]]
    marks = letters(sides)
    unit = unit_of(summary)
    target = summary["comparison"]["target_attainment"]
    table = _table(f"Goodput per {unit} (req/s per {unit} at >= {target:.0%} SLO attainment), "
                   f"workload {summary.get('dataset', '?')}",
                   caption=f"{legend(summary)}. Goodput here: {GOODPUT_PER_GPU.format(unit=unit, target=target)} "
                           f"(not a run's request goodput: {REQUEST_GOODPUT}). Base SLOs: "
                           f"{fmt_slos(summary['slos_ms'])}; SLO scale k multiplies each. {MARKS_EXPLAINED}. "
                           f"ratio: the best of A's family over the best other, the two named; {RATIO_EXPLAINED}.")
    _column(table, "SLO scale")
    for label in sides:
        _column(table, marks[label])
    _column(table, "ratio")
    for row in summary["comparison"]["rows"]:
        cells = [f"{row['scale']:g}x"]
        for label in sides:
            cells.append(fmt(row["per_gpu_goodput"][label]) + MARKS.get(row["bound"][label], ""))
        own, other = row.get("best_own", sides[0]), row["best_other"]
        cells.append(fmt_ratio(row) + (f" {marks[own]}/{marks[other]}" if other else ""))
        table.add_row(*cells)
    return table



def common_rate_held(summary: Mapping[str, Any]) -> bool | None:
    """Which rate `plots.common_rate` chose: True for the highest rate every side ran at while
    each held >= 50% attainment, False for its fallback, the lowest rate they all ran (where no
    rate they all ran had each side holding 50%); None without a common rate."""
    common = summary.get("at_common_rate") or {}
    if common.get("rate") is None:
        return None
    attained = [(common.get(side["label"]) or {}).get("attainment") for side in summary["sides"]]
    return all(value is not None and value >= 0.5 for value in attained)


def common_rate_table(summary: Mapping[str, Any]):
    """Each deployment at the common rate: p99 TTFT/TPOT, attainment, client overhead, prefix-cache
    hit rate (the run's ``prefix_cache``), busy fraction per instance (cluster stats' busy_s) and GPU
    utilization (nvidia-smi); one column each."""
    common = summary.get("at_common_rate") or {}
    sides = [side["label"] for side in summary["sides"]]
    marks = letters(sides)
    rate = common.get("rate")
    where = f"{fmt_rate(rate)} req/s offered to each" if rate is not None else "no rate every deployment ran"
    held = common_rate_held(summary)
    why = "" if held is None else f"The rate: {COMMON_RATE_HELD if held else COMMON_RATE_LOWEST}. "
    table = _table(f"At a common rate: {where}",
                   caption=f"{why}{legend(summary)}. busy: fraction of the run each instance spent in engine steps. "
                           "prefix hits: new requests' prompt tokens found in the instances' prefix caches, of "
                           "those looked up (preempted requests recomputing are not counted). GPU util: nvidia-smi's mean ('-' on the CPU). host CPU: the CPU the launching "
                           "process spent, as a fraction of the run (its router thread; the whole process).")
    _column(table, "", "left")
    for label in sides:
        _column(table, marks[label])
    rows = {label: common.get(label) or {} for label in sides}
    lines = [("p99 TTFT (ms)", lambda r: fmt(r.get("p99_ttft_ms"))),
             ("p99 TPOT (ms)", lambda r: fmt(r.get("p99_tpot_ms"))),
             ("SLO attainment", lambda r: _percent(r.get("attainment"))),
             ("client overhead (ms)", lambda r: fmt(r.get("mean_client_overhead_ms"))),
             ("prefix hits", lambda r: _percent(r.get("prefix_hit_rate"))),
             ("busy", lambda r: _fractions(r.get("busy_fraction"))),
             ("GPU util", lambda r: _fractions(r.get("gpu_utilization"))),
             ("host CPU", lambda r: _fractions(r.get("host_cpu")))]
    for name, cell in lines:
        table.add_row(name, *(cell(rows[label]) for label in sides))
    return table


def _fractions(values: Mapping[str, float] | None) -> str:
    return "\n".join(f"{name} {value:.2f}" for name, value in (values or {}).items()) or "-"
