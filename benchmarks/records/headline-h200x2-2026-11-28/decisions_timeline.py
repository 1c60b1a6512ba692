"""The adaptive router's decisions of one traced run over time (this record, section 3).

Usage: tar xzf decode-heavy-trace.tgz && python3 decisions_timeline.py tmp/trace/trace-3182.jsonl bench2 68.3215 11.2129
(bench2 = the first measured rate of that process's runs, 26 req/s; bench3 = 30 req/s.)
Prints per 5-s window of arrival: decisions, none admissible, path chosen, TTFT / TPOT misses and
misses by path; the (chosen, admissible paths) counts; every 8th decision's predictions.
"""
import collections
import json
import sys

path, run, ttft_ms, tpot_ms = sys.argv[1], sys.argv[2] + ".", float(sys.argv[3]), float(sys.argv[4])
dec, tpot, first, send = {}, {}, {}, {}
for line in open(path):
    r = json.loads(line)
    q = r.get("request", "")
    if run not in q:
        continue
    if r.get("kind") == "decision":
        dec[q] = r
    elif r.get("kind") == "tpot":
        tpot[q] = r["tpot_ms"]
    elif r.get("event") == "client_first":
        first[q] = r["t"]
    elif r.get("event") == "client_send":
        send[q] = r["t"]
t0 = min(send.values())
windows = collections.defaultdict(collections.Counter)
pairs = collections.Counter()
for q, r in dec.items():
    w = windows[int((send[q] - t0) // 5) * 5]
    admissible = tuple(sorted(p["path"] for p in r["predictions"] if p["admissible"]))
    pairs[(r["chosen"], admissible)] += 1
    ttft_miss = (first[q] - send[q]) * 1e3 > ttft_ms
    tpot_miss = tpot.get(q, 0.0) > tpot_ms
    w["n"] += 1
    w["none admissible"] += not admissible
    w[r["chosen"]] += 1
    w["TTFT miss"] += ttft_miss
    w["TPOT miss"] += tpot_miss
    w["miss " + r["chosen"]] += ttft_miss or tpot_miss
print("window s | " + " | ".join(("n", "none admissible", "remote", "local", "kept", "TTFT miss", "TPOT miss",
                                   "miss remote", "miss local", "miss kept")))
for k in sorted(windows):
    w = windows[k]
    print(f"{k:3d}-{k + 5:<3d} | " + " | ".join(str(w[c]) for c in ("n", "none admissible", "remote", "local", "kept",
                                                                   "TTFT miss", "TPOT miss", "miss remote",
                                                                   "miss local", "miss kept")))
print("\n(chosen, admissible paths): count")
for k, v in pairs.most_common():
    print(f"  {k}: {v}")
print("\nevery 8th decision: s since the first, chosen, path:TTFT ms/TPOT ms predicted (X: not admissible)")
rows = sorted(dec.values(), key=lambda r: r["t"])
for r in rows[::8]:
    preds = "  ".join(f"{p['path']}:{p['ttft_ms']:.1f}/{p['tpot_ms']:.2f}{'' if p['admissible'] else 'X'}"
                      for p in r["predictions"])
    print(f"{r['t'] - rows[0]['t']:6.2f} {r['chosen']:6s} {preds}")
