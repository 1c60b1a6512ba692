"""`disagg bench` / `disagg simulate` results in one table, measured and simulated alike: per run,
SLO attainment at 1x and 2x the SLOs it was judged at (the result's own ``goodput``: the SLOs a
headline comparison calibrated), latencies, placements, prefix hits and busy fractions
(`attainment_of`, the bench's rule). A small summary (`run_headline_workload.sh` writes one), or
a record's `runs.json` when the raw results stay out of git.

    python3 benchmarks/summarize_runs.py DIR... > runs.json
    python3 benchmarks/summarize_runs.py --table DIR...

DIR: a directory of results (any depth: results/<workload>/<label>/*qps*.json); a run is named
DIR's last part / its path below DIR. Merged comparisons (``merged/``) are left out.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from disagg.cluster.bench.compare import attainment_of, scale_slos


def rows(root: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*qps*.json"), recursive=True)):
        if f"{os.sep}merged{os.sep}" in path:
            continue
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        slos = r.get("goodput") or {}
        prefix = r.get("prefix_cache") or {}
        sim = bool(r.get("simulated"))
        source = os.path.join(os.path.basename(os.path.normpath(root)), os.path.relpath(os.path.dirname(path), root))
        out.append({"source": source, "simulated": sim,
                    "workload": r["workload"]["dataset_name"], "slos_ms": slos,
                    "deployment": os.path.basename(os.path.dirname(path)), "rate": r["request_rate"],
                    "commit": r.get("git_commit"), "overrides": r.get("overrides"), "completed": r["completed"],
                    "attainment_1x": round(attainment_of(r, slos), 3),
                    "attainment_2x": round(attainment_of(r, scale_slos(slos, 2.0)), 3),
                    "median_ttft_ms": round(r["median_ttft_ms"], 1), "p99_ttft_ms": round(r["p99_ttft_ms"], 1),
                    "mean_tpot_ms": round(r["mean_tpot_ms"], 2), "p99_tpot_ms": round(r["p99_tpot_ms"], 2),
                    "placements": r.get("placements"),
                    "prefix_hit_rate": None if prefix.get("hit_rate") is None else round(prefix["hit_rate"], 3),
                    "busy": {k: round(v, 2) for k, v in (r.get("busy_fraction") or {}).items()},
                    "host_cpu": {k: round(v, 2) for k, v in (r.get("host_cpu") or {}).items()}})
    return out


def table(all_rows: list[dict]) -> str:
    lines = ["| source | workload | deployment | req/s | 1x | 2x | p50 / p99 TTFT ms | mean TPOT ms | "
             "remote / local / kept | busy | host CPU |", "| --- " * 11 + "|"]
    for r in sorted(all_rows, key=lambda r: (r["workload"], r["source"], r["rate"])):
        pl = r["placements"] or {}
        placed = " / ".join(str(pl.get(k, 0)) for k in ("remote", "local", "kept")) if pl else ""
        busy = " / ".join(f"{v:.2f}" for v in r["busy"].values())
        cpu = " / ".join(f"{v:.2f}" for v in r["host_cpu"].values())  # router thread / process
        lines.append(f"| {r['source']} | {r['workload']} | {r['deployment']} | {r['rate']:g} | "
                     f"{r['attainment_1x']:.1%} | {r['attainment_2x']:.1%} | {r['median_ttft_ms']:.0f} / "
                     f"{r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {placed} | {busy} | {cpu} |")
    return "\n".join(lines)


def main() -> None:
    args = sys.argv[1:]
    as_table = "--table" in args
    found = [row for root in args if root != "--table" for row in rows(root)]
    if as_table:
        print(table(found))
    else:
        json.dump(found, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
