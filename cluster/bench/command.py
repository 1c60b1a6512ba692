"""`disagg bench`: the typer command (registered by disagg.cluster.cli as `bench`).

Flags keep `vllm bench serve`'s names where one exists. Values not given on the command line
come from CONFIG's `bench:` section (num_prompts, input/output length, rates, burstiness,
goodput SLOs, seed, compare_with, results_dir). Three shapes:
  disagg bench CONFIG                         sweep one deployment (launched here)
  disagg bench CONFIG --compare CONFIG2       sweep both on the same workload, compare goodput
  disagg bench [CONFIG] --base-url URL        sweep a running OpenAI-compatible server
Bad values are refused before anything launches, with the flag, what was expected and what came.
"""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from disagg.cluster.bench.arrivals import check_burstiness, parse_rates
from disagg.cluster.bench.metrics import parse_goodput
from disagg.cluster.bench.workloads import DATASETS

logger = logging.getLogger(__name__)


def _rates(value: Optional[str]) -> Optional[list[float]]:
    return None if value is None else _checked(parse_rates, value, "--request-rate")


def _floats(value: Optional[str], flag: str) -> Optional[list[float]]:
    if value is None:
        return None
    try:
        numbers = [float(item) for item in value.replace(" ", "").split(",") if item]
    except ValueError:
        raise typer.BadParameter(f"expected numbers separated by commas, got {value!r}", param_hint=flag) from None
    if not numbers or any(not (x > 0 and math.isfinite(x)) for x in numbers):
        raise typer.BadParameter(f"expected positive finite numbers, got {value!r}", param_hint=flag)
    return numbers


def _checked(parse, value, flag: str):
    try:
        return parse(value)
    except ValueError as err:
        raise typer.BadParameter(str(err).removeprefix(f"{flag}: "), param_hint=flag) from None


def _sets(specs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` flags -> dotted overrides of CONFIG (values parsed as YAML scalars)."""
    import yaml

    overrides = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE such as router.lease_s=5, got {spec!r}", param_hint="--set")
        overrides[key] = yaml.safe_load(value)
    return overrides


def _variants(specs: list[str]) -> list[dict[str, Any]]:
    """``KEY=V1,V2`` flags -> every combination as dotted overrides (values parsed as YAML scalars)."""
    import yaml

    axes = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise typer.BadParameter(f"expected KEY=V1,V2,... such as scheduler.max_num_batched_tokens="
                                     f"512,2048, got {spec!r}", param_hint="--compare-variant")
        axes.append([(key, yaml.safe_load(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else []


def bench_command(
    config: Annotated[Optional[Path], typer.Argument(help="deployment YAML (launched here unless --base-url)")] = None,
    compare: Annotated[Optional[list[Path]], typer.Option("--compare", help="config(s) to compare CONFIG with "
                       "on the same workload and GPUs (default: CONFIG's bench.compare_with)")] = None,
    compare_variant: Annotated[Optional[list[str]], typer.Option(help="KEY=V1,V2: also run each --compare "
                               "config with these dotted overrides; the best per SLO scale is compared")] = None,
    no_compare: Annotated[bool, typer.Option("--no-compare", help="ignore bench.compare_with")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="KEY=VALUE: a dotted override of CONFIG, "
                    "e.g. --set scheduler.max_num_batched_tokens=2048")] = None,
    from_results: Annotated[Optional[list[Path]], typer.Option(help="compare result folders written earlier "
                            "(first = the deployment under test) instead of running anything")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="benchmark a running OpenAI-compatible server")] = None,
    model: Annotated[Optional[str], typer.Option(help="model name sent to --base-url")] = None,
    endpoint: Annotated[str, typer.Option(help="completions path of --base-url")] = "/v1/completions",
    dataset_name: Annotated[str, typer.Option(help=f"one of {', '.join(DATASETS)}; several, comma-separated, "
                            "run on one launch each")] = "random",
    num_prompts: Annotated[Optional[int], typer.Option(min=1, help="requests per run")] = None,
    request_rate: Annotated[Optional[str], typer.Option(help="req/s; a sweep: 1,2,4,inf")] = None,
    burstiness: Annotated[Optional[float], typer.Option(help="gamma shape of arrivals; 1 = Poisson")] = None,
    max_concurrency: Annotated[Optional[int], typer.Option(min=1, help="requests in flight at most")] = None,
    seed: Annotated[Optional[int], typer.Option(help="seed of prompts and arrivals")] = None,
    random_input_len: Annotated[Optional[int], typer.Option(min=1, help="prompt tokens")] = None,
    random_output_len: Annotated[Optional[int], typer.Option(min=1, help="output tokens")] = None,
    random_range_ratio: Annotated[Optional[float], typer.Option(help="lengths uniform in len*(1 +- r)")] = None,
    goodput: Annotated[Optional[list[str]], typer.Option(help="SLOs, e.g. --goodput ttft:200 --goodput tpot:50")] = None,
    slo_calibrate: Annotated[bool, typer.Option(help="derive SLOs from isolated requests on CONFIG "
                             "(ttft 3x isolated TTFT, tpot 2.5x batch-1 decode step)")] = False,
    slo_scales: Annotated[Optional[str], typer.Option(help="SLO multipliers judged from the same runs")] = None,
    metric_percentiles: Annotated[str, typer.Option(help="percentiles reported")] = "50,90,99",
    num_warmups: Annotated[int, typer.Option(min=0, help="untimed requests, sent together, before each "
                            "workload's first run")] = 1,
    request_timeout: Annotated[Optional[float], typer.Option(help="seconds before a request is cancelled")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(min=2, help="token ids drawn below this (needed with --base-url)")] = None,
    save_result: Annotated[bool, typer.Option(help="write the JSON result of every run (always on with "
                           "a comparison)")] = False,
    result_dir: Annotated[Optional[Path], typer.Option(help="where JSON and PNGs go (default bench.results_dir)")] = None,
    result_filename: Annotated[Optional[str], typer.Option(help="file name of a single run's JSON")] = None,
    disable_tqdm: Annotated[bool, typer.Option(help="no progress bar")] = False,
    run_seconds: Annotated[Optional[float], typer.Option(min=0.001, help="per rate, send about rate x this "
                           "many requests (at least --min-prompts, at most --num-prompts)")] = None,
    min_prompts: Annotated[int, typer.Option(min=1, help="fewest requests of a run under --run-seconds")] = 50,
    early_stop: Annotated[bool, typer.Option(help="sweep rates upward and stop once attainment under the "
                          "loosest --slo-scales SLOs falls below 90%")] = False,
) -> None:
    """Measure serving at the client as `vllm bench serve` does; compare deployments by goodput."""
    from disagg.cluster.bench.sweep import SweepOptions

    datasets = [name for name in dataset_name.replace(" ", "").split(",") if name]
    unknown = [name for name in datasets if name not in DATASETS]
    if unknown or not datasets:
        raise typer.BadParameter(f"expected one or more of {', '.join(DATASETS)} (comma-separated), got "
                                 f"{dataset_name!r}", param_hint="--dataset-name")
    if config is None and base_url is None and not from_results:
        raise typer.BadParameter("give a CONFIG to launch, --base-url of a running server, or --from-results",
                                 param_hint="CONFIG")
    if base_url is not None and vocab_size is None:
        raise typer.BadParameter("required with --base-url (prompt token ids are drawn below it)",
                                 param_hint="--vocab-size")
    rates = _rates(request_rate)
    slos = _checked(parse_goodput, goodput, "--goodput") if goodput else None
    scales = _floats(slo_scales, "--slo-scales")
    percentiles = _floats(metric_percentiles, "--metric-percentiles")
    if burstiness is not None:
        _checked(check_burstiness, burstiness, "--burstiness")
    if random_range_ratio is not None and not 0 <= random_range_ratio < 1:
        raise typer.BadParameter(f"expected a number in [0, 1), got {random_range_ratio}", param_hint="--random-range-ratio")
    variants = _variants(compare_variant or [])
    overrides = _sets(set_ or [])
    defaults = _config_defaults(config, overrides)
    others = [] if no_compare else list(compare or ([defaults["compare_with"]] if defaults.get("compare_with") else []))
    options = SweepOptions(
        num_prompts=num_prompts or defaults.get("num_prompts", 100),
        rates=rates or defaults.get("request_rates") or [math.inf], dataset_name=datasets[0], datasets=datasets,
        input_len=random_input_len or (defaults.get("input_len") if datasets == ["random"] else None),
        output_len=random_output_len or (defaults.get("output_len") if datasets == ["random"] else None),
        range_ratio=random_range_ratio, burstiness=burstiness or defaults.get("burstiness", 1.0),
        max_concurrency=max_concurrency, seed=defaults.get("seed", 0) if seed is None else seed,
        goodput_slos_ms=slos or (None if slo_calibrate else defaults.get("goodput")),
        percentiles=tuple(percentiles), num_warmups=num_warmups, request_timeout_s=request_timeout,
        calibrate_slos=slo_calibrate, vocab_size=vocab_size, show_progress=not disable_tqdm,
        result_filename=result_filename, save_results=save_result or bool(others),
        run_seconds=run_seconds, min_prompts=min_prompts, early_stop=early_stop)
    if scales:
        options.slo_scales = tuple(scales)
    out_dir = result_dir or Path(defaults.get("results_dir", "results"))
    if from_results:
        _compare_stored(from_results, out_dir, options)
        return
    _run(config, others, variants, overrides, base_url, model, endpoint, out_dir, options)


def _config_defaults(config: Optional[Path], overrides: dict[str, Any]) -> dict[str, Any]:
    if config is None:
        return {}
    from disagg.config import Config
    from disagg.errors import ConfigError

    try:
        loaded = Config.from_yaml(config)
        return (loaded.override(overrides) if overrides else loaded).bench.model_dump()
    except ConfigError as err:
        raise typer.BadParameter(str(err), param_hint="--set" if overrides else "CONFIG") from None


def _compare_stored(paths: list[Path], out_dir: Path, options) -> None:
    from rich.console import Console

    from disagg.cluster.bench import stored

    try:
        summary = stored.compare_stored(paths, out_dir, options)
    except ValueError as err:
        raise typer.BadParameter(str(err).removeprefix("--from-results: "), param_hint="--from-results") from None
    _print_comparison(Console(), summary, options, out_dir)


def _print_comparison(console, summary: dict, options, out_dir: Path) -> None:
    from disagg.cluster.bench import report

    for name, one in (summary.get("datasets") or {options.dataset_name: summary}).items():
        console.print(f"[bold]{one.get('dataset', name)}[/bold]")
        console.print(report.comparison_table(one))
        console.print(report.common_rate_table(one))
        console.print(f"plots: {', '.join(one['plots'])}")
    console.print(f"results, compare.json and summary.md under {out_dir}")


def _run(config, others, variants, overrides, base_url, model, endpoint, out_dir: Path, options) -> None:
    from rich.console import Console

    from disagg.cluster.bench import report, sweep

    console = Console()
    if others and base_url is None:
        summary = sweep.compare_configs(config, others, out_dir, options, variants=variants, overrides=overrides)
        _print_comparison(console, summary, options, out_dir)
        return
    if base_url is not None:
        if others:
            raise typer.BadParameter("--compare needs configs launched here; drop --base-url", param_hint="--compare")
        if len(options.dataset_names) > 1:
            raise typer.BadParameter("one dataset at a time with --base-url", param_hint="--dataset-name")
        results = sweep.bench_url(base_url, options, slos_ms=options.goodput_slos_ms, model=model, endpoint=endpoint,
                                  on_result=_saver(options, out_dir) if options.save_results else None)
        runs = [sweep.DatasetRuns(options.dataset_name, results, options.goodput_slos_ms,
                                  {"label": base_url, "num_gpus": 1})]
    else:
        runs = sweep.bench_config(config, options, overrides=overrides,
                                  on_result=_saver(options, out_dir) if options.save_results else None)
    for one in runs:
        for result in one.results:
            console.print(report.run_table(result))
        calibration = one.info.get("calibration")
        console.print(f"{one.dataset}: SLOs {one.slos_ms} ms"
                      + (f" (calibrated: {calibration['rule']}; isolated TTFT {calibration['isolated_ttft_ms']:.1f} ms, "
                         f"TPOT {calibration['isolated_tpot_ms']:.2f} ms)" if calibration else ""))
        if options.save_results and one.slos_ms:
            sweep.summarize_comparison([one], options, _folder(options, out_dir, one.dataset))
    if options.save_results:
        console.print(f"results under {out_dir}")


def _folder(options, out_dir: Path, dataset: str) -> Path:
    return out_dir if len(options.dataset_names) == 1 else out_dir / dataset


def _saver(options, out_dir: Path):
    """Save each run's result as soon as it exists (vLLM's file name unless --result-filename)."""
    from disagg.cluster.bench import report, sweep

    single = len(options.rates) == 1 and len(options.dataset_names) == 1

    def save(result: dict) -> None:
        name = options.result_filename if options.result_filename and single else \
            f"{sweep.safe_name(result['label'])}-{result['request_rate']}qps-{result['date']}.json"
        report.save_json(result, _folder(options, out_dir, result["workload"]["dataset_name"]) / name)
    return save
