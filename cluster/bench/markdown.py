"""summary.md of a bench: what was run (date, commit, device, models, workload, rates, prompts)
and what came out, readable on its own (for a README or an issue).

`comparison_summary` covers `--compare` and `--from-results`: per workload and SLO scale, who
wins and by how much, then every deployment's tails at the common rate, one row each.
`single_summary` covers one deployment: one row per rate. Runs in the bench process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from disagg.cluster.bench.tables import (COMMON_RATE_HELD, COMMON_RATE_LOWEST, GOODPUT_PER_GPU, MARKS_EXPLAINED,
                                         RATIO_EXPLAINED, REQUEST_GOODPUT, common_rate_held, fmt, fmt_rate,
                                         fmt_ratio, fmt_slos, legend, unit_of)


def _head(title: str, context: Mapping[str, Any], mismatches: Sequence[str] = (), notes: Sequence[str] = ()
          ) -> list[str]:
    lines = [f"# {title}", "",
             f"- date: {_date(context.get('date'))}; commit: {context.get('git_commit') or 'unknown'}",
             f"- device: {context.get('device') or '-'}",
             f"- model: {', '.join(context.get('models') or []) or 'not recorded'}",
             f"- rates offered (req/s): {', '.join(fmt_rate(r) for r in context.get('rates') or [])}; "
             f"prompts per run: {', '.join(str(n) for n in context.get('num_prompts') or [])}"]
    for name, workload in (context.get("workloads") or {}).items():
        lines.append(f"- workload {name}: {_workload(workload)}")
    lines += [f"- WARNING: the deployments differ: {what} (--allow-mismatch)" for what in mismatches]
    lines += [f"- NOTE: {note}" for note in notes]
    return lines + [""]


def _date(stamp: str | None) -> str:
    """vLLM's "YYYYMMDD-HHMMSS" (UTC here) -> "YYYY-MM-DD HH:MM:SS UTC"."""
    if not stamp or len(stamp) != 15:
        return stamp or "-"
    return f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]}:{stamp[13:]} UTC"


def _workload(workload: Mapping[str, Any]) -> str:
    parts = [f"input {workload.get('input_len')} tokens", f"output {workload.get('output_len')} tokens"]
    if workload.get("range_ratio"):
        parts[-1] += f", lengths +-{100 * workload['range_ratio']:g}%"
    return ", ".join(parts) + f", seed {workload.get('seed')}"


def comparison_summary(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """One Markdown page over workloads and SLO scales: who wins, by how much, and the tails."""
    first = next(iter(summaries.values()))
    context = dict(first.get("context") or {})
    context["workloads"] = {k: v for s in summaries.values() for k, v in (s.get("context") or {}).get(
        "workloads", {}).items()}
    unit = unit_of(first)
    target = first["comparison"]["target_attainment"]
    lines = _head("disagg bench: comparison", context, first.get("mismatches") or (), first.get("notes") or ())
    lines += [f"Goodput: {GOODPUT_PER_GPU.format(unit=unit, target=target)} (req/s per {unit}; not a run's "
              f"request goodput: {REQUEST_GOODPUT}). {MARKS_EXPLAINED.replace('(<min)', '<')}. Ratio: the best "
              f"of the deployment under test (and its variants) over the best other; {RATIO_EXPLAINED}.", "",
              "| workload | SLO scale | SLOs | under test | goodput | best other | goodput | ratio |",
              "|" + " --- |" * 8]
    for dataset, summary in summaries.items():
        for row in summary["comparison"]["rows"]:
            first_label = row.get("best_own", summary["sides"][0]["label"])
            other = row["best_other"]
            lines.append(f"| {dataset} | {row['scale']:g}x | {fmt_slos(row['slos_ms'])} | {first_label} | "
                         f"{_bounded(row, first_label)} | {other or '-'} | {_bounded(row, other) if other else '-'} "
                         f"| {fmt_ratio(row)} |")
    # the heading says which rate its rows are at: the held one, or the fallback where none held
    held = {dataset: common_rate_held(summary) for dataset, summary in summaries.items()}
    starred = True in held.values() and False in held.values()
    which = (f"{COMMON_RATE_HELD}; where none did (rate marked '*'), the lowest rate they all ran" if starred
             else COMMON_RATE_LOWEST if False in held.values() else COMMON_RATE_HELD)
    lines += ["", f"At a common rate, per workload: {which}.", "",
              "| workload | deployment | rate (req/s) | p99 TTFT (ms) | p99 TPOT (ms) | SLO attainment |",
              "|" + " --- |" * 6]
    for dataset, summary in summaries.items():
        common = summary.get("at_common_rate") or {}
        rate = (fmt_rate(common["rate"]) + ("*" if starred and held[dataset] is False else "")) if common else "-"
        for side in summary["sides"]:
            row = common.get(side["label"]) or {}
            attained = row.get("attainment")
            lines.append(f"| {dataset} | {side['label']} | {rate} | "
                         f"{fmt(row.get('p99_ttft_ms'))} | {fmt(row.get('p99_tpot_ms'))} | "
                         f"{'-' if attained is None else f'{100 * attained:.1f}%'} |")
    lines += ["", f"Deployments: {legend(first, lettered=False)}.", ""]
    return "\n".join(lines)


def _bounded(row: Mapping[str, Any], label: str) -> str:
    mark = {"at_least": "+", "below_range": "<"}.get(row["bound"][label], "")
    return f"{fmt(row['per_gpu_goodput'][label])}{mark}"


def single_summary(runs: Any, summary: Mapping[str, Any] | None) -> str:
    """One deployment's sweep of one workload (`runs`: a sweep.DatasetRuns): a row per rate, and its
    goodput per GPU when SLOs were set (`summary`: summarize_comparison's)."""
    from disagg.cluster.bench.compare import TARGET_ATTAINMENT
    from disagg.cluster.bench.report import run_context

    context = (summary or {}).get("context") or run_context(runs.results)
    label = runs.info.get("label", "?")
    lines = _head(f"disagg bench: {label}", context)
    lines += [f"SLOs: {fmt_slos(runs.slos_ms)}." if runs.slos_ms else "SLOs: none given, so goodput is not judged.",
              "", "| workload | rate (req/s) | completed | failed | throughput (req/s) | request goodput (req/s) | "
              "SLO attainment | p99 TTFT (ms) | p99 TPOT (ms) |", "|" + " --- |" * 9]
    for r in runs.results:
        attained = r.get("slo_attainment")
        lines.append(f"| {runs.dataset} | {fmt_rate(r['request_rate'])} | {r['completed']} | {r['failed']} | "
                     f"{fmt(r['request_throughput'])} | {fmt(r.get('request_goodput'))} | "
                     f"{'-' if attained is None else f'{100 * attained:.1f}%'} | {fmt(r['p99_ttft_ms'])} | "
                     f"{fmt(r['p99_tpot_ms'])} |")
    unit = (summary["sides"][0] if summary else runs.info).get("device_unit", "GPU")
    if runs.slos_ms:  # two goodputs: each named
        lines += ["", f"Request goodput: {REQUEST_GOODPUT} (vLLM's)." + (
            f" Goodput per {unit} (below) is another figure: "
            f"{GOODPUT_PER_GPU.format(unit=unit, target=TARGET_ATTAINMENT)}." if summary else "")]
    if summary:
        side = summary["sides"][0]
        mark = {"at_least": " or more (every rate held)", "below_range": ": below the lowest rate swept"}
        lines += ["", f"Goodput per {unit} at >= {summary['comparison']['target_attainment']:.0%} attainment "
                      f"({side['num_gpus']} {unit}(s)): {fmt(side['per_gpu_goodput'])} req/s per {unit}"
                      f"{mark.get(side['bound'], '')}."]
    return "\n".join(lines) + "\n"
