"""Mean 1x attainment per (policy, rate) over the seeds of each seats-sim.sh output directory.

    python3 benchmarks/records/headline-h100x2-2026-11-27e/seats-table.py results/seats-before results/seats-after
"""
import collections
import glob
import json
import sys

for out in sys.argv[1:]:
    acc = collections.defaultdict(list)
    for path in glob.glob(f"{out}/*/*.json"):
        run = json.load(open(path))
        if "ttfts" in run:
            acc[(path.split("/")[-2].rsplit("-", 1)[0], run["request_rate"])].append(run["slo_attainment"])
    print(out, {f"{policy} {rate:g}": round(sum(v) / len(v), 3) for (policy, rate), v in sorted(acc.items())})
