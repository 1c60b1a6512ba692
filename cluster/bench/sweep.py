"""Run a workload over a rate sweep on a launched cluster (or a server), and compare deployments.

`run_sweep` drives one backend through every rate and stores one result object per rate (with
the cluster's busy fractions when its stats carry them). `bench_config` launches a `Cluster` from
a YAML file (optionally with dotted overrides: a tuned variant), samples the workload against
its model (vocab size, context limit), optionally calibrates SLOs, sweeps and shuts the cluster
down. `compare_configs` does that for the config under test and each comparison config, writes
the JSON results, the summary and the plots. Runs in the bench process (the Ray driver).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from disagg.cluster.bench import compare as cmp
from disagg.cluster.bench.metrics import DEFAULT_PERCENTILES, slo_attainment
from disagg.cluster.bench.markdown import comparison_summary
from disagg.cluster.bench.report import build_result, rate_to_json, run_context, save_json, write_markdown
from disagg.cluster.bench.runner import Backend, run, warm_up
from disagg.cluster.bench.tables import fmt_slos
from disagg.cluster.bench.utilization import sample_gpus
from disagg.cluster.bench.workloads import SampleRequest, WorkloadSpec, sample_requests
from disagg.config import SECRET_FIELDS

logger = logging.getLogger(__name__)


@dataclass
class SweepOptions:
    """Everything a sweep needs besides the deployment (CLI flags map onto these fields)."""

    num_prompts: int = 100
    rates: list[float] = field(default_factory=lambda: [math.inf])
    dataset_name: str = "random"
    datasets: list[str] | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    goodput_slos_ms: dict[str, float] | None = None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    num_warmups: int = 1
    request_timeout_s: float | None = None
    slo_scales: tuple[float, ...] = cmp.DEFAULT_SLO_SCALES
    calibrate_slos: bool = False
    calibrate_ttft_scale: float = 3.0
    calibrate_tpot_scale: float = 2.5
    vocab_size: int | None = None
    show_progress: bool = True
    result_filename: str | None = None
    save_results: bool = True
    run_seconds: float | None = None
    min_prompts: int = 50
    early_stop: bool = False
    extend_to_limit: int = 0
    reset_prefix_cache: bool = True

    @property
    def dataset_names(self) -> list[str]:
        """The workloads to run on each launched deployment (one launch serves them all)."""
        return list(self.datasets or [self.dataset_name])

    def sweep_rates(self) -> list[float]:
        """Rates in sweep order: ascending, inf last, when early_stop (stop at the first collapse)."""
        return sorted(self.rates) if self.early_stop else list(self.rates)

    def prompts_at(self, rate: float, available: int) -> int:
        """Requests of a run at `rate` (`prompts_at`)."""
        return prompts_at(rate, available, self.run_seconds, self.min_prompts)


def prompts_at(rate: float, available: int, run_seconds: float | None, min_prompts: int) -> int:
    """Requests of a run at ``rate``: the first of the ``available`` sampled ones, about
    ``run_seconds`` of arrivals and at least ``min_prompts`` (all of them without run_seconds or
    at rate inf). `disagg simulate` takes the same ones, so a simulated run is the measured one's."""
    if run_seconds is None or math.isinf(rate):
        return available
    return max(1, min(available, max(min_prompts, math.ceil(rate * run_seconds))))


@dataclass
class DatasetRuns:
    """One workload's sweep on one deployment: results per rate, the SLOs judged, and context."""

    dataset: str
    results: list[dict[str, Any]]
    slos_ms: dict[str, float] | None
    info: dict[str, Any]


def run_sweep(backend: Backend, requests: Sequence[SampleRequest], options: SweepOptions, *,
              label: str, slos_ms: Mapping[str, float] | None, stats: Callable[[], dict] | None = None,
              workload: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
              extra: Mapping[str, Any] | None = None, reset: Callable[[], Any] | None = None,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One result object per rate of `options.rates` (see report.build_result), and up to
    `options.extend_to_limit` more while every rate run held the target under `slos_ms`, each
    twice the highest (`limit_rate`; results then in ascending rate order).

    Args:
        stats: the cluster's stats(), read before and after each run for busy fractions.
        reset: forgets the deployment's cached prefixes; called before each run when
            `options.reset_prefix_cache` (the default), so a run's prefix hits are its own
            prompts' reuse, never the warm-ups', the calibration's or the previous rate's (the
            same prompts: every run of a sweep draws them from one list).
        workload / config / extra: stored in each result.
        on_result: called with each result as soon as it exists (saving it survives a killed sweep).
    """
    results: list[dict[str, Any]] = []
    warm_up(backend, requests, options.num_warmups)  # outside every run: busy fractions stay the run's own
    pending, extensions = list(options.sweep_rates()), options.extend_to_limit if slos_ms else 0
    while pending or extensions:
        if not pending:
            extensions -= 1
            further = limit_rate(results, slos_ms)
            if further is None:
                break
            logger.info("%s: every rate held the target; adding %s req/s", label, further)
            pending.append(further)
        rate = pending.pop(0)
        batch = list(requests[:options.prompts_at(rate, len(requests))])
        if reset is not None and options.reset_prefix_cache:
            reset()
        before = stats() if stats else None
        with progress_bar(options.show_progress, f"{label} @ {rate_to_json(rate)} req/s", len(batch)) as tick, \
                sample_gpus() as gpus:
            outcome = run(backend, batch, request_rate=rate, burstiness=options.burstiness,
                          max_concurrency=options.max_concurrency, seed=options.seed,
                          request_timeout_s=options.request_timeout_s, on_done=tick)
        after = stats() if stats else None
        more = dict(extra or {}, prefix_cache_reset=reset is not None and options.reset_prefix_cache,
                    busy_fraction=busy_fractions(before, after, outcome.duration_s),
                    host_cpu=host_cpu_fractions(before, after, outcome.duration_s),
                    gpu_utilization=gpus["gpu_utilization"], placements=placements_of(before, after),
                    prefix_cache=prefix_cache_of(before, after), cluster_stats=after)
        results.append(build_result(outcome, goodput_slos_ms=slos_ms, percentiles=options.percentiles,
                                    label=label, workload=workload, config=config, extra=more))
        if on_result is not None:
            on_result(results[-1])
        if options.early_stop and slos_ms and math.isfinite(rate):
            loosest = cmp.scale_slos(slos_ms, max(options.slo_scales))
            if slo_attainment(outcome.outputs, loosest) < cmp.TARGET_ATTAINMENT:
                logger.info("%s: attainment under the loosest SLOs fell below target at %s req/s; "
                            "higher rates skipped", label, rate)
                break
    if options.extend_to_limit and len(results) > len(options.rates):
        results.sort(key=lambda result: float(result["request_rate"]))
    return results


def limit_rate(results: Sequence[Mapping[str, Any]], slos_ms: Mapping[str, float],
               target: float = cmp.TARGET_ATTAINMENT) -> float | None:
    """The rate to run next for a deployment's limit under ``slos_ms``: twice the highest finite
    rate when every rate run held ``target`` attainment (the goodput lies above them all); None
    once a rate missed, or without a finite rate. Only upward, where runs are the shorter; for a
    deployment that missed even the lowest rate, sweep lower rates (longer runs) on purpose."""
    points = sorted((float(r["request_rate"]), cmp.attainment_of(r, slos_ms)) for r in results
                    if math.isfinite(float(r["request_rate"])))
    if points and all(attained >= target for _, attained in points):
        return 2 * points[-1][0]
    return None


def public_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``overrides`` as results may show them: a secret field's value (`SECRET_FIELDS`) hidden."""
    secret = {f"{section}.{key}" for section, keys in SECRET_FIELDS.items() for key in keys}
    return {k: ("<hidden>" if k in secret else v) for k, v in (overrides or {}).items()}


def placements_of(before: dict | None, after: dict | None) -> dict[str, int] | None:
    """Prompts placed remote / local / kept during one run (router stats before and after it)."""
    if not before or not after:
        return None
    old = (before.get("router") or {}).get("placements") or {}
    new = (after.get("router") or {}).get("placements") or {}
    return {path: new[path] - old.get(path, 0) for path in new} or None


def prefix_cache_of(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """Prefix-cache hits of one run, per instance and over all (engine stats before and after it).

    Returns:
        ``{"hit_rate", "query_tokens", "hit_tokens", "instances": {name: {the same three}},
        "pushed_bytes"}``: prompt tokens of new requests looked up and found during the run (a hit
        rate of a prefill instance is the share of prompt tokens it did not compute; of a decode
        instance, the share it did not receive); pushed_bytes: KV the prefill instances pushed.
        Where the engines count them, ``"preempted": {"query_tokens", "hit_tokens"}``: the tokens
        that preempted requests, re-entering to recompute, looked up and found again (their own
        KV, not prompt reuse: vLLM's preempted_queries / preempted_hits, out of the hit rate).
        None without engine stats.
    """
    if not before or not after:
        return None
    old = {inst.get("name"): inst for inst in before.get("instances") or [] if isinstance(inst, Mapping)}
    instances, pushed, preempted = {}, 0, None
    for inst in after.get("instances") or []:
        prev = old.get(inst.get("name")) if isinstance(inst, Mapping) else None
        if prev is None or "prefix_query_tokens" not in inst or "prefix_query_tokens" not in prev:
            continue
        query = inst["prefix_query_tokens"] - prev["prefix_query_tokens"]
        hits = inst["prefix_hit_tokens"] - prev["prefix_hit_tokens"]
        instances[str(inst["name"])] = {"hit_rate": hits / query if query else None, "query_tokens": query,
                                        "hit_tokens": hits}
        pushed += inst.get("pushed_bytes", 0) - prev.get("pushed_bytes", 0)
        if "prefix_preempted_query_tokens" in inst and "prefix_preempted_query_tokens" in prev:
            preempted = preempted or {"query_tokens": 0, "hit_tokens": 0}
            preempted["query_tokens"] += inst["prefix_preempted_query_tokens"] - prev["prefix_preempted_query_tokens"]
            preempted["hit_tokens"] += inst["prefix_preempted_hit_tokens"] - prev["prefix_preempted_hit_tokens"]
    if not instances:
        return None
    query = sum(v["query_tokens"] for v in instances.values())
    hits = sum(v["hit_tokens"] for v in instances.values())
    out = {"hit_rate": hits / query if query else None, "query_tokens": query, "hit_tokens": hits,
           "instances": instances, "pushed_bytes": pushed}
    return out if preempted is None else dict(out, preempted=preempted)


@contextlib.contextmanager
def progress_bar(show: bool, description: str, total: int) -> Iterator[Callable[[Any], None]]:
    """A rich progress bar over one run; yields the per-request callback (a no-op when hidden)."""
    if not show:
        yield lambda _out: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda _out: bar.advance(task)


def calibrate(backend: Backend, requests: Sequence[SampleRequest], options: SweepOptions,
              num_requests: int = 8, reset: Callable[[], Any] | None = None,
              stats: Callable[[], dict] | None = None) -> dict[str, Any]:
    """SLOs scaled from isolated requests: TPOT from the batch-1 decode step, TTFT from isolated prefill.

    Runs up to `num_requests` of the workload one at a time (max_concurrency 1): their median
    TPOT is the measured pure-decode step, their median TTFT the unloaded time to first token.
    The warm-ups send those same prompts first: ``reset`` (the deployment's prefix-cache reset,
    as `run_sweep`'s, when `options.reset_prefix_cache`) forgets them before the timed requests,
    else the TTFT measured is a cached prompt's (for long prompts a small fraction of their
    uncached time: an SLO no run could hold). ``stats``: the cluster's
    stats(), for the prefix hits of the timed requests (``prefix_cache``).
    """
    sample = list(requests[:num_requests])
    warm_up(backend, sample, options.num_warmups)
    if reset is not None and options.reset_prefix_cache:
        reset()
    before = stats() if stats else None
    outcome = run(backend, sample, request_rate=math.inf, max_concurrency=1)
    hits = prefix_cache_of(before, stats() if stats else None)
    done = [out for out in outcome.outputs if out.success]
    tpots = [out.tpot for out in done if out.tpot is not None]
    if not done or not tpots:
        raise RuntimeError("SLO calibration: no isolated request finished with >= 2 tokens; "
                           f"errors: {[out.error for out in outcome.outputs][:3]}")
    step_ms, ttft_ms = float(np.median(tpots)) * 1e3, float(np.median([o.ttft for o in done])) * 1e3
    return {"slos_ms": {"ttft": options.calibrate_ttft_scale * ttft_ms, "tpot": options.calibrate_tpot_scale * step_ms},
            "isolated_tpot_ms": step_ms, "isolated_ttft_ms": ttft_ms, "num_requests": len(sample),
            "prefix_cache_reset": reset is not None and options.reset_prefix_cache, "prefix_cache": hits,
            "rule": f"ttft = {options.calibrate_ttft_scale} x isolated median TTFT, "
                    f"tpot = {options.calibrate_tpot_scale} x isolated median TPOT (batch-1 decode step)"}


def busy_fractions(before: Mapping | None, after: Mapping | None, duration_s: float) -> dict[str, float] | None:
    """Per instance, the fraction of the run it spent in engine steps (needs ``busy_s`` in stats)."""
    return _fractions_of_run(before, after, duration_s, _busy_seconds)


def host_cpu_fractions(before: Mapping | None, after: Mapping | None, duration_s: float) -> dict[str, float] | None:
    """The CPU the launching process spent during the run, as a fraction of the run: its router
    thread's and the whole process's (the bench client, Ray's driver threads and the router;
    several threads can add up past 1.0). From the router's ``cpu_s`` (`Router.snapshot`); None
    when the stats have none (a server benchmarked over HTTP)."""
    return _fractions_of_run(before, after, duration_s,
                             lambda stats: {name: float(s) for name, s in
                                            ((stats.get("router") or {}).get("cpu_s") or {}).items()})


def _fractions_of_run(before: Mapping | None, after: Mapping | None, duration_s: float,
                      seconds: Callable[[Mapping], dict[str, float]]) -> dict[str, float] | None:
    """Each of ``seconds(stats)``'s counters: how much it grew from ``before`` to ``after``, over
    ``duration_s``; None without both stats, a run time, or any counter in both."""
    if not before or not after or duration_s <= 0:
        return None
    start, end = seconds(before), seconds(after)
    fractions = {name: (end[name] - start[name]) / duration_s for name in end if name in start}
    return fractions or None


def _busy_seconds(stats: Mapping) -> dict[str, float]:
    items = stats.get("instances", stats)
    entries = items.items() if isinstance(items, Mapping) else enumerate(items)
    seconds = {}
    for key, entry in entries:
        if isinstance(entry, Mapping) and isinstance(entry.get("busy_s"), (int, float)):
            name = entry.get("name") or (key if isinstance(key, str) else f"{entry.get('role', 'instance')}-{key}")
            seconds[str(name)] = float(entry["busy_s"])
    return seconds


def bench_config(config_path: str | Path, options: SweepOptions, *, overrides: Mapping[str, Any] | None = None,
                 slos_by_dataset: Mapping[str, Mapping[str, float] | None] | None = None,
                 label: str | None = None, extra: Mapping[str, Any] | None = None,
                 on_result: Callable[[dict[str, Any]], None] | None = None,
                 launched: Any = None) -> list[DatasetRuns]:
    """Launch the cluster of `config_path` (+ overrides), sweep every workload, shut down.

    Args:
        slos_by_dataset: SLOs per workload (from an earlier deployment's calibration); a workload
            without any takes `options.goodput_slos_ms`, else calibrates (`--slo-calibrate`), else
            the config's `bench.goodput`.
        extra: stored in each result (vLLM's --metadata).
        launched: a fleet already launched from `config_path` as it is (no overrides), swept instead
            of a new launch and shut down at the end as one launched here (`make demo` streams its
            prompts on it first).
    """
    from disagg.cluster import Cluster
    from disagg.cluster.bench.backends import ClusterBackend
    from disagg.config import Config

    config = Config.from_yaml(config_path)
    if overrides:
        config = config.override(dict(overrides))
    shown = public_overrides(overrides)
    label = label or config.name + "".join(f"[{k.split('.')[-1]}={v}]" for k, v in shown.items())
    common = {"label": label, "num_gpus": config.instances.num_gpus, "config_path": str(config_path),
              "overrides": shown, "model_id": config.model.source, "dtype": config.model.dtype,
              "tokenizer_id": config.model.source}  # the tokenizer is read from model.source
    runs = []
    if launched is not None and overrides:
        raise ValueError(f"launched: a fleet of {config_path} as it is, got overrides {shown} too")
    with (launched if launched is not None else Cluster.launch(config)) as cluster:
        common["device_unit"] = device_unit(config, cluster)
        backend = ClusterBackend(cluster, name=label)
        for dataset in options.dataset_names:
            spec = workload_for(cluster, replace(options, dataset_name=dataset))
            requests = sample_requests(spec)
            slos = (slos_by_dataset or {}).get(dataset) or options.goodput_slos_ms
            info = dict(common, workload=spec.to_dict(), calibration=None)
            if not slos and options.calibrate_slos:
                info["calibration"] = calibrate(backend, requests, options, reset=cluster.reset_prefix_cache,
                                                stats=cluster.stats)
                logger.warning("%s / %s: calibrated SLOs %s (%s)", label, dataset,
                               fmt_slos(info["calibration"]["slos_ms"]), info["calibration"]["rule"])
            slos = dict(slos or (info["calibration"] or {}).get("slos_ms") or config.bench.goodput)
            stored = dict(extra or {}, **common, calibration=info["calibration"])
            results = run_sweep(backend, requests, options, label=label, slos_ms=slos, stats=cluster.stats,
                                reset=cluster.reset_prefix_cache,
                                workload=spec.to_dict(), config=config.model_dump(mode="json", exclude=SECRET_FIELDS), extra=stored,
                                on_result=on_result)
            runs.append(DatasetRuns(dataset, results, slos, info))
    return runs


def device_unit(config: Any, cluster: Any) -> str:
    """What one of `num_gpus` is on this run: "GPU", or "instance" on a CPU fleet (per-GPU figures
    then count CPU instances, and tables and plots say so)."""
    device = config.instances.device
    if device == "auto":
        try:
            device = str(cluster.stats().get("device", "cuda"))
        except Exception:  # stats are a nicety here; the unit defaults to the GPU
            device = "cuda"
    return "instance" if device.startswith("cpu") else "GPU"


def workload_for(cluster: Any, options: SweepOptions) -> WorkloadSpec:
    """The workload spec of `options`, sized to the cluster's model (vocab, context, EOS ids)."""
    vocab = options.vocab_size or _first_attr(cluster, ("vocab_size",), ("model_config", "vocab_size")) \
        or _source_vocab_size(getattr(cluster, "config", None)) or _first_attr(cluster, ("tokenizer", "vocab_size"))
    if vocab is None:
        raise ValueError("cannot tell the model's vocabulary size from the cluster; pass --vocab-size")
    eos = _first_attr(cluster, ("eos_token_ids",), ("model_config", "eos_token_ids"),
                      ("tokenizer", "eos_token_ids")) or ()
    return WorkloadSpec(options.dataset_name, options.num_prompts, options.seed, int(vocab),
                        getattr(cluster, "max_model_len", None), options.input_len, options.output_len,
                        options.range_ratio, tuple(int(t) for t in eos)).resolved()


def _source_vocab_size(config: Any) -> int | None:
    """The vocabulary of `config.model.source` read from its preset or config.json (no weights)."""
    source = getattr(getattr(config, "model", None), "source", None)
    if not source:
        return None
    try:
        if source.startswith("dummy:"):
            from disagg.model.presets import preset_config

            return preset_config(source.removeprefix("dummy:")).vocab_size
        if Path(source).is_dir():
            from disagg.model.config import ModelConfig

            return ModelConfig.from_dir(source).vocab_size
    except Exception as err:  # a source the driver cannot read: fall through to other hints
        logger.warning("could not read the vocabulary size of %s: %s", source, err)
    return None


def _first_attr(obj: Any, *paths: tuple[str, ...]) -> Any:
    for path in paths:
        value = obj
        for name in path:
            value = getattr(value, name, None)
        if value is not None:
            return value
    return None


def compare_configs(config_a: str | Path, others: Sequence[str | Path], out_dir: str | Path,
                    options: SweepOptions, *, variants: Sequence[Mapping[str, Any]] = (),
                    overrides: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                    mismatches: Sequence[str] = (), notes: Sequence[str] = (), launched: Any = None,
                    on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Sweep CONFIG (with `overrides`) and every comparison config (each also with every override
    set of `variants`).

    Each deployment is launched once and runs every workload. Per workload it writes
    <dir>/<label>-<rate>qps-<date>.json per run (as each run ends; its path goes into the
    result as "result_file" before `on_result` sees it), compare.json and the PNG plots, where
    <dir> is out_dir for one workload and out_dir/<dataset> for several; summary.md goes to out_dir.

    Args:
        extra: stored in each result (vLLM's --metadata).
        mismatches: how the deployments differ (allowed by the caller), noted in the summaries.
        notes: lines for the head of summary.md and the summaries' "notes" (e.g. why the figures
            do not compare deployments).
        launched: CONFIG's fleet, already launched (`bench_config`'s ``launched``).

    Returns:
        the summary of the one workload, or {"datasets": {name: summary}} for several.
    """
    out_dir = Path(out_dir)
    deployments = [(config_a, dict(overrides or {}) or None)] + [(path, var) for path in others for var in (list(variants) or [None])]
    names = options.dataset_names
    folders = {name: out_dir if len(names) == 1 else out_dir / name for name in names}
    slos: dict[str, Any] = {}
    collected: dict[str, list[DatasetRuns]] = {name: [] for name in names}
    files: dict[tuple[str, str], list[str]] = {}

    def save(result: dict[str, Any]) -> None:
        dataset = result["workload"]["dataset_name"]
        result["result_file"] = str(save_json(result, folders[dataset] / result_name(result)))
        files.setdefault((result["label"], dataset), []).append(result["result_file"])
        if on_result is not None:
            on_result(result)

    for index, (path, overrides) in enumerate(deployments):
        for runs in bench_config(path, options, overrides=overrides, slos_by_dataset=slos, extra=extra,
                                 on_result=save, launched=launched if index == 0 else None):
            slos.setdefault(runs.dataset, runs.slos_ms)
            runs.info["result_files"] = files.get((runs.info["label"], runs.dataset), [])
            collected[runs.dataset].append(runs)
    summaries = {name: summarize_comparison(collected[name], options, folders[name], mismatches, notes)
                 for name in names}
    write_markdown(out_dir / "summary.md", comparison_summary(summaries))
    if len(names) == 1:
        return summaries[names[0]]
    everything = {"datasets": summaries}
    save_json(everything, out_dir / "compare.json")
    return everything


def summarize_comparison(sides_runs: Sequence[DatasetRuns], options: SweepOptions, folder: Path,
                         mismatches: Sequence[str] = (), notes: Sequence[str] = ()) -> dict[str, Any]:
    """compare.json and the plots of one workload's sweeps on every deployment (or one alone)."""
    from disagg.cluster.bench import plots

    slos = sides_runs[0].slos_ms
    sides = [cmp.side_summary(runs.info["label"], runs.results, runs.info["num_gpus"] or 1, slos,
                              options.slo_scales) for runs in sides_runs]
    for side, runs in zip(sides, sides_runs):
        side["device_unit"] = runs.info.get("device_unit", "GPU")
    summary = {"dataset": sides_runs[0].dataset, "sides": sides, "comparison": cmp.compare_sides(sides, slos),
               "runs": [runs.info for runs in sides_runs], "slos_ms": slos, "slo_scales": list(options.slo_scales),
               "options": vars(replace(options, rates=[rate_to_json(r) for r in options.rates])),
               "context": run_context([r for runs in sides_runs for r in runs.results]),
               "mismatches": list(mismatches), "notes": list(notes)}
    summary["plots"] = plots.write_all({runs.info["label"]: runs.results for runs in sides_runs}, summary, folder)
    save_json(summary, folder / "compare.json")
    return summary


def safe_name(label: str) -> str:
    """``label`` as a file name any shell or copy tool takes: letters, digits, ``-_.``; runs of
    anything else become one ``_`` (``base[router.placement=local]`` -> ``base_router.placement_local``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def result_name(result: Mapping[str, Any]) -> str:
    """vLLM's result file name, <label>-<rate>qps-<date>.json: a re-run writes a new file."""
    return f"{safe_name(result['label'])}-{result['request_rate']}qps-{result['date']}.json"


def bench_url(target: Any, options: SweepOptions, *, slos_ms: Mapping[str, float] | None,
              max_model_len: int | None = None, label: str | None = None, extra: Mapping[str, Any] | None = None,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Sweep an OpenAI-compatible server (no cluster stats, no emit times unless it sends them).

    Args:
        target: a `flags.Target` (URL, endpoint, key, headers, model, tokenizer).
        extra: stored in each result (vLLM's --metadata).

    Raises:
        ValueError: `options.vocab_size` is unset (a server does not say its vocabulary size).
        TargetError: the server is unreachable, refuses the key or names no model (before any run).
    """
    import asyncio

    from disagg.cluster.bench.backends import HttpBackend

    if options.vocab_size is None:
        raise ValueError("--vocab-size: required with --base-url (prompt token ids are drawn below it), got none")
    spec = WorkloadSpec(options.dataset_name, options.num_prompts, options.seed, options.vocab_size,
                        max_model_len, options.input_len, options.output_len, options.range_ratio).resolved()
    backend = HttpBackend(target.base_url, model=target.model, endpoint=target.endpoint, api_key=target.api_key,
                          headers=target.headers, verify=not target.insecure)
    asyncio.run(backend.check(target.ready_timeout_s))
    info = dict(extra or {}, base_url=target.base_url, num_gpus=None, device_unit="GPU",
                model_id=target.model_id or backend.model, tokenizer_id=target.tokenizer_id)
    return run_sweep(backend, sample_requests(spec), options, label=label or target.base_url, slos_ms=slos_ms,
                     workload=spec.to_dict(), extra=info, on_result=on_result,
                     reset=lambda: asyncio.run(backend.reset_prefix_cache()))
