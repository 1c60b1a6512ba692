"""Compare deployments from result files written earlier (`disagg bench --from-results DIR ...`).

A comparison of several deployments over several workloads can take longer than one command may
run, so each deployment can be swept on its own (`--no-compare
--save-result --result-dir DIR`) and the comparison drawn afterwards from the stored per-request
lists: SLO attainment, per-GPU goodput, the SLO-scale sweep and the plots all recompute from
them, under the SLOs given now or those stored with the first deployment. Runs anywhere; no
cluster, no GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg.cluster.bench.compare import setup_mismatches
from disagg.cluster.bench.markdown import comparison_summary
from disagg.cluster.bench.report import PER_REQUEST_KEYS, load_json, rate_from_json, save_json, write_markdown
from disagg.cluster.bench.sweep import DatasetRuns, SweepOptions, summarize_comparison

logger = logging.getLogger(__name__)


def result_files(path: str | Path) -> list[Path]:
    """The run results under `path` (a file, or a folder searched recursively).

    Raises:
        ValueError: the path does not exist, or holds no result file.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--from-results: expected a result file or folder, got {str(path)!r} (not found)")
    candidates = [path] if path.is_file() else sorted(path.rglob("*.json"))
    found = [p for p in candidates if _is_run_result(p)]
    if not found:
        raise ValueError(f"--from-results: no run result (JSON with per-request lists) under {str(path)!r}")
    return found


def _is_run_result(path: Path) -> bool:
    try:
        data = load_json(path)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(key in data for key in PER_REQUEST_KEYS)


def load_runs(paths: Sequence[str | Path]) -> list[DatasetRuns]:
    """Group stored results by (deployment label, workload), in the order the paths were given."""
    groups: dict[tuple[str, str], DatasetRuns] = {}
    for path in paths:
        for file in result_files(path):
            result = load_json(file)
            dataset = (result.get("workload") or {}).get("dataset_name", "random")
            key = (result.get("label") or file.parent.name, dataset)
            if key not in groups:
                groups[key] = DatasetRuns(dataset, [], result.get("goodput") or None, {
                    "label": key[0], "num_gpus": result.get("num_gpus") or 1,
                    "device_unit": result.get("device_unit", "GPU"),
                    "config_path": result.get("config_path"), "overrides": result.get("overrides") or {},
                    "workload": result.get("workload"), "calibration": result.get("calibration"),
                    "result_files": []})
            groups[key].results.append(result)
            groups[key].info["result_files"].append(str(file))
    for runs in groups.values():
        runs.results = _latest_per_rate(runs)
    return list(groups.values())


def _latest_per_rate(runs: DatasetRuns) -> list[dict[str, Any]]:
    """One result per rate, the newest (a re-run writes a newly dated file beside the old one)."""
    latest: dict[float, dict[str, Any]] = {}
    for result in runs.results:
        rate = rate_from_json(result["request_rate"])
        if rate in latest:
            older, newer = sorted([latest[rate], result], key=lambda r: str(r.get("date")))
            logger.warning("%s / %s at %s req/s: two results (%s and %s); comparing the newer", runs.info["label"],
                           runs.dataset, rate, older.get("date"), newer.get("date"))
            result = newer
        latest[rate] = result
    return [latest[rate] for rate in sorted(latest)]


def mismatches(sides: Sequence[DatasetRuns]) -> list[str]:
    """How the stored deployments differ in model, dtype or workload, per workload (see
    compare.setup_mismatches); results without a recorded model are not compared on it."""
    found: list[str] = []
    by_dataset: dict[str, dict[str, dict[str, Any]]] = {}
    for runs in sides:
        first = runs.results[0] if runs.results else {}
        model = (first.get("config") or {}).get("model") or {}
        by_dataset.setdefault(runs.dataset, {})[runs.info["label"]] = {
            "model": first.get("model_id") or model.get("source"), "dtype": first.get("dtype") or model.get("dtype"),
            "workload": {k: v for k, v in (first.get("workload") or {}).items() if k != "num_prompts"} or None}
    for setups in by_dataset.values():
        found += [what for what in setup_mismatches(setups) if what not in found]
    return found


def compare_stored(paths: Sequence[str | Path], out_dir: str | Path, options: SweepOptions) -> dict[str, Any]:
    """`compare_runs` of the results under `paths` (see load_runs)."""
    return compare_runs(load_runs(paths), out_dir, options)


def compare_runs(sides: Sequence[DatasetRuns], out_dir: str | Path, options: SweepOptions,
                 mismatches: Sequence[str] = ()) -> dict[str, Any]:
    """compare.json, plots and summary.md per workload from stored results.

    The first deployment found is the one under test. SLOs: `options.goodput_slos_ms` when
    given, else those stored with the first deployment's results of that workload.

    Returns:
        the summary of the one workload, or {"datasets": {name: summary}} for several.

    Raises:
        ValueError: no SLOs given or stored, or nothing to compare.
    """
    out_dir = Path(out_dir)
    by_dataset: dict[str, list[DatasetRuns]] = {}
    for runs in sides:
        by_dataset.setdefault(runs.dataset, []).append(runs)
    summaries = {}
    for dataset, group in by_dataset.items():
        slos = options.goodput_slos_ms or group[0].slos_ms
        if not slos:
            raise ValueError(f"--goodput: the stored results of {dataset!r} carry no SLOs; give --goodput")
        for side in group:
            side.slos_ms = dict(slos)
        folder = out_dir if len(by_dataset) == 1 else out_dir / dataset
        summaries[dataset] = summarize_comparison(group, options, folder, mismatches)
    write_markdown(out_dir / "summary.md", comparison_summary(summaries))
    if len(summaries) == 1:
        return next(iter(summaries.values()))
    everything = {"datasets": summaries}
    save_json(everything, out_dir / "compare.json")
    return everything
