"""The two-H100 sittings of 2026-11-27 in one table: per run, SLO attainment at 1x and 2x the
calibrated SLOs, latencies, placements and busy fractions (`attainment_of`, the bench's rule),
from the bench's result JSONs (not kept here: ~25 MB with the per-request arrays).

    python3 benchmarks/records/headline-h100x2-2026-11-27/summarize.py RESULTS_DIR... > runs.json
"""

from __future__ import annotations

import glob
import json
import os
import sys

from disagg.cluster.bench.compare import attainment_of, scale_slos

SLOS = {"chat": {"ttft": 97.283, "tpot": 15.1714}, "prefill-heavy": {"ttft": 104.804, "tpot": 15.7194}}


def row(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        r = json.load(f)
    workload = r["workload"]["dataset_name"]
    slos = SLOS[workload]
    return {"workload": workload,
            "label": r["label"], "rate": r["request_rate"], "commit": r["git_commit"],
            "overrides": r.get("overrides"), "completed": r["completed"],
            "attainment_1x": round(attainment_of(r, slos), 3),
            "attainment_2x": round(attainment_of(r, scale_slos(slos, 2.0)), 3),
            "median_ttft_ms": round(r["median_ttft_ms"], 1), "p99_ttft_ms": round(r["p99_ttft_ms"], 1),
            "mean_tpot_ms": round(r["mean_tpot_ms"], 2), "p99_tpot_ms": round(r["p99_tpot_ms"], 2),
            "placements": r.get("placements"),
            "busy": {k: round(v, 2) for k, v in (r.get("busy_fraction") or {}).items()}}


def main() -> None:
    paths = sorted(p for d in sys.argv[1:] for p in glob.glob(os.path.join(d, "**", "*qps*.json"), recursive=True))
    json.dump([row(p) for p in paths], sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
