"""Per-rate SLO attainment of `disagg plan` candidates on a grid of rates, every (candidate, rate)
run in its own process: a 64-GPU row's knee found in one sitting on a many-core machine, where
`disagg plan`'s doubling and bisection run its rates one after the other.

Each run is the one `plan.judge` makes at that rate (`plan.rate_attainment`: the same fleet, hops,
workload, seed and run length; stopped once its miss is certain): attainment >= 0.9 holds. Prints
one JSON line per run and writes them all to --out. (Since a3b1885 `disagg plan --jobs N` with
fewer candidates than N batches each one's rates across the workers itself.)

    python3 benchmarks/records/plan-h200-2026-11-29/grid.py --profile P --dataset-name decode-heavy \
        --goodput ttft:66.0932 tpot:11.1873 --gpus 64 --only 8P56D,8P56D-adaptive --rates 12,12.5,13 \
        --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --jobs 14 --out grid.jsonl
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

from disagg.cluster.simulate import plan as planner
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
    rate = rate_per_gpu * cand.num_gpus
    started = time.perf_counter()
    config = Config.from_dict(planner.config_of(planner.base_sections(prof, slos), cand), origin=label)
    attained, cut = planner.rate_attainment(
        config, prof, rate,
        dataset_name=args.dataset_name, slos_ms=slos, run_length=planner.RunLength.for_gpus(args.gpus, args.run_seconds),
        seed=args.seed, link_gbps=args.link_gbps,
        hops=dict(hop_ms=args.hop_ms, step_gap_ms=args.step_gap_ms, reserve_ms=args.reserve_ms))
    num_prompts = planner.RunLength.for_gpus(args.gpus, args.run_seconds).prompts_at(rate)
    return {"candidate": label, "rate_per_gpu": rate_per_gpu, "num_prompts": num_prompts,
            "attainment": attained, "holds": attained >= planner.TARGET_ATTAINMENT,
            "cut": cut, "wall_s": round(time.perf_counter() - started, 1)}


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
