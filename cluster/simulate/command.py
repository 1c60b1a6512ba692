"""The typer commands `disagg profile`, `disagg simulate` and `disagg plan` (registered by
`disagg.cluster.cli.app`).

    disagg profile CONFIG --out profile.json [--small-grid]
    disagg profile --refit old.json --out profile.json      (the current model fitted to its samples)
    disagg profile CONFIG --num-layers N --out profile.json (the first N layers timed, scaled to all)
    disagg profile --derive tp1.json --tensor-parallel K [--model SOURCE] [--allreduce-from tp2.json]
                   --out derived.json                      (an instance not timed: derive.py)
    disagg simulate CONFIG --profile profile.json [--profile tp2.json] [bench's workload, rate and result flags]
    disagg plan --profile profile.json [--profile tp2.json] --dataset-name W --goodput ttft:MS tpot:MS --gpus N
                [--out best.yaml]                      (one --profile per TP degree, in both)

Exit status: 0 done; 1 the engine could not be built or run; 2 a bad flag, config or profile.
Runs in the CLI process (no Ray).
"""

from __future__ import annotations

import json
import logging
import math
import os
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from disagg.cluster.cli.common import (EXIT_RUNTIME, EXIT_USAGE, BurstinessOpt, ConfigArg, InputLenOpt, LogLevelOpt,
                                       MaxConcurrencyOpt, MetricPercentilesOpt, MinPromptsOpt, NumPromptsOpt,
                                       OutputLenOpt, RandomInputLenOpt, RandomOutputLenOpt, RangeRatioOpt,
                                       RequestRateOpt, ResultFilenameOpt, RunSecondsOpt, SeedOpt, SetOpt, VerboseOpt,
                                       load_config, setup_logging)

Opt = typer.Option
# The hops a served trace measures outside the profiled steps (`benchmarks/trace_report.py`),
# given to every simulated fleet (`SimFleet`): `disagg simulate` and `disagg plan` alike.
HopMsOpt = Annotated[float, Opt("--hop-ms", help="ms from a request's send to the router's placement (HTTP, "
                                "router and Ray hops, not modelled otherwise)")]
StepGapMsOpt = Annotated[float, Opt("--step-gap-ms", help="ms of host time between two forwards of an instance "
                                    "(a served trace's gap between steps: `benchmarks/trace_report.py`)")]
ReserveMsOpt = Annotated[float, Opt("--reserve-ms", help="ms of a remote request's reservation round trip (a "
                                    "served trace's remote 'submit -> reserved'; two H100s: 8)")]


def greedy_class():
    """`disagg bench`'s command class: ``--goodput ttft:500 tpot:50`` reads as there (vLLM's form)."""
    from disagg.cluster.bench.flags import GREEDY_FLAGS
    from disagg.cluster.serve.vllm_options import greedy_command

    return greedy_command(GREEDY_FLAGS)


def profile_command(
    config: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", show_default=False,
                                                     help="deployment YAML (see configs/); none with --refit")] = None,
    out: Annotated[Path, Opt("--out", help="where the profile JSON goes")] = Path("profile.json"),
    small_grid: Annotated[bool, Opt("--small-grid", help="a few shapes only (CPU tests, a quick look)")] = False,
    refit: Annotated[Optional[Path], Opt("--refit", metavar="PROFILE", help="fit the current step-time model to "
                                         "PROFILE's samples instead of timing CONFIG (CPU, seconds; an older "
                                         "profile's too)")] = None,
    served_steps: Annotated[Optional[Path], Opt("--served-steps", metavar="TRACE_DIR", help="with --refit: fit "
                                                "to the steps a fleet served too (the step records of a "
                                                "DISAGG_TRACE_DIR)")] = None,
    instance: Annotated[Optional[list[str]], Opt("--instance", help="with --served-steps: only these "
                                                 "instances' steps (e.g. decode-0)")] = None,
    num_layers: Annotated[Optional[int], Opt("--num-layers", min=1, help="time the first N layers of CONFIG's "
                                             "dummy model (model.num_layers=N) and scale the profile to "
                                             "all of its layers (a model too large for the GPU at hand)")] = None,
    derive: Annotated[Optional[Path], Opt("--derive", metavar="PROFILE", help="derive a profile from PROFILE "
                                          "(TP 1) instead of timing anything: at --tensor-parallel, of "
                                          "--model")] = None,
    tensor_parallel: Annotated[int, Opt("--tensor-parallel", min=1, help="with --derive: the derived "
                                        "instance's TP")] = 1,
    model: Annotated[Optional[str], Opt("--model", help="with --derive: the derived instance's model "
                                        "(dummy:<preset> or a directory with config.json; default the base's)")] = None,
    allreduce_from: Annotated[Optional[Path], Opt("--allreduce-from", metavar="PROFILE", help="with --derive: "
                                                  "price the all-reduces from this TP > 1 profile of the "
                                                  "base's model (else --allreduce-gbps, "
                                                  "--allreduce-latency-us)")] = None,
    allreduce_gbps: Annotated[float, Opt("--allreduce-gbps", min=0.001, help="with --derive: bus bandwidth of "
                                         "the collectives, GB/s (derive.NvlinkModel: H200 NVLink, "
                                         "conservative)")] = 300.0,
    allreduce_latency_us: Annotated[float, Opt("--allreduce-latency-us", min=0.0, help="with --derive: "
                                               "latency of one collective, us")] = 15.0,
    set_: SetOpt = None, log_level: LogLevelOpt = None, verbose: VerboseOpt = False,
) -> None:
    """Time CONFIG's instance (its real engine: in this process, or one process per rank at
    instances.tensor_parallel > 1) over a grid of prefill, decode and mixed steps; fit the router's
    step-time model; write the samples, the fit, its error per region and the TP to --out. With --refit PROFILE: refit that profile's samples instead, with
    --served-steps TRACE_DIR also the steps a serving fleet ran. With --num-layers N: time N layers,
    scale to the model's. With --derive PROFILE: derive another TP's or model's profile from it."""
    from disagg.cluster.simulate.derive import scale_layers
    from disagg.cluster.simulate.profile import (SMALL_GRID, Grid, instance_tensor_parallel, refit_profile,
                                                 save_profile, served_samples, summary_lines)
    from disagg.cluster.simulate.profile_ranks import profile_instance
    from disagg.errors import DisaggError

    setup_logging(log_level, verbose)
    modes = [name for name, given in (("CONFIG", config), ("--refit", refit), ("--derive", derive)) if given]
    if len(modes) != 1:
        typer.echo("disagg profile: expected CONFIG (to time its engine), --refit PROFILE (to refit its "
                   f"samples) or --derive PROFILE, got {' and '.join(modes) if modes else 'neither'}", err=True)
        raise typer.Exit(EXIT_USAGE)
    if (served_steps is not None or instance) and refit is None:
        typer.echo("disagg profile: --served-steps and --instance go with --refit PROFILE", err=True)
        raise typer.Exit(EXIT_USAGE)
    if num_layers is not None and config is None:
        typer.echo("disagg profile: --num-layers goes with CONFIG (it times CONFIG's model)", err=True)
        raise typer.Exit(EXIT_USAGE)
    if derive is None and (tensor_parallel != 1 or model or allreduce_from):
        typer.echo("disagg profile: --tensor-parallel, --model and --allreduce-from go with --derive PROFILE "
                   "(to time a TP instance: --set instances.tensor_parallel=N)", err=True)
        raise typer.Exit(EXIT_USAGE)
    if derive is not None:
        profile = derived_profile(derive, tensor_parallel, model, allreduce_from, allreduce_gbps, allreduce_latency_us)
    elif refit is not None:
        try:
            served = served_samples(str(served_steps), instance) if served_steps is not None else []
            profile = refit_profile(read_profile(refit, warn_older=False), served, served_from=served_steps and
                                    str(served_steps))
        except ValueError as err:
            typer.echo(f"disagg profile --refit: {err}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
    else:
        cfg = load_config(config, list(set_ or []) + ([f"model.num_layers={num_layers}"] if num_layers else []))
        try:
            instance_tensor_parallel(cfg)
            if num_layers is not None:
                check_layers_timed(cfg.model.source, num_layers)
        except ValueError as err:  # roles at different TPs: one profile is one TP
            typer.echo(f"disagg profile: {err}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        try:
            profile = profile_instance(cfg, SMALL_GRID if small_grid else Grid())
        except DisaggError as err:
            typer.echo(f"disagg profile: {type(err).__name__}: {err}", err=True)
            raise typer.Exit(EXIT_RUNTIME) from None
        if num_layers is not None:
            try:
                profile = scale_layers(profile, num_layers)
            except ValueError as err:
                typer.echo(f"disagg profile --num-layers: {err}", err=True)
                raise typer.Exit(EXIT_USAGE) from None
    path = save_profile(profile, out)
    for line in summary_lines(profile):
        typer.echo(line)
    typer.echo(f"profile: {path}")


def check_layers_timed(source: str, num_layers: int) -> None:
    """Refuse ``--num-layers`` where there is no whole model to scale to: a real checkpoint (the flag
    builds a dummy preset cut to N layers) or N beyond the preset's layers.

    Raises:
        ValueError: naming the source or the preset's layers.
    """
    from disagg.cluster.simulate.derive import model_config_of

    if not source.startswith("dummy:"):
        raise ValueError(f"--num-layers: times the first N layers of a dummy:<preset> model (random weights), "
                         f"got model.source {source!r}; use its preset (e.g. dummy:llama3-70b)")
    full = model_config_of(source).num_layers
    if num_layers > full:
        raise ValueError(f"--num-layers: expected at most the {full} layers of {source}, got {num_layers}")


def derived_profile(base_path: Path, tensor_parallel: int, model: Optional[str], allreduce_from: Optional[Path],
                    allreduce_gbps: float, allreduce_latency_us: float) -> dict:
    """`disagg profile --derive`'s profile (`derive.derive_profile`); exit 2 naming what is wrong."""
    from disagg.cluster.simulate import derive as derivation

    base = read_profile(base_path, base_only=True)
    try:
        if allreduce_from is not None:
            collectives = derivation.allreduce_from_profile(read_profile(allreduce_from), base,
                                                            derivation.base_model_config(base), str(allreduce_from))
        else:
            nvlink = derivation.NvlinkModel
            stated = (math.isclose(allreduce_gbps, nvlink.bus_gbps)
                      and math.isclose(allreduce_latency_us * 1e-6, nvlink.latency_s))
            source = nvlink.source if stated else (f"stated: {allreduce_gbps:g} GB/s, {allreduce_latency_us:g} us "
                                                   "(--allreduce-gbps, --allreduce-latency-us)")
            collectives = derivation.Collectives(allreduce_latency_us * 1e-6, allreduce_gbps, source)
        return derivation.derive_profile(base, tensor_parallel=tensor_parallel, model=model, collectives=collectives,
                                         base_path=str(base_path))
    except ValueError as err:
        typer.echo(f"disagg profile --derive: {err}", err=True)
        raise typer.Exit(EXIT_USAGE) from None


def echo_derived(profiles) -> None:
    """Print `derive.profiles_provenance_lines` (nothing where every profile was measured)."""
    from disagg.cluster.simulate.derive import profiles_provenance_lines

    for line in profiles_provenance_lines(profiles):
        typer.echo(line)


def derived_yaml_comment(profiles) -> str:
    from disagg.cluster.simulate.derive import yaml_comment

    return yaml_comment(profiles)


def read_profile(path: Path, warn_older: bool = True, base_only: bool = False) -> dict:
    """The profile at ``path`` (`load_profile`); exit 2 naming the problem when it is not one."""
    from disagg.cluster.simulate.profile import load_profile

    try:
        return load_profile(path, warn_older, base_only)
    except ValueError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(EXIT_USAGE) from None


def simulate_command(
    config: ConfigArg,
    profile: Annotated[list[Path], Opt("--profile", help="a `disagg profile` JSON (step times of the instance); "
                                       "once per TP degree the config's roles run (each role timed by the "
                                       "profile of its instances.tensor_parallel)")],
    link_gbps: Annotated[float, Opt(help="KV push bandwidth per link (one per prefill rank), GB/s (NVLink measured "
                                         "364; 400/200 Gb/s networks ~50/25)")] = 364.0,
    hop_ms: HopMsOpt = 0.0,
    step_gap_ms: StepGapMsOpt = 0.0,
    reserve_ms: ReserveMsOpt = 0.0,
    set_: SetOpt = None,
    dataset_name: Annotated[str, Opt(help="the bench's workloads, comma-separated")] = "random",
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
    run_seconds: RunSecondsOpt = None,
    min_prompts: MinPromptsOpt = 50,
    trace_dir: Annotated[Optional[Path], Opt("--trace-dir", help="write every simulated forward and adaptive "
                                              "decision here as the records DISAGG_TRACE_DIR holds when "
                                              "serving (trace-sim-<workload>-<rate>.jsonl, the virtual clock)")] = None,
    goodput: Annotated[Optional[list[str]], Opt(help="SLOs in ms: --goodput ttft:500 tpot:50 (default bench.goodput)")] = None,
    metric_percentiles: MetricPercentilesOpt = "50,90,99",
    label: Annotated[Optional[str], Opt(help="name of the results (default: the config's name + '-sim')")] = None,
    result_dir: Annotated[Optional[Path], Opt(help="where the JSON results go (default bench.results_dir)")] = None,
    result_filename: ResultFilenameOpt = None,
    metadata: Annotated[Optional[list[str]], Opt(help="KEY=VALUE pairs stored in every result")] = None,
    log_level: LogLevelOpt = None, verbose: VerboseOpt = False,
) -> None:
    """Simulate CONFIG's fleet on a virtual clock (the real scheduler, pages and placement; step
    times from --profile, each role's from the profile of its TP) under the bench's workload and
    rates; write `disagg bench`'s result JSON ("simulated": true), which `disagg bench
    --from-results` compares with measured runs."""
    from rich.console import Console

    from disagg.cluster.bench import flags, tables
    from disagg.cluster.bench.report import save_json
    from disagg.cluster.bench.sweep import prompts_at, public_overrides, result_name
    from disagg.cluster.simulate.fleet import SimFleet, profiles_by_role
    from disagg.cluster.simulate.plan import profiles_by_tp
    from disagg.cluster.simulate.run import simulate_run, simulated_result, workload_spec

    setup_logging(log_level, verbose)
    cfg = load_config(config, set_)
    try:
        roles = profiles_by_role(cfg, profiles_by_tp([read_profile(path) for path in profile]))
    except ValueError as err:
        typer.echo(f"disagg simulate: {err}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    prof = next(iter(roles.values()))  # the model's (every profile's: `profiles_by_tp`)
    echo_derived({id(p): p for p in roles.values()}.values())  # which numbers were measured, which derived
    datasets = flags.datasets(dataset_name)
    bench = cfg.bench
    rates = flags.rates(request_rate) or list(bench.request_rates)
    slos = flags.goodput(goodput) or dict(bench.goodput)
    percentiles = flags.percentiles(metric_percentiles)
    shown = public_overrides(flags.overrides(set_))
    label = label or cfg.name + "".join(f"[{k.split('.')[-1]}={v}]" for k, v in shown.items()) + "-sim"
    random_only = datasets == ["random"]
    out_dir = result_dir or Path(bench.results_dir)
    extra = flags.key_values(metadata, "--metadata", "version=0.3.3")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: the table's labels whole
        console.width = max(console.width, 120)
    if prof.get("model") and prof["model"] != cfg.model.source:
        # The profile's model is what runs (its step times, its context): a config of another
        # model would have its workload sized silently to the profile's context (long-prompt's
        # 8k-32k prompts at llama3-8b's 8192: a 232-ms median TTFT against 913 measured).
        typer.echo(f"disagg simulate: warning: the profile timed {prof['model']} (max_model_len "
                   f"{prof['engine']['max_model_len']}), the config serves {cfg.model.source}: this simulates the "
                   f"profile's model, prompts sized to its context; profile the config's model for its own", err=True)
    try:
        for dataset in datasets:
            for rate in rates:
                fleet = SimFleet(cfg, roles, link_gbps, hop_ms, step_gap_ms, reserve_ms)
                if trace_dir is not None:
                    fleet.keep_records()
                spec = workload_spec(
                    prof, fleet.max_model_len, dataset_name=dataset, num_prompts=num_prompts or bench.num_prompts,
                    seed=bench.seed if seed is None else seed, input_len=input_len or random_input_len
                    or (bench.input_len if random_only else None), output_len=output_len or random_output_len
                    or (bench.output_len if random_only else None), range_ratio=random_range_ratio)
                sim = simulate_run(cfg, roles, spec, request_rate=rate, burstiness=burstiness or bench.burstiness,
                                   max_concurrency=max_concurrency, seed=spec.seed, link_gbps=link_gbps, fleet=fleet,
                                   num_requests=prompts_at(rate, spec.num_prompts, run_seconds, min_prompts))
                result = simulated_result(sim, cfg, roles, label=label, config_path=str(config), overrides=shown,
                                          link_gbps=link_gbps, goodput_slos_ms=slos, percentiles=percentiles,
                                          extra=extra)
                if trace_dir is not None:
                    trace_dir.mkdir(parents=True, exist_ok=True)
                    lines = "".join(json.dumps(r) + "\n" for r in fleet.step_records)
                    (trace_dir / f"trace-sim-{dataset}-{rate:g}.jsonl").write_text(lines, encoding="utf-8")
                single = len(rates) == 1 and len(datasets) == 1
                folder = out_dir if len(datasets) == 1 else out_dir / dataset
                name = result_filename if result_filename and single else result_name(result)
                path = save_json(result, folder / name)
                console.print(tables.run_table(result))
                console.print(f"simulated {len(sim.run.outputs)} requests in {sim.wall_s:.1f} s: {path}",
                              markup=False)
    except ValueError as err:
        typer.echo(f"disagg simulate: {err}", err=True)
        raise typer.Exit(EXIT_USAGE) from None


def plan_command(
    profile: Annotated[list[Path], Opt("--profile", help="a `disagg profile` JSON (step times of the instance); "
                                       "once per TP degree (each profile's tensor_parallel) to search each")],
    dataset_name: Annotated[str, Opt(help="the bench's workload to plan for")] = "random",
    goodput: Annotated[Optional[list[str]], Opt(help="SLOs in ms: --goodput ttft:500 tpot:50")] = None,
    gpus: Annotated[int, Opt("--gpus", min=1, help="GPUs of the deployment (one instance each)")] = 1,
    out: Annotated[Optional[Path], Opt("--out", help="write the best deployment's YAML here")] = None,
    chunk_sizes: Annotated[str, Opt(help="prompt chunk sizes of the colocated candidates, tokens")] = "512,2048,8192",
    adaptive_chunk_sizes: Annotated[Optional[str], Opt(help="prompt chunk sizes of the adaptive candidates, tokens "
                                                            "(default: --chunk-sizes; one size is a third of the "
                                                            "adaptive runs)")] = None,
    adaptive_prefer: Annotated[Optional[str], Opt(help="router.adaptive_prefer of the adaptive candidates, "
                                                       "comma-separated (fastest, remote, balanced): one candidate "
                                                       "each; default: the config's default (balanced)")] = None,
    link_gbps: Annotated[float, Opt(help="KV push bandwidth per link (one per prefill rank), GB/s")] = 364.0,
    hop_ms: HopMsOpt = 0.0,
    step_gap_ms: StepGapMsOpt = 0.0,
    reserve_ms: ReserveMsOpt = 0.0,
    random_input_len: Annotated[Optional[int], Opt(min=1, help="prompt tokens (random dataset)")] = None,
    random_output_len: Annotated[Optional[int], Opt(min=1, help="output tokens (random dataset)")] = None,
    random_range_ratio: RangeRatioOpt = None,
    seed: Annotated[int, Opt(help="seed of prompts and arrivals (the same for every candidate)")] = 0,
    seeds: Annotated[int, Opt("--seeds", min=1, help="draws of prompts and arrivals per rate (seeds --seed, "
                              "--seed + 1, ...), their requests pooled: steadier knees, that many times the "
                              "runs")] = 1,
    jobs: Annotated[Optional[int], Opt("--jobs", "-j", min=1, help="simulations run at once, each in its own "
                                       "process (one core each): candidates, and with more jobs than candidates "
                                       "each one's rates (the same goodput in fewer rounds); default: every "
                                       "core")] = None,
    screen_margin: Annotated[float, Opt("--screen-margin", min=0.0, max=1.0, help="simulate only the candidates "
                                        "whose analytic rate per GPU (the profiles' step-time models, prefill and "
                                        "decode capacity matched) is at least this fraction of the best one's, and "
                                        "the best colocated one; 0: simulate every candidate, --max-simulated "
                                        "aside (the full search)")] = 0.7,
    max_simulated: Annotated[int, Opt("--max-simulated", min=1, help="simulate at most this many of the candidates "
                                      "the screen keeps: the best colocated one, the best of each kind and TPs, "
                                      "then the rest by screened rate")] = 6,
    run_seconds: Annotated[float, Opt(min=0.001, help="virtual seconds of arrivals per simulated run")] = 30.0,
    max_prompts: Annotated[Optional[int], Opt(min=1, help="most requests of one simulated run (default: 375 per "
                                              "GPU, at least 3000); a run it cuts short of --run-seconds is "
                                              "judged before the fleet fills and reads too well: the plan "
                                              "names the candidates so judged")] = None,
    start_rate: Annotated[Optional[float], Opt("--start-rate", help="each candidate's first rate judged, req/s per "
                                               "GPU; the search doubles (or halves) from it to the knee, then "
                                               "bisects: a rate near the knee skips the runs below it (the same "
                                               "result wherever they would all have held); default: each "
                                               "candidate's screened rate, its search probed near it "
                                               "(docs/planning.md)")] = None,
    only: Annotated[Optional[str], Opt("--only", help="judge only these candidates of the search, comma-separated "
                                       "labels as printed, e.g. '56P8D,56P8D-adaptive,colocated-64[chunk=8192]' "
                                       "(a fleet too large to search whole)")] = None,
    log_level: LogLevelOpt = None, verbose: VerboseOpt = False,
) -> None:
    """Search xPyD splits (each role at each profiled TP), colocated chunk sizes and the adaptive
    placement for --gpus GPUs: screen each analytically, simulate those that can win (`disagg
    simulate`'s fleet, --profile's step times); print each one's goodput per GPU (the highest rate
    with 90% of requests inside --goodput's SLOs), the best, and its YAML."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from disagg.cluster.bench import flags
    from disagg.cluster.simulate import plan as planner

    setup_logging(log_level, verbose)
    if not verbose and log_level is None:  # one workload, many runs: its clipping notice would repeat each time
        logging.getLogger("disagg.cluster.bench.workloads").setLevel(logging.ERROR)
    try:
        profiles = planner.profiles_by_tp([read_profile(path) for path in profile])
    except ValueError as err:
        typer.echo(f"disagg plan: {err}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    prof = next(iter(profiles.values()))
    echo_derived(profiles.values())  # which numbers were measured, which derived
    flags.datasets(dataset_name)
    slos = flags.goodput(goodput)
    if not slos:
        raise typer.BadParameter("expected SLOs such as --goodput ttft:500 tpot:50", param_hint="--goodput")
    chunks = [int(c) for c in flags.positive_floats(chunk_sizes, "--chunk-sizes")]
    adaptive_chunks = (None if adaptive_chunk_sizes is None else
                       [int(c) for c in flags.positive_floats(adaptive_chunk_sizes, "--adaptive-chunk-sizes")])
    from disagg.config import RouterSection

    prefers = None if adaptive_prefer is None else flags.choices(
        adaptive_prefer, typing.get_args(RouterSection.model_fields["adaptive_prefer"].annotation), "--adaptive-prefer",
        distinct=True)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: the table's labels whole
        console.width = max(console.width, 120)
    lengths = dict(input_len=random_input_len, output_len=random_output_len, range_ratio=random_range_ratio)
    hops = dict(hop_ms=hop_ms, step_gap_ms=step_gap_ms, reserve_ms=reserve_ms)
    try:
        search = planner.candidates(gpus, chunks, adaptive_chunk_sizes=adaptive_chunks, adaptive_prefers=prefers,
                                    tensor_parallel=list(profiles))
        if only is not None:  # judged whole: screened for their start rates only
            search = planner.only(search, [label.strip() for label in only.split(",") if label.strip()])
        margin, cap = (screen_margin, max_simulated if screen_margin > 0 else None) if only is None else (0.0, None)
        kept = planner.screen_search(list(profiles.values()), search, dataset_name=dataset_name, slos_ms=slos,
                                     link_gbps=link_gbps, seed=seed, margin=margin, max_simulated=cap, **lengths)
        for line in planner.screen_lines(search, margin, cap):
            typer.echo(line)
        run_length = planner.RunLength.for_gpus(gpus, run_seconds, max_prompts)

        def judged(c) -> None:
            short = run_length.seconds_at(c.goodput_rps)
            cut = f" (judged on {short:.1f} s of arrivals: --max-prompts)" if short < 0.9 * run_seconds else ""
            console.print(f"{c.label}: {c.goodput_per_gpu:.3f} req/s per GPU{cut}", markup=False)

        ranked = planner.plan(list(profiles.values()), dataset_name=dataset_name, slos_ms=slos, num_gpus=gpus,
                              chunk_sizes=chunks, search=kept, run_length=run_length,
                              seed=seed, seeds=seeds, link_gbps=link_gbps, hops=hops,
                              jobs=jobs or os.cpu_count() or 1, start_rate_per_gpu=start_rate,
                              on_judged=judged,
                              **lengths)
    except ValueError as err:
        typer.echo(f"disagg plan: {err}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    table = Table(title=f"{dataset_name} on {gpus} GPU(s), SLOs {tables_slos(slos)}, pushes at {link_gbps:g} GB/s "
                        f"(simulated, profile {prof.get('model')} on {(prof.get('device') or {}).get('gpus') or 'cpu'}"
                        + (f", TP {', '.join(map(str, profiles))}" if list(profiles) != [1] else "") + ")")
    table.add_column("deployment", justify="left", no_wrap=True)
    for header in ("goodput (req/s)", "per GPU", "vs colocated", "screened per GPU"):
        table.add_column(header, justify="right")
    for row in planner.table_rows(ranked):
        table.add_row(*(escape(cell) for cell in row))  # labels hold [chunk=...]: not markup
    console.print(table)
    cut = [c.label for c in ranked if run_length.seconds_at(c.goodput_rps) < 0.9 * run_seconds]
    if cut:
        console.print(f"judged on fewer than {run_seconds:g} s of arrivals (--max-prompts {run_length.max_prompts}), "
                      f"optimistic: {', '.join(cut)}", markup=False)
    base = planner.base_of(ranked[0], profiles, slos)
    extrapolated = planner.extrapolations_by_tp(profiles, slos, ranked)
    for line in planner.extrapolation_lines(extrapolated, len(ranked)):
        typer.echo(line)
    text = planner.best_yaml(ranked[0], base, dataset_name=dataset_name, link_gbps=link_gbps, ranked=ranked,
                             hops=hops, extrapolated=extrapolated.get(ranked[0].label, ()),
                             num_screened_out=len(search) - len(kept))
    text = derived_yaml_comment(profiles.values()) + text
    typer.echo(f"best: {ranked[0].label}")
    typer.echo(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        console.print(f"written: {out}", markup=False)


def tables_slos(slos: dict) -> str:
    from disagg.cluster.bench.tables import fmt_slos

    return fmt_slos(slos)
