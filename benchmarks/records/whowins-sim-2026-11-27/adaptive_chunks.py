"""1P1D-adaptive at other prompt chunk sizes (scheduler.max_num_batched_tokens on both instances),
judged as `disagg plan` judges its candidates (`plan.judge`: same workload, seed 0, RunLength
default, doubling then 5 bisections), for the rows given as W:TTFT:TPOT[:PROFILE]; prints one
JSON line per row. `disagg plan` itself runs adaptive at the profile's chunk (8192) only.

    python adaptive_chunks.py --chunks 512,2048 chat:148:34 long-prompt:4940:38:profile.json
"""

import argparse
import json
import logging
import time

from disagg.cluster.simulate import plan as planner

DEFAULT_PROFILE = "benchmarks/records/simulator-2026-11-27b/profile-h100-v2.json"


def main() -> None:
    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", default="512,2048")
    parser.add_argument("rows", nargs="+")
    args = parser.parse_args()
    for row in args.rows:
        workload, ttft, tpot, *rest = row.split(":")
        profile_path = rest[0] if rest else DEFAULT_PROFILE
        profile = json.load(open(profile_path))
        slos = {"ttft": float(ttft), "tpot": float(tpot)}
        search = [planner.Candidate(f"1P1D-adaptive[chunk={c}]", {
            "instances": {"prefill": 1, "decode": 1}, "scheduler": {"max_num_batched_tokens": int(c)},
            "router": {"placement": "adaptive"}}) for c in args.chunks.split(",")]
        started = time.time()
        ranked = planner.plan(profile, dataset_name=workload, slos_ms=slos, num_gpus=2, search=search)
        print(json.dumps({"workload": workload, "ttft_ms": slos["ttft"], "tpot_ms": slos["tpot"], "profile": profile_path,
                          "goodput_per_gpu": {c.label: c.goodput_per_gpu for c in ranked},
                          "wall_s": round(time.time() - started)}), flush=True)


if __name__ == "__main__":
    main()
