"""The main job (`make demo`): one prefill + one decode instance from a YAML, then vs colocated.

Picks the deployment by what the machine has: `configs/llama3-8b-1p1d.yaml` when two GPUs are
visible; with one GPU, `configs/llama3-8b-1gpu-1p1d.yaml` (both instances share it over NVSHMEM)
against one colocated instance on that GPU: a check of both paths, so the demo says in one line
why its figures do not compare deployments and prints what they do show (each side's latencies
at one rate) instead of a goodput table; else `configs/smollm2-1p1d.yaml` on the CPU (real
weights and tokenizer) when the SmolLM2 conversion is cached or can be built; else
`configs/tiny-1p1d.yaml`. It launches the fleet, streams a few prompts (text as it arrives, or
token ids for random weights), then compares the disaggregated fleet with its colocated twin on
the same devices through `disagg bench`'s comparison (`disagg.cluster.bench.compare.quick_compare`:
goodput, TTFT/TPOT, PNG plots), and prints where the results went (`results/`, git-ignored).

On the CPU, where speed depends on the machine (and on what else runs there), the comparison's
SLOs and rates come from the machine: a few requests sent one at a time to the launched 1P1D
fleet give the SLOs (`disagg bench --slo-calibrate`'s rule) and the rate one request at a time
sustains; the sweep offers 0.5, 1 and 2 times that rate, each run as long as the comparison's
requests take one at a time (`sweep_from`), and twice the highest (twice more at most) to a
side that held them all, so each side's limit falls inside the rates run rather than below or
above them all. Runs in the launching process.

    python -m disagg.cluster.cli.demo [--config A.yaml --compare B.yaml] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CHAT_PROMPTS = ["What is the capital of France? Answer in one sentence.",
                "Write a haiku about a GPU waiting for its memory.",
                "Explain in two sentences why splitting prefill from decode helps latency."]
# Per machine kind: streamed tokens and the comparison's workload. rates None: from the machine
# (`sweep_from`), each run about as long as run_requests take one at a time, so a higher rate
# sends more of the num_prompts sampled (and a rate past a side's capacity builds a queue, rather
# than every rate above it sending the same burst).
WORKLOADS = {
    "gpu": dict(max_tokens=64, num_prompts=64, rates=(4.0, 16.0), input_len=1024, output_len=128),
    "gpu-shared": dict(max_tokens=64, num_prompts=32, rates=(4.0,), input_len=1024, output_len=128),
    "smollm2": dict(max_tokens=40, num_prompts=24, run_requests=4, rates=None, input_len=64, output_len=8),
    "tiny": dict(max_tokens=24, num_prompts=32, run_requests=8, rates=None, input_len=64, output_len=16),
}
RATE_STEPS = (0.5, 1.0, 2.0)  # times the rate one request at a time sustains
MIN_PROMPTS = 3               # requests of a run at least (the lowest rate's run has fewer than run_requests)
CALIBRATION_REQUESTS = 4      # sent one at a time to the 1P1D fleet
EXTEND_TO_LIMIT = 2           # more rates, each twice the last, for a side that held them all (sweep.limit_rate)


SHARED_GPU_CAVEAT = ("one GPU: the 1P1D side's two instances time-slice it, so their goodput cannot compare "
                     "deployments (that needs two GPUs); what the runs do show: both paths serve the workload, at "
                     "the latencies below")


def choose(num_gpus: int) -> tuple[str, Path, Path]:
    """(kind, disaggregated config, colocated config) for this machine; see the module docstring."""
    if num_gpus >= 2:
        return "gpu", CONFIGS / "llama3-8b-1p1d.yaml", CONFIGS / "llama3-8b-colocated.yaml"
    if num_gpus == 1:
        return "gpu-shared", CONFIGS / "llama3-8b-1gpu-1p1d.yaml", CONFIGS / "llama3-8b-1gpu-colocated.yaml"
    try:
        from disagg.model.smollm2 import ensure_smollm2
        print(f"SmolLM2-135M-Instruct: {ensure_smollm2()}")
        return "smollm2", CONFIGS / "smollm2-1p1d.yaml", CONFIGS / "smollm2-colocated.yaml"
    except Exception as err:  # package missing or conversion impossible: the tiny random model
        print(f"SmolLM2 weights unavailable ({type(err).__name__}: {err}); using the tiny dummy model")
        return "tiny", CONFIGS / "tiny-1p1d.yaml", CONFIGS / "tiny-colocated.yaml"


def prompts_for(cluster) -> list[tuple[str, object]]:
    """(label, prompt) pairs: chat prompts through the model's template when it has a tokenizer,
    else token ids."""
    tokenizer = cluster.tokenizer
    if tokenizer is None:
        ids = [[(7 * i + 3 * j) % 200 + 3 for j in range(16 + 24 * i)] for i in range(3)]
        return [(f"{len(p)} token ids {p[:6]}...", p) for p in ids]
    prompts = []
    for text in CHAT_PROMPTS:
        try:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        except Exception:  # no chat template: the plain text
            prompt = text
        prompts.append((text, prompt))
    return prompts


def stream_prompts(cluster, max_tokens: int) -> list[dict]:
    """Stream each prompt to stdout in turn; return how each ended and how long it took."""
    from disagg.cluster.cli.app import stream_to_stdout
    from disagg.sampling import SamplingParams

    shown = []
    for label, prompt in prompts_for(cluster):
        print(f"\n>>> {label}")
        start = time.time()
        last = asyncio.run(stream_to_stdout(cluster, prompt, SamplingParams(max_tokens=max_tokens)))
        shown.append({"prompt": label, "finish_reason": last.finish_reason, "error": last.error,
                      "seconds": time.time() - start})
    return shown


def sweep_from(calibration: dict, output_len: int, run_requests: int,
               steps: tuple[float, ...] = RATE_STEPS) -> dict:
    """The comparison's SLOs, rates and run length from requests measured one at a time
    (`sweep.calibrate`'s result): its SLOs (three significant digits); `steps` times the rate
    one request at a time sustains (one request: the isolated TTFT plus output_len - 1 decode
    steps; that rate to two significant digits); and run_seconds, the time run_requests requests
    take one at a time: every run offers about that long (`sweep.prompts_at`), so a lower rate
    sends fewer (at least `MIN_PROMPTS`) and a higher one more (up to the workload's num_prompts).

    Raises:
        ValueError: the calibration measured no time (nothing to derive a rate from).
    """
    alone_s = (calibration["isolated_ttft_ms"] + (output_len - 1) * calibration["isolated_tpot_ms"]) / 1e3
    if not alone_s > 0:
        raise ValueError(f"calibration: expected a positive time per request, got {alone_s} s")
    base = float(f"{1 / alone_s:.2g}")
    rates = tuple(round(step * base, 6) for step in steps)
    slos = {name: float(f"{value:.3g}") for name, value in calibration["slos_ms"].items()}
    return {"slos_ms": slos, "rates": rates, "request_s": alone_s, "run_seconds": round(run_requests / base, 3),
            "calibration": calibration}


def describe_sweep(sweep: dict, label: str) -> str:
    """Three lines: what was measured, the SLOs and rates taken from it, and what runs this short
    can tell."""
    from disagg.cluster.bench.tables import fmt_rate, fmt_slos

    calibration, slos = sweep["calibration"], sweep["slos_ms"]
    ttft, tpot = calibration["isolated_ttft_ms"], calibration["isolated_tpot_ms"]
    return (f"measured on {label}, {calibration['num_requests']} requests one at a time: TTFT {ttft:.0f} ms, "
            f"decode step {tpot:.0f} ms, {sweep['request_s']:.2f} s a request\n"
            f"so: SLOs {fmt_slos(slos)} ({slos['ttft'] / ttft:.2g} x, {slos['tpot'] / tpot:.2g} x those); rates "
            f"{', '.join(fmt_rate(r) for r in sweep['rates'])} req/s "
            f"({', '.join(f'{s:g}' for s in RATE_STEPS)} x one request at a time; doubled for a side that holds "
            f"them all), {sweep['run_seconds']:.2g} s of requests each\n"
            "a few requests a run: where each side's limit lies, not a measurement of it (that is "
            "`disagg bench` with more requests)")


def measure(cluster, kind: str) -> dict:
    """`sweep_from` of `CALIBRATION_REQUESTS` of the comparison's workload sent one at a time to
    the launched fleet (the first of the requests the comparison sends)."""
    from disagg.cluster.bench.backends import ClusterBackend
    from disagg.cluster.bench.sweep import SweepOptions, calibrate, workload_for
    from disagg.cluster.bench.workloads import sample_requests

    work = WORKLOADS[kind]
    options = SweepOptions(num_prompts=work["num_prompts"], input_len=work["input_len"],
                           output_len=work["output_len"], show_progress=False)
    requests = sample_requests(workload_for(cluster, options))
    calibration = calibrate(ClusterBackend(cluster, name="demo-calibration"), requests, options,
                            num_requests=CALIBRATION_REQUESTS, reset=cluster.reset_prefix_cache)
    return sweep_from(calibration, work["output_len"], work["run_requests"])


def compare(kind: str, config_a: Path, config_b: Path, out_dir: Path, sweep: dict | None = None,
            launched=None) -> dict:
    """The disaggregated vs colocated comparison, through the bench package's quick_compare: at
    the rates and SLOs of `sweep` (`sweep_from`) where given, else the kind's rates and config_a's
    SLOs; `launched`: config_a's fleet, already running (swept, then shut down)."""
    from disagg.cluster.bench.compare import quick_compare

    work = WORKLOADS[kind]
    return quick_compare(str(config_a), str(config_b), str(out_dir), num_prompts=work["num_prompts"],
                         rates=sweep["rates"] if sweep else work["rates"],
                         goodput=sweep["slos_ms"] if sweep else None,
                         caveat=SHARED_GPU_CAVEAT if kind == "gpu-shared" else None, launched=launched,
                         extend_to_limit=EXTEND_TO_LIMIT if sweep else 0,
                         **(dict(run_seconds=sweep["run_seconds"], min_prompts=MIN_PROMPTS) if sweep else {}),
                         input_len=work["input_len"], output_len=work["output_len"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.cluster.cli.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="the disaggregated YAML (default: by machine)")
    parser.add_argument("--compare", type=Path, help="the colocated YAML it is compared with")
    parser.add_argument("--out", type=Path, help="results folder (default: results/demo-<time>)")
    parser.add_argument("--no-compare", action="store_true", help="skip the comparison")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("DISAGG_LOG", "WARNING"))
    os.environ.setdefault("DISAGG_LOG", "WARNING")
    import ray

    from disagg.cluster import Cluster
    from disagg.cluster.cli.app import describe
    from disagg.cluster.launch.connect import enable_token_auth, start_embedded_head

    start = time.time()
    enable_token_auth()  # and on loopback, as every embedded head (docs/security.md)
    start_embedded_head("127.0.0.1", include_dashboard=False, log_to_driver=True, namespace="disagg-demo",
                        num_cpus=max(4, os.cpu_count() or 1))
    try:
        if args.config is None:
            kind, config_a, config_b = choose(int(ray.cluster_resources().get("GPU", 0)))
        else:
            name = args.config.name
            kind = ("gpu-shared" if "1gpu" in name else "gpu" if "llama3" in name
                    else "smollm2" if "smollm2" in name else "tiny")
            config_a = args.config
            config_b = args.compare or args.config.with_name(name.replace("1p1d", "colocated"))
        out_dir = args.out or Path("results") / time.strftime("demo-%Y%m%d-%H%M%S")
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"launching {config_a} ...")
        sweep = summary = None
        # One launch streams the prompts, measures the machine and is the comparison's 1P1D side
        # (which shuts it down before the colocated side launches on the same devices).
        with Cluster.launch(config_a) as cluster:
            print(describe(cluster))
            shown = stream_prompts(cluster, WORKLOADS[kind]["max_tokens"])
            if not args.no_compare:
                if WORKLOADS[kind]["rates"] is None:
                    sweep = measure(cluster, kind)
                print(f"\ncomparing {config_a.name} with {config_b.name} on the same devices ...")
                if sweep:
                    print(describe_sweep(sweep, config_a.stem))
                summary = compare(kind, config_a, config_b, out_dir, sweep, launched=cluster)
        (out_dir / "demo.json").write_text(json.dumps(
            {"kind": kind, "config": str(config_a), "compare": str(config_b), "streamed": shown,
             "seconds": time.time() - start, "sweep": sweep, "comparison": summary}, indent=2, default=str))
    finally:
        ray.shutdown()
    print(f"\ndemo finished in {time.time() - start:.0f} s; results in {out_dir.resolve()}/")
    return 0


if __name__ == "__main__":
    # Run through the importable module, so Ray pickles by reference, not by value.
    from disagg.cluster.cli.demo import main as module_main
    sys.exit(module_main())
