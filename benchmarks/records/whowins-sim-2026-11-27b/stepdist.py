import json, glob, sys
import numpy as np
def load(d, prefix=None):
    ev, steps = [], []
    for f in glob.glob(d + "/*.jsonl"):
        for line in open(f):
            r = json.loads(line)
            if r.get("kind") == "step": steps.append(r)
            elif prefix and str(r.get("request", "")).startswith(prefix): ev.append(r["t"])
    if prefix:
        lo, hi = min(ev), max(ev); steps = [s for s in steps if lo <= s["t_start"] <= hi]
    return steps
for label, d, prefix in (("measured", "/tmp/trB", "bench2"), ("simulated", "/tmp/simtr/trace", None)):
    steps = load(d, prefix)
    for inst in ("decode-0", "prefill-0"):
        ss = sorted([s for s in steps if s["instance"] == inst], key=lambda s: s["t_start"])
        dur = np.array([s["t_end"] - s["t_start"] for s in ss]); b = np.array([s["num_decode_seqs"] for s in ss])
        p = np.array([s["num_prefill_tokens"] for s in ss]); ctx = np.array([s["num_context_tokens"] for s in ss])
        gaps = np.array([max(0.0, y["t_start"] - x["t_end"]) for x, y in zip(ss, ss[1:])])
        span = ss[-1]["t_end"] - ss[0]["t_start"]
        dec = p == 0
        print(f"{label:9} {inst:9} steps {len(ss):5} span {span:5.1f}s busy {dur.sum()/span:.2f} mean step {dur.mean()*1e3:5.1f} ms "
              f"(decode-only {dur[dec].mean()*1e3:5.1f}, with prompt {dur[~dec].mean()*1e3 if (~dec).any() else 0:5.1f}) "
              f"batch mean {b.mean():5.1f} (decode-only {b[dec].mean():5.1f}) ctx/seq {ctx[dec].sum()/max(1,b[dec].sum()):6.0f} "
              f"prompt-steps {np.mean(~dec):.2f} prompt tok/step {p.mean():5.0f} gap p50 {np.median(gaps)*1e3:.2f} mean {gaps.mean()*1e3:.2f} ms")
