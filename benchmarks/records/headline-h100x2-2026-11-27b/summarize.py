"""This session's two-H100 runs in one table: per run, SLO attainment at 1x and 2x the SLOs its
sitting calibrated (read from the sitting's merged compare.json), latencies, placements, prefix
hits and busy fractions (`attainment_of`, the bench's rule). The raw results (~85 MB with the
per-request arrays) are not kept here.

    python3 benchmarks/records/headline-h100x2-2026-11-27b/summarize.py SITTING_DIR... > runs.json
"""

from __future__ import annotations

import glob
import json
import os
import sys

from disagg.cluster.bench.compare import attainment_of, scale_slos


def rows(sitting: str) -> list[dict]:
    (compare,) = glob.glob(os.path.join(sitting, "results", "*", "merged", "compare.json"))
    with open(compare, encoding="utf-8") as f:
        slos = json.load(f)["slos_ms"]
    out = []
    for path in sorted(glob.glob(os.path.join(sitting, "results", "*", "*", "*qps*.json"))):
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        prefix = r.get("prefix_cache") or {}
        out.append({"sitting": os.path.basename(sitting.rstrip("/")), "workload": r["workload"]["dataset_name"],
                    "slos_ms": {k: round(v, 1) for k, v in slos.items()},
                    "label": r["label"], "rate": r["request_rate"], "commit": r["git_commit"],
                    "overrides": r.get("overrides"), "completed": r["completed"],
                    "attainment_1x": round(attainment_of(r, slos), 3),
                    "attainment_2x": round(attainment_of(r, scale_slos(slos, 2.0)), 3),
                    "median_ttft_ms": round(r["median_ttft_ms"], 1), "p99_ttft_ms": round(r["p99_ttft_ms"], 1),
                    "mean_tpot_ms": round(r["mean_tpot_ms"], 2), "p99_tpot_ms": round(r["p99_tpot_ms"], 2),
                    "placements": r.get("placements"),
                    "prefix_hit_rate": None if prefix.get("hit_rate") is None else round(prefix["hit_rate"], 3),
                    "busy": {k: round(v, 2) for k, v in (r.get("busy_fraction") or {}).items()}})
    return out


def main() -> None:
    json.dump([row for sitting in sys.argv[1:] for row in rows(sitting)], sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
