"""Where requests' time went, hop by hop, from a `DISAGG_TRACE_DIR` directory (`disagg.trace`).

    DISAGG_TRACE_DIR=results/trace disagg bench configs/llama3-8b-1gpu-colocated.yaml --no-compare ...
    python3 benchmarks/trace_report.py results/trace [--json results/trace/hops.json]

Prints, per hop between consecutive events of a request (`disagg.trace.EVENTS`), how many
requests had it and the median, p90 and mean in milliseconds; per placement path when the
trace holds several. Events of several hosts compare wall clocks: keep such runs on one host.
"""

from __future__ import annotations

import argparse
import json
import statistics

from disagg import trace


def summarize(requests: dict) -> dict[str, dict[str, float]]:
    """{hop: {"n", "p50_ms", "p90_ms", "mean_ms"}} in `EVENTS` order."""
    out = {}
    for hop, seconds in trace.hops(requests).items():
        ms = sorted(s * 1e3 for s in seconds)
        out[hop] = {"n": len(ms), "p50_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
                    "mean_ms": statistics.fmean(ms)}
    order = {name: i for i, name in enumerate(trace.EVENTS)}
    return dict(sorted(out.items(), key=lambda item: order[item[0].split(" -> ")[0]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the DISAGG_TRACE_DIR of the run")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    requests = trace.read(args.directory)
    by_path: dict[str, dict] = {}
    for request, events in requests.items():
        by_path.setdefault(events.get("placed", {}).get("path", "unplaced"), {})[request] = events
    report = {path: summarize(group) for path, group in sorted(by_path.items())}
    for path, hops in report.items():
        print(f"{path}: {len(by_path[path])} requests")
        for hop, row in hops.items():
            print(f"  {hop:<28} n {row['n']:>5}  p50 {row['p50_ms']:8.2f} ms  p90 {row['p90_ms']:8.2f} ms  "
                  f"mean {row['mean_ms']:8.2f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
