"""cmp.py DIR: ab8-local.sh's runs in DIR against the base of plan-h200-2026-11-29b (attainment %, * = holds)."""
import json, glob, sys
base = {}
for l in open("benchmarks/records/plan-h200-2026-11-29b/results/ab8-new.jsonl"):
    r = json.loads(l); base[(r["workload"], r["seed"], r["candidate"], r["rate_per_gpu"])] = r
for f in sorted(glob.glob(""+sys.argv[1]+"/new-*-s*.jsonl")):
    wl, seed = f.split("/")[-1][:-6].split("-")[1:]
    for l in open(f):
        r = json.loads(l); b = base.get((wl, seed, r["candidate"], r["rate_per_gpu"]))
        bs = f"{b['attainment']*100:.1f}{'*' if b['holds'] else ' '}" if b else "-"
        print(f"{wl:14s} {seed} {r['candidate']:14s} {r['rate_per_gpu']:6} base {bs:7s} new {r['attainment']*100:.1f}{'*' if r['holds'] else ' '}")
