"""`disagg bench`: the typer command (registered by disagg.cluster.cli.app as `bench`, class `BenchCommand`).

`vllm bench serve`'s options are taken under their names and in their form (`--goodput ttft:500
tpot:50`, `--metadata k=v k2=v2`, `--host`/`--port`, OPENAI_API_KEY); those with no meaning here
exit 2 saying what to use instead (the tables are in disagg.cluster.serve.vllm_options). Values
not given come from CONFIG's `bench:` section. Three shapes:
  disagg bench CONFIG                         sweep one deployment (launched here)
  disagg bench CONFIG --compare CONFIG2       sweep both on the same workload, compare goodput
  disagg bench [CONFIG] --base-url URL        sweep a running OpenAI-compatible server

Exit status: 0 when some request succeeded; 1 when none did (each failure reason is printed with
its count), when the server is unreachable or refuses the key (one line), or when a deployment
fails to launch; 2 for a bad flag or config (before anything launches); 130 on Ctrl-C (one line
saying which results were kept). Runs in the CLI process; session.py carries the run.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from disagg.cluster.bench import flags
from disagg.cluster.cli.common import (BurstinessOpt, InputLenOpt, MaxConcurrencyOpt, MetricPercentilesOpt,
                                       MinPromptsOpt, NumPromptsOpt, OutputLenOpt, RandomInputLenOpt,
                                       RandomOutputLenOpt, RangeRatioOpt, RequestRateOpt, ResultFilenameOpt,
                                       RunSecondsOpt, SeedOpt)
from disagg.cluster.bench.workloads import DATASETS
from disagg.cluster.serve.vllm_options import BENCH_IGNORED, BENCH_REFUSED, add_vllm_options, greedy_command

logger = logging.getLogger(__name__)

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
BenchCommand = greedy_command(flags.GREEDY_FLAGS)  # vLLM's nargs="+" flags; pass as cls= when registering

Opt = typer.Option


@add_vllm_options(mapped=(), refused=BENCH_REFUSED, ignored=BENCH_IGNORED)
def bench_command(
    config: Annotated[Optional[Path], typer.Argument(help="deployment YAML (launched here unless --base-url)")] = None,
    compare: Annotated[Optional[list[Path]], Opt("--compare", help="config(s) to compare CONFIG with on the same "
                       "workload and GPUs (default: CONFIG's bench.compare_with)")] = None,
    compare_variant: Annotated[Optional[list[str]], Opt(help="KEY=V1,V2: also run each --compare config with "
                               "these dotted overrides; the best per SLO scale is compared")] = None,
    no_compare: Annotated[bool, Opt("--no-compare", help="ignore bench.compare_with")] = False,
    allow_mismatch: Annotated[bool, Opt("--allow-mismatch", help="compare deployments that differ in model, "
                              "dtype or workload (refused otherwise), with a warning")] = False,
    set_: Annotated[Optional[list[str]], Opt("--set", metavar="KEY=VALUE", help="a dotted override of CONFIG, "
                    "e.g. --set scheduler.max_num_batched_tokens=2048")] = None,
    from_results: Annotated[Optional[list[Path]], Opt(help="compare result folders written earlier "
                            "(first = the deployment under test) instead of running anything")] = None,
    backend: Annotated[str, Opt(help=f"request format: {' or '.join(flags.HTTP_BACKENDS)} (both "
                       "/v1/completions; vLLM's others are not supported)")] = "openai",
    label: Annotated[Optional[str], Opt(help="name of the results (default: the config's name or the URL)")] = None,
    base_url: Annotated[Optional[str], Opt(help="benchmark a running OpenAI-compatible server")] = None,
    host: Annotated[Optional[str], Opt(help="benchmark the server on this host (http://HOST:PORT)",
                    show_default=False)] = None,
    port: Annotated[Optional[int], Opt(help="... and port (default 8000 with --host)", show_default=False)] = None,
    endpoint: Annotated[str, Opt(help="completions path of the server")] = "/v1/completions",
    api_key: Annotated[Optional[str], Opt(envvar="OPENAI_API_KEY", show_default=False,
                       help="the server's key, sent as 'Authorization: Bearer KEY'")] = None,
    header: Annotated[Optional[list[str]], Opt(help="KEY=VALUE headers sent with every request "
                      "(vLLM's form: --header a=1 b=2)")] = None,
    insecure: Annotated[bool, Opt("--insecure", help="skip TLS certificate checks")] = False,
    ready_check_timeout_sec: Annotated[int, Opt(min=0, help="wait this long for the server to answer")] = 0,
    model: Annotated[Optional[str], Opt(help="model name sent to the server and recorded (default: the "
                     "first of /v1/models)")] = None,
    served_model_name: Annotated[Optional[str], Opt(help="model name sent, when it differs from --model")] = None,
    tokenizer: Annotated[Optional[str], Opt(help="recorded as tokenizer_id; a local HF folder also gives "
                         "--vocab-size")] = None,
    vocab_size: Annotated[Optional[int], Opt(min=2, help="token ids drawn below this (with --base-url)")] = None,
    dataset_name: Annotated[str, Opt(help=f"one of {', '.join(DATASETS)}; several, comma-separated, run on "
                            "one launch each")] = "random",
    num_prompts: NumPromptsOpt = None,
    input_len: InputLenOpt = None,
    output_len: OutputLenOpt = None,
    random_input_len: RandomInputLenOpt = None,
    random_output_len: RandomOutputLenOpt = None,
    random_range_ratio: RangeRatioOpt = None,
    seed: SeedOpt = None,
    request_rate: RequestRateOpt = None,
    burstiness: BurstinessOpt = None,
    max_concurrency: MaxConcurrencyOpt = None,
    num_warmups: Annotated[int, Opt(min=0, help="untimed requests, sent together, before each "
                           "workload's first run")] = 1,
    request_timeout: Annotated[Optional[float], Opt(help="seconds before a request is cancelled")] = None,
    goodput: Annotated[Optional[list[str]], Opt(help="SLOs in ms: --goodput ttft:500 tpot:50 (vLLM's "
                       "form; repeating the flag works too)")] = None,
    slo_calibrate: Annotated[bool, Opt("--slo-calibrate", help="derive SLOs from isolated requests on "
                             "CONFIG (ttft 3x isolated TTFT, tpot 2.5x batch-1 decode step)")] = False,
    slo_scales: Annotated[Optional[str], Opt(help="SLO multipliers judged from the same runs")] = None,
    percentile_metrics: Annotated[Optional[str], Opt(help="latencies the tables show: some of "
                                  "ttft,tpot,itl,e2el (default all)", show_default=False)] = None,
    metric_percentiles: MetricPercentilesOpt = "50,90,99",
    save_result: Annotated[bool, Opt("--save-result", help="write each run's JSON and summary.md "
                           "(always on with a comparison)")] = False,
    result_dir: Annotated[Optional[Path], Opt(help="where JSON, summary.md and PNGs go (default "
                          "bench.results_dir)")] = None,
    result_filename: ResultFilenameOpt = None,
    metadata: Annotated[Optional[list[str]], Opt(help="KEY=VALUE pairs stored in every result "
                        "(--metadata version=0.3 tp=1)")] = None,
    disable_tqdm: Annotated[bool, Opt("--disable-tqdm", help="no progress bar")] = False,
    run_seconds: RunSecondsOpt = None,
    min_prompts: MinPromptsOpt = 50,
    early_stop: Annotated[bool, Opt("--early-stop", help="sweep rates upward and stop once attainment under "
                          "the loosest --slo-scales SLOs falls below 90%")] = False,
    keep_prefix_cache: Annotated[bool, Opt("--keep-prefix-cache", help="do not reset the deployment's prefix "
                                 "caches before each run (by default a run starts with none cached, so its "
                                 "hits are its own prompts' reuse, not the previous run's)")] = False,
    **vllm_options: Any,
) -> None:
    """Measure serving at the client as `vllm bench serve` does; compare deployments by goodput.
    Exit status 1 when no request succeeded or the server cannot be used, 2 for a bad flag,
    130 on Ctrl-C."""
    from disagg.cluster.bench import session
    from disagg.cluster.bench.sweep import SweepOptions

    if backend not in flags.HTTP_BACKENDS:
        raise typer.BadParameter(f"expected {' or '.join(flags.HTTP_BACKENDS)} (token-id prompts to "
                                 f"/v1/completions), got {backend!r}", param_hint="--backend")
    datasets = flags.datasets(dataset_name)
    target = flags.target(base_url, host, port, endpoint=endpoint, api_key=api_key,
                          headers=flags.key_values(header, "--header", "x-tenant=a"),
                          model=served_model_name or model, model_id=model, tokenizer_id=tokenizer,
                          insecure=insecure, ready_timeout_s=float(ready_check_timeout_sec))
    if config is None and target is None and not from_results:
        raise typer.BadParameter("give a CONFIG to launch, --base-url of a running server, or --from-results",
                                 param_hint="CONFIG")
    vocab_size = vocab_size or flags.tokenizer_vocab_size(tokenizer)
    if target is not None and vocab_size is None:
        raise typer.BadParameter("required with --base-url (prompt token ids are drawn below it); or give "
                                 "--tokenizer DIR, a local HF folder", param_hint="--vocab-size")
    rates = flags.rates(request_rate)
    slos = flags.goodput(goodput)
    scales = flags.positive_floats(slo_scales, "--slo-scales")
    if burstiness is not None:
        from disagg.cluster.bench.arrivals import check_burstiness

        flags.checked(check_burstiness, burstiness, "--burstiness")
    if random_range_ratio is not None and not 0 <= random_range_ratio < 1:
        raise typer.BadParameter(f"expected a number in [0, 1), got {random_range_ratio}",
                                 param_hint="--random-range-ratio")
    variants = flags.variants(compare_variant)
    overrides = flags.overrides(set_)
    defaults = _config_defaults(config, overrides)
    others = [] if no_compare else list(compare or ([defaults["compare_with"]] if defaults.get("compare_with") else []))
    random_only = datasets == ["random"]
    options = SweepOptions(
        num_prompts=num_prompts or defaults.get("num_prompts", 100),
        rates=rates or defaults.get("request_rates") or [math.inf], dataset_name=datasets[0], datasets=datasets,
        input_len=input_len or random_input_len or (defaults.get("input_len") if random_only else None),
        output_len=output_len or random_output_len or (defaults.get("output_len") if random_only else None),
        range_ratio=random_range_ratio, burstiness=burstiness or defaults.get("burstiness", 1.0),
        max_concurrency=max_concurrency, seed=defaults.get("seed", 0) if seed is None else seed,
        goodput_slos_ms=slos or (None if slo_calibrate else defaults.get("goodput")),
        percentiles=flags.percentiles(metric_percentiles), num_warmups=num_warmups,
        request_timeout_s=request_timeout, calibrate_slos=slo_calibrate, vocab_size=vocab_size,
        show_progress=not disable_tqdm, result_filename=result_filename,
        save_results=save_result or bool(others), run_seconds=run_seconds, min_prompts=min_prompts,
        early_stop=early_stop, reset_prefix_cache=not keep_prefix_cache)
    if scales:
        options.slo_scales = tuple(scales)
    bench_run = session.BenchRun(config=config, others=others, variants=variants, overrides=overrides, target=target,
                                 from_results=list(from_results or []), label=label,
                                 out_dir=result_dir or Path(defaults.get("results_dir", "results")),
                                 metadata=flags.key_values(metadata, "--metadata", "version=0.3.3"),
                                 table_metrics=flags.percentile_metrics(percentile_metrics),
                                 allow_mismatch=allow_mismatch)
    raise typer.Exit(session.run(bench_run, options))


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
