"""The accuracy table: measured vs simulated per workload and rate (p50 / p99 TTFT, mean TPOT,
goodput), from two result trees of `disagg bench --save-result` and `disagg simulate`.

    python3 benchmarks/records/simulator-accuracy-2026-11-27/table.py MEASURED_DIR SIM_DIR [--json OUT]

Each tree holds one folder per workload (chat, ph, dh, lp) of per-rate JSONs; a measured
summary (`measured.json` of this record) stands in for MEASURED_DIR.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

METRICS = (("p50 TTFT", "median_ttft_ms"), ("p99 TTFT", "p99_ttft_ms"), ("mean TPOT", "mean_tpot_ms"),
           ("goodput", "request_goodput"))


def load(tree: str) -> dict:
    """{(workload, rate): {metric key: value}} of a result tree, or of a summary JSON."""
    if tree.endswith(".json"):
        return {(w, float(r)): v for w, rates in json.load(open(tree)).items() for r, v in rates.items()}
    out = {}
    for path in glob.glob(os.path.join(tree, "*", "*qps*.json")):
        run = json.load(open(path))
        out[(os.path.basename(os.path.dirname(path)), float(run["request_rate"]))] = {
            key: run[key] for _, key in METRICS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("measured")
    parser.add_argument("simulated")
    parser.add_argument("--json", default=None, help="write the measured summary here")
    args = parser.parse_args()
    measured, simulated = load(args.measured), load(args.simulated)
    if args.json:
        summary: dict = {}
        for (w, r), v in sorted(measured.items()):
            summary.setdefault(w, {})[str(r)] = v
        json.dump(summary, open(args.json, "w"), indent=1)
    print("| workload | req/s | " + " | ".join(f"{name} measured vs sim" for name, _ in METRICS) + " |")
    print("| --- | ---: |" + " --- |" * len(METRICS))
    within = total = 0
    for key in sorted(measured):
        if key not in simulated:
            continue
        cells = []
        for _, metric in METRICS:
            m, s = measured[key][metric], simulated[key][metric]
            err = (s - m) / m if m else 0.0
            total += 1
            within += abs(err) <= 0.15
            cells.append(f"{m:.1f} vs {s:.1f} ({err:+.0%})")
        print(f"| {key[0]} | {key[1]:g} | " + " | ".join(cells) + " |")
    print(f"\n{within} of {total} cells within 15%")


if __name__ == "__main__":
    main()
