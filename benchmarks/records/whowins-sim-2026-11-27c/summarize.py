"""The who-wins rows from this record's `disagg plan --seeds 3 --adaptive-prefer fastest,balanced`
logs (logs/<tag>.log): markdown rows on stdout, summary.json beside. Run from the repository root;
a record directory as the argument reads (and writes) that one's instead (whowins-sim-2026-11-27d)."""

import json
import re
import sys
from pathlib import Path

HERE = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
ROWS = [("chat-s", "chat", 74, 17), ("chat-r", "chat", 148, 34), ("ph-s", "prefill-heavy", 149, 17),
        ("ph-r", "prefill-heavy", 298, 34), ("dh-s", "decode-heavy", 25, 17), ("dh-r", "decode-heavy", 50, 34),
        ("lp-s", "long-prompt (8k)", 712, 18), ("lp-r", "long-prompt (8k)", 1424, 36),
        ("lpx-s", "long-prompt (8k-32k, extrapolated)", 2470, 19),
        ("lpx-r", "long-prompt (8k-32k, extrapolated)", 4940, 38)]


def best(goodputs: dict[str, float], prefix: str, prefer: str = "") -> tuple[str, float]:
    """The best candidate whose label starts with ``prefix`` (and holds [prefer=...]; a tie: the
    smaller chunk): its chunk and goodput."""
    chunk = lambda k: int(m.group(1)) if (m := re.search(r"chunk=(\d+)", k)) else 0
    keys = [k for k in goodputs if k.startswith(prefix) and f"prefer={prefer}" in k] if prefer else \
        [k for k in goodputs if k.startswith(prefix)]
    if not keys:
        return "-", 0.0
    top = max(keys, key=lambda k: (goodputs[k], -chunk(k)))
    return (str(chunk(top)) if chunk(top) else "-"), goodputs[top]


def main() -> None:
    rows = []
    for tag, workload, ttft, tpot in ROWS:
        log = HERE / "logs" / f"{tag}.log"
        if not log.exists():
            continue
        g = {k: float(v) for k, v in re.findall(r"^(\S+): ([0-9.]+) req/s per GPU$", log.read_text(), re.M)}
        if not g:
            continue
        (cc, colo), p1d = best(g, "colocated"), g.get("1P1D", 0.0)
        fc, fastest = best(g, "1P1D-adaptive", "fastest")
        bc, balanced = best(g, "1P1D-adaptive", "balanced")
        fixed = max(colo, p1d)
        ratio = lambda x: round(x / fixed, 3) if fixed else None
        rows.append({"tag": tag, "workload": workload, "ttft_ms": ttft, "tpot_ms": tpot, "goodput_per_gpu": g,
                     "colocated": colo, "colocated_chunk": cc, "1P1D": p1d, "fastest": fastest, "fastest_chunk": fc,
                     "balanced": balanced, "balanced_chunk": bc, "fastest_vs_best_fixed": ratio(fastest),
                     "balanced_vs_best_fixed": ratio(balanced)})
        r = rows[-1]
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"
        print(f"| {workload} | {ttft} : {tpot} | {colo:.3f} ({cc}) | {p1d:.3f} | {fastest:.3f} ({fc}) | "
              f"{balanced:.3f} ({bc}) | {fmt(r['fastest_vs_best_fixed'])} | {fmt(r['balanced_vs_best_fixed'])} |")
    (HERE / "summary.json").write_text(json.dumps({"unit": "req/s per GPU (simulated, 3 draws per rate)",
                                                   "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
