"""Per-rate SLO attainment of `disagg plan` candidates on a grid of rates, every (candidate, rate)
run in its own process: a 64-GPU row's knee found in one sitting on a many-core machine, where
`disagg plan`'s doubling and bisection run its rates one after the other.

Each run is the one `plan.judge` makes at that rate (the same fleet, hops, workload, seed and run
length; stopped once its miss is certain): attainment >= 0.9 holds. Prints one JSON line per run
and writes them all to --out.

    python3 benchmarks/records/plan-h200-2026-11-29/grid.py --profile P --dataset-name decode-heavy \
        --goodput ttft:66.0932 tpot:11.1873 --gpus 64 --only 8P56D,8P56D-adaptive --rates 12,12.5,13 \
        --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --jobs 14 --out grid.jsonl
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

from disagg.cluster.bench.metrics import meets_slos
from disagg.cluster.simulate import plan as planner
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.run import simulate_run, workload_spec
from disagg.config import Config


def one(args: argparse.Namespace, label: str, rate_per_gpu: float) -> dict:
    prof = json.load(open(args.profile))
    slos = dict(item.split(":") for item in args.goodput)
    slos = {k: float(v) for k, v in slos.items()}
    chunks = [int(c) for c in args.chunk_sizes.split(",")]
    (cand,) = planner.only(planner.candidates(args.gpus, chunks, adaptive_chunk_sizes=chunks), [label])
    router = cand.sections.get("router") or {}
    if router.get("placement") == "adaptive":  # as `plan.plan` sets them
        router.setdefault("slo_ttft_ms", slos.get("ttft"))
        router.setdefault("slo_tpot_ms", slos.get("tpot"))
    config = Config.from_dict(planner.config_of(planner.base_sections(prof, slos), cand), origin=label)
    rate = rate_per_gpu * cand.num_gpus
    run_length = planner.RunLength.for_gpus(args.gpus, args.run_seconds)
    num_prompts = run_length.prompts_at(rate)
    allowed, misses = planner.misses_allowed(num_prompts), 0

    def certain_miss(out) -> bool:
        nonlocal misses
        misses += not meets_slos(out, slos)
        return misses > allowed

    started = time.perf_counter()
    fleet = SimFleet(config, prof, args.link_gbps, args.hop_ms, args.step_gap_ms, args.reserve_ms)
    spec = workload_spec(prof, fleet.max_model_len, dataset_name=args.dataset_name, num_prompts=num_prompts,
                         seed=args.seed)
    outputs = simulate_run(config, prof, spec, request_rate=rate, seed=args.seed, fleet=fleet,
                           stop_when=certain_miss).run.outputs
    met = sum(meets_slos(out, slos) for out in outputs)
    return {"candidate": label, "rate_per_gpu": rate_per_gpu, "num_prompts": num_prompts,
            "attainment": met / num_prompts, "holds": met / num_prompts >= planner.TARGET_ATTAINMENT,
            "cut": misses > allowed, "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--dataset-name", required=True)
    parser.add_argument("--goodput", nargs="+", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--only", required=True, help="candidate labels, comma-separated")
    parser.add_argument("--rates", required=True, help="req/s per GPU, comma-separated")
    parser.add_argument("--chunk-sizes", default="8192")
    parser.add_argument("--link-gbps", type=float, default=364.0)
    parser.add_argument("--hop-ms", type=float, default=0.0)
    parser.add_argument("--step-gap-ms", type=float, default=0.0)
    parser.add_argument("--reserve-ms", type=float, default=0.0)
    parser.add_argument("--run-seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    work = [(label.strip(), float(r)) for label in args.only.split(",") for r in args.rates.split(",")]
    with open(args.out, "w") as out, concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for done in concurrent.futures.as_completed([pool.submit(one, args, *w) for w in work]):
            line = json.dumps(done.result())
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()


if __name__ == "__main__":
    main()
