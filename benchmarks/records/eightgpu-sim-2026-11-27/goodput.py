"""`disagg plan`'s goodput search for a few of its candidates only (a full 8-GPU plan takes ~15
min of CPU): the same base sections, run lengths, seeds and bisection, one line per candidate
with its attainment at every rate searched.

    python benchmarks/records/eightgpu-sim-2026-11-27/goodput.py --gpus 8 \
        --labels 5P3D,5P3D-adaptive --dataset chat --ttft 200 --tpot 20 --chunks 8192
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from disagg.cluster.simulate.plan import candidates, plan

PROFILE = Path(__file__).resolve().parents[1] / "simulator-2026-11-27b" / "profile-h100-v2.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--labels", required=True, help="comma-separated plan labels, e.g. 5P3D,5P3D-adaptive")
    ap.add_argument("--dataset", default="chat")
    ap.add_argument("--ttft", type=float, required=True)
    ap.add_argument("--tpot", type=float, required=True)
    ap.add_argument("--chunks", default="8192", help="the adaptive candidates' chunk sizes (--adaptive-chunk-sizes)")
    ap.add_argument("--profile", type=Path, default=PROFILE)
    args = ap.parse_args()
    profile = json.loads(args.profile.read_text())
    labels = args.labels.split(",")
    search = [c for c in candidates(args.gpus, adaptive_chunk_sizes=[int(c) for c in args.chunks.split(",")])
              if c.label in labels]
    if not search:
        raise SystemExit(f"--labels: none of {labels} is a candidate of {args.gpus} GPUs")

    def show(c) -> None:
        rates = " ".join(f"{r:g}:{a * 100:.1f}" for r, a in sorted(c.attainment_at.items()))
        print(f"{args.dataset} {args.ttft:g}:{args.tpot:g} {c.label}: {c.goodput_per_gpu:.3f} req/s/GPU; "
              f"attainment % at req/s {rates}", flush=True)

    plan(profile, dataset_name=args.dataset, slos_ms={"ttft": args.ttft, "tpot": args.tpot}, num_gpus=args.gpus,
         search=search, on_judged=show)


if __name__ == "__main__":
    main()
