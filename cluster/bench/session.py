"""One `disagg bench` invocation after its flags are read: run, print, save, and say how it ended.

`run(bench_run, options)` picks the shape (a comparison, one launched config, a server at a URL, or
stored results), prints each run's table and its failed requests grouped by reason, writes the
result JSON and summary.md, and returns the exit status: 0 when some request succeeded, 1 when
none did or the server/fleet could not be used (one line), 2 for comparisons of different
models, dtypes or workloads (unless allowed), 130 on Ctrl-C (one line naming what was kept).
Called by command.py; runs in the CLI process.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from disagg.cluster.bench import report, tables
from disagg.cluster.bench.flags import Target

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass
class BenchRun:
    """What to run, besides the sweep options (see command.py for each flag)."""

    config: Optional[Path] = None
    others: list[Any] = field(default_factory=list)
    variants: list[dict[str, Any]] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    target: Optional[Target] = None
    from_results: list[Path] = field(default_factory=list)
    label: Optional[str] = None
    out_dir: Path = Path("results")
    metadata: dict[str, str] = field(default_factory=dict)
    table_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    allow_mismatch: bool = False


@dataclass
class Tally:
    """Runs finished, requests that succeeded, files written: what Ctrl-C and the exit status report."""

    num_runs: int = 0
    num_completed: int = 0
    num_failed: int = 0
    files: list[str] = field(default_factory=list)

    def count(self, result: dict[str, Any]) -> None:
        self.num_runs += 1
        self.num_completed += int(result["completed"])
        self.num_failed += int(result["failed"])

    def kept(self, out_dir: Path) -> str:
        if self.files:
            return f"{self.num_runs} finished run(s) kept: {len(self.files)} result file(s) under {out_dir}"
        if self.num_runs:
            return f"{self.num_runs} run(s) had finished; nothing saved (--save-result keeps each run as it ends)"
        return "no run had finished; nothing saved"


def run(bench_run: BenchRun, options: Any, console: Any = None) -> int:
    """Carry out `bench_run`; return the exit status (see the module docstring)."""
    from rich.console import Console

    from disagg.cluster.bench.backends import TargetError
    from disagg.cluster.bench.compare import Mismatch
    from disagg.errors import DisaggError

    console = console or Console()
    tally = Tally()
    try:
        if bench_run.from_results:
            _compare_stored(console, bench_run, options)
        elif bench_run.others and bench_run.target is None:
            _compare_live(console, bench_run, options, tally)
        else:
            _single(console, bench_run, options, tally)
    except KeyboardInterrupt:
        _say(f"interrupted (Ctrl-C); {tally.kept(bench_run.out_dir)}")
        return EXIT_INTERRUPTED
    except Mismatch as err:
        _say(str(err))
        return EXIT_USAGE
    except TargetError as err:
        _say(str(err))
        return EXIT_FAILED
    except DisaggError as err:  # the fleet failed to launch or its preflight failed
        _say(f"{type(err).__name__}: {err}")
        return EXIT_FAILED
    if tally.num_runs and tally.num_completed == 0:
        _say(f"no request succeeded ({tally.num_failed} failed in {tally.num_runs} run(s); reasons above)")
        return EXIT_FAILED
    return EXIT_OK


def _say(line: str) -> None:
    print(f"disagg bench: {line}", file=sys.stderr, flush=True)


def _single(console, bench_run: BenchRun, options, tally: Tally) -> None:
    from disagg.cluster.bench import markdown, sweep

    if bench_run.target is not None and bench_run.others:
        raise _usage("--compare needs configs launched here; drop --base-url")
    if bench_run.target is not None and len(options.dataset_names) > 1:
        raise _usage("one --dataset-name at a time with --base-url")
    saver = _saver(bench_run, options, tally)
    if bench_run.target is not None:
        results = sweep.bench_url(bench_run.target, options, slos_ms=options.goodput_slos_ms,
                                  label=bench_run.label, extra=bench_run.metadata, on_result=saver)
        runs = [sweep.DatasetRuns(options.dataset_name, results, options.goodput_slos_ms,
                                  {"label": bench_run.label or bench_run.target.base_url, "num_gpus": 1,
                                   "device_unit": "GPU"})]
    else:
        runs = sweep.bench_config(bench_run.config, options, overrides=bench_run.overrides,
                                  label=bench_run.label, extra=bench_run.metadata, on_result=saver)
    for one in runs:
        console.print(tables.slo_line(one.dataset, one.slos_ms, one.info.get("calibration")), markup=False)
        if options.save_results:
            folder = _folder(options, bench_run.out_dir, one.dataset)
            summary = sweep.summarize_comparison([one], options, folder) if one.slos_ms else None
            path = report.write_markdown(folder / "summary.md", markdown.single_summary(one, summary))
            console.print(f"results and summary: {path.parent}", markup=False)


def _usage(message: str) -> Exception:
    import typer

    return typer.BadParameter(message)


def _saver(bench_run: BenchRun, options, tally: Tally) -> Callable[[dict[str, Any]], None]:
    """Print each run as it ends; save it then too (vLLM's dated file name unless --result-filename)."""
    from rich.console import Console

    from disagg.cluster.bench import sweep

    single = len(options.rates) == 1 and len(options.dataset_names) == 1
    console = Console()

    def save(result: dict[str, Any]) -> None:
        result.update(bench_run.metadata)
        if options.save_results:
            name = options.result_filename if options.result_filename and single else sweep.result_name(result)
            folder = _folder(options, bench_run.out_dir, result["workload"]["dataset_name"])
            tally.files.append(str(report.save_json(result, folder / name)))
        tally.count(result)
        _print_run(console, result, bench_run.table_metrics)
    return save


def _print_run(console, result: dict[str, Any], metrics: tuple[str, ...]) -> None:
    console.print(tables.run_table(result, metrics))
    for line in tables.failure_lines(result):
        console.print(line, markup=False, highlight=False)


def _folder(options, out_dir: Path, dataset: str) -> Path:
    return out_dir if len(options.dataset_names) == 1 else out_dir / dataset


def _compare_live(console, bench_run: BenchRun, options, tally: Tally) -> None:
    from disagg.cluster.bench import compare, sweep

    differences = compare.config_mismatches(bench_run.config, bench_run.others, bench_run.overrides,
                                            bench_run.variants)
    _judge_mismatch(differences, bench_run.allow_mismatch)

    def printed(result: dict[str, Any]) -> None:
        tally.files.append(result["result_file"])
        tally.count(result)
        _print_run(console, result, bench_run.table_metrics)

    summary = sweep.compare_configs(bench_run.config, bench_run.others, bench_run.out_dir, options,
                                    variants=bench_run.variants, overrides=bench_run.overrides, on_result=printed,
                                    mismatches=differences, extra=bench_run.metadata)
    _print_comparison(console, summary, options, bench_run.out_dir)


def _judge_mismatch(differences: list[str], allowed: bool) -> None:
    from disagg.cluster.bench.compare import Mismatch

    if not differences:
        return
    what = "; ".join(differences)
    if not allowed:
        raise Mismatch(f"the deployments compared differ: {what}. A goodput ratio across them measures that "
                       "difference, not the serving layout; compare one model, dtype and workload, or pass "
                       "--allow-mismatch to compare anyway")
    _say(f"WARNING: comparing deployments that differ: {what} (--allow-mismatch); the summary says so too")


def _compare_stored(console, bench_run: BenchRun, options) -> None:
    import typer

    from disagg.cluster.bench import stored

    try:
        runs = stored.load_runs(bench_run.from_results)
    except ValueError as err:
        raise typer.BadParameter(str(err).removeprefix("--from-results: "), param_hint="--from-results") from None
    differences = stored.mismatches(runs)
    _judge_mismatch(differences, bench_run.allow_mismatch)
    try:
        summary = stored.compare_runs(runs, bench_run.out_dir, options, mismatches=differences)
    except ValueError as err:
        raise typer.BadParameter(str(err).removeprefix("--goodput: "), param_hint="--goodput") from None
    _print_comparison(console, summary, options, bench_run.out_dir)


def _print_comparison(console, summary: dict, options, out_dir: Path) -> None:
    for name, one in (summary.get("datasets") or {options.dataset_name: summary}).items():
        console.print(f"[bold]workload {one.get('dataset', name)}[/bold]")
        console.print(tables.comparison_table(one))
        console.print(tables.common_rate_table(one))
        console.print(f"plots: {', '.join(Path(p).name for p in one['plots'])}", markup=False)
    console.print(f"results, compare.json, summary.md and plots under {out_dir}", markup=False)
