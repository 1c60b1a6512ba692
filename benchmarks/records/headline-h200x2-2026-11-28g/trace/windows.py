import json, glob, collections, sys
import numpy as np
T, P = 0.401834, 0.023751
def load(tag):
    d = json.load(open(glob.glob(f'{tag}/*.json')[0]))
    recs = [json.loads(l) for l in open(glob.glob(f'tr-{"adaptive" if tag=="adaptive" else "colo"}/*.jsonl')[0])]
    return d, recs
for tag in ("adaptive", "colo"):
    d, recs = load(tag)
    print("==", tag, "busy", d.get("busy_fraction"), "placements", d.get("placements"), "prefix", {k: v for k, v in (d.get("prefix_cache") or {}).items() if not isinstance(v, dict)})
    ttft = np.array(d["ttfts"]); st = np.array(d["start_times"]); outl = np.array(d["output_lens"]); lat = np.array(d["latencies"])
    tpot = np.where(outl > 1, (lat - ttft) / np.maximum(outl - 1, 1), 0)
    miss_t = ttft > T; miss_p = tpot > P
    print(f"n={len(ttft)} ttft-miss={miss_t.sum()} tpot-miss={miss_p.sum()} both={(miss_t&miss_p).sum()}")
    # misses by 2-s window of send time
    w = (st - st.min()) // 2
    print(" window misses:", [(int(k), int(((w == k) & (miss_t | miss_p)).sum()), int((w == k).sum())) for k in np.unique(w)])
    steps = [r for r in recs if r["kind"] == "step"]
    for inst in sorted({s["instance"] for s in steps}):
        ss = [s for s in steps if s["instance"] == inst]
        pre = sum(s["num_prefill_tokens"] for s in ss); dec = sum(s["num_decode_seqs"] for s in ss)
        busy = sum(s["t_end"] - s["t_start"] for s in ss)
        pure_prefill = sum(s["t_end"] - s["t_start"] for s in ss if s["num_decode_seqs"] == 0)
        print(f"  {inst}: steps {len(ss)} prefill tokens {pre} decode tokens {dec} busy {busy:.2f}s prefill-only {pure_prefill:.2f}s mean batch {dec/max(1,len(ss)):.1f}")
    dec = [r for r in recs if r["kind"] == "decision"]
    if dec:
        by = collections.Counter(r["chosen"] for r in dec)
        print("  decisions", by)
        idx = {r["request"]: r for r in dec}
        names = [f"shared-prefix-{i}" for i in range(len(ttft))]
        for path in ("remote", "local", "kept"):
            sel = np.array([idx.get(n, {}).get("chosen") == path for n in names])
            if sel.sum():
                pred = np.array([idx[n]["ttft_ms"] for n, s in zip(names, sel) if s])
                print(f"   {path}: n={sel.sum()} ttft p50 {np.median(ttft[sel])*1e3:.0f} p99 {np.percentile(ttft[sel],99)*1e3:.0f} pred p50 {np.median(pred):.0f} ttft-miss {(miss_t&sel).sum()} tpot-miss {(miss_p&sel).sum()} mean tpot {tpot[sel].mean()*1e3:.1f}")
        adm = collections.Counter(sum(p["admissible"] for p in r["predictions"]) for r in dec)
        print("  admissible paths per decision", sorted(adm.items()))
