"""Per 4-s window of a traced run: each hop's median (ms) and the TTFT p50/p90, the adaptive
router's predicted against measured TTFT (since the decision, p50 per path), and per instance its
steps' p50 and decode batch. Reads a `DISAGG_TRACE_DIR` directory (or this record's tar):

    tar xzf benchmarks/records/headline-h100x2-2026-11-27i/bal26-trace.tgz -C /tmp
    python3 benchmarks/records/headline-h100x2-2026-11-27i/hops_over_time.py /tmp/tmp/tr

The first 10 requests (the bench's warm-ups) are left out; t = 0 at the first measured submit.
"""

import collections
import glob
import json
import os
import sys

import numpy as np

HOPS = ["client_send", "submit", "placed", "actor_add", "engine_add", "prompt_start", "first_emit", "first_token",
        "client_first"]
events, steps, decisions = collections.defaultdict(dict), collections.defaultdict(list), []
for name in glob.glob(os.path.join(sys.argv[1], "*.jsonl")):
    for line in open(name, encoding="utf-8"):
        r = json.loads(line)
        if "event" in r:
            events[r["request"]][r["event"]] = r["t"]
        elif r.get("kind") == "step":
            steps[r["instance"]].append(r)
        elif r.get("kind") == "decision":
            decisions.append(r)
reqs = sorted((v["submit"], v) for v in events.values() if "submit" in v)[10:]
t0 = reqs[0][0]
print("window s | n | TTFT p50 / p90 ms | " + " | ".join(f"{a}->{b}" for a, b in zip(HOPS, HOPS[1:])))
for a in range(0, 24, 4):
    sel = [v for t, v in reqs if a <= t - t0 < a + 4]
    if not sel:
        continue
    ttft = [1e3 * (v["client_first"] - v["client_send"]) for v in sel if "client_first" in v and "client_send" in v]
    hops = [np.median([1e3 * (v[y] - v[x]) for v in sel if x in v and y in v] or [np.nan]) for x, y in zip(HOPS, HOPS[1:])]
    print(f"{a}-{a + 4} | {len(sel)} | {np.median(ttft):.0f} / {np.percentile(ttft, 90):.0f} | "
          + " | ".join(f"{h:.1f}" for h in hops))
for inst, rows in sorted(steps.items()):
    print(inst)
    for a in range(0, 32, 4):
        sel = [s for s in rows if a <= s["t_start"] - t0 < a + 4]
        if sel:
            ms = np.array([s["t_end"] - s["t_start"] for s in sel]) * 1e3
            seqs = np.array([s["num_decode_seqs"] for s in sel])
            print(f"  {a}-{a + 4} s: {len(sel)} steps, p50 {np.median(ms):.1f} ms, decodes p50 {np.median(seqs):.0f}")
print("window s | predicted / measured TTFT since the decision, p50 ms, per path")
for a in range(0, 20, 4):
    cells = []
    for path in ("kept", "local", "remote"):
        sel = [r for r in decisions if r["path"] == path and a <= r["t"] - t0 < a + 4]
        pred = [next(p["ttft_ms"] for p in r["predictions"] if p["path"] == path) for r in sel]
        cells.append(f"{path} {np.median(pred):.0f} / {np.median([r['ttft_ms'] for r in sel]):.0f} (n {len(sel)})"
                     if sel else f"{path} -")
    print(f"{a}-{a + 4} | " + " | ".join(cells))
