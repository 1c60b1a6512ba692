"""The prefix cache's figures from `benchmarks/run_prefix.sh`'s results: per run the hit rate, median
and p99 TTFT, mean TPOT and KV bytes pushed per request; per rate the median TTFT ratio of the
uncached to the cached colocated run; for 1P1D, pushed bytes cached / uncached beside 1 - the
decode side's hit rate (what a push that skips the decode side's match should come to).

    python3 benchmarks/prefix_report.py RESULTS_DIR      # writes RESULTS_DIR/prefix_report.json
"""

from __future__ import annotations

import glob
import json
import os
import sys


def runs(root: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*qps*.json"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        prefix = r.get("prefix_cache") or {}
        decode_hits = [v["hit_rate"] for name, v in (prefix.get("instances") or {}).items()
                       if name.startswith("decode") and v.get("hit_rate") is not None]
        out.append({"label": r["label"], "rate": r["request_rate"], "completed": r["completed"],
                    "commit": r.get("git_commit"), "hit_rate": prefix.get("hit_rate"),
                    "decode_hit_rate": decode_hits[0] if decode_hits else None,
                    "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                    "mean_tpot_ms": r["mean_tpot_ms"], "throughput": r.get("request_throughput"),
                    "pushed_bytes_per_request": (prefix["pushed_bytes"] / r["completed"]
                                                 if prefix.get("pushed_bytes") and r["completed"] else None)})
    return out


def pair(rows: list[dict], kind: str) -> list[dict]:
    """Cached and uncached runs of one deployment kind, matched by rate."""
    on = {r["rate"]: r for r in rows if r["label"] == f"{kind}-prefix-true"}
    off = {r["rate"]: r for r in rows if r["label"] == f"{kind}-prefix-false"}
    out = []
    for rate in sorted(set(on) & set(off)):
        a, b = on[rate], off[rate]
        row = {"kind": kind, "rate": rate, "hit_rate": a["hit_rate"],
               "median_ttft_ratio": b["median_ttft_ms"] / a["median_ttft_ms"] if a["median_ttft_ms"] else None,
               "median_ttft_ms": [a["median_ttft_ms"], b["median_ttft_ms"]]}
        if a["pushed_bytes_per_request"] and b["pushed_bytes_per_request"]:
            row["pushed_ratio"] = a["pushed_bytes_per_request"] / b["pushed_bytes_per_request"]
            row["one_minus_decode_hit"] = 1 - a["decode_hit_rate"] if a["decode_hit_rate"] is not None else None
        out.append(row)
    return out


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "results/prefix"
    rows = runs(root)
    report = {"runs": rows, "pairs": pair(rows, "colocated") + pair(rows, "1p1d")}
    with open(os.path.join(root, "prefix_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    for r in rows:
        print(f"{r['label']:24} {r['rate']:>5} hit {r['hit_rate'] or 0:6.1%} ttft p50 {r['median_ttft_ms']:7.1f} "
              f"p99 {r['p99_ttft_ms']:7.1f} tpot {r['mean_tpot_ms']:5.2f} pushed/req {r['pushed_bytes_per_request']}")
    for p in report["pairs"]:
        print(json.dumps(p))


if __name__ == "__main__":
    main()
