"""The who-wins rows from this record's `disagg plan --seeds 3` logs (logs/<tag>.log): markdown
rows on stdout, summary.json beside. Run from the repository root."""

import json
import re
from pathlib import Path

HERE = Path(__file__).parent
ROWS = [("chat-s", "chat", 74, 17), ("chat-r", "chat", 148, 34), ("ph-s", "prefill-heavy", 149, 17),
        ("ph-r", "prefill-heavy", 298, 34), ("dh-s", "decode-heavy", 25, 17), ("dh-r", "decode-heavy", 50, 34),
        ("lp-s", "long-prompt (8k)", 712, 18), ("lp-r", "long-prompt (8k)", 1424, 36),
        ("lpx-s", "long-prompt (8k-32k, extrapolated)", 2470, 19),
        ("lpx-r", "long-prompt (8k-32k, extrapolated)", 4940, 38)]


def best(goodputs: dict[str, float], prefix: str) -> tuple[str, float]:
    """The best candidate whose label starts with ``prefix`` (a tie: the smaller chunk)."""
    chunk = lambda k: int(m.group(1)) if (m := re.search(r"chunk=(\d+)", k)) else 0
    keys = [k for k in goodputs if k.startswith(prefix)]
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
        ac, adapt = best(g, "1P1D-adaptive")
        fixed = max(colo, p1d)
        rows.append({"tag": tag, "workload": workload, "ttft_ms": ttft, "tpot_ms": tpot, "goodput_per_gpu": g,
                     "colocated": colo, "colocated_chunk": cc, "1P1D": p1d, "adaptive": adapt, "adaptive_chunk": ac,
                     "adaptive_vs_best_fixed": round(adapt / fixed, 3) if fixed else None,
                     "adaptive_vs_colocated": round(adapt / colo, 3) if colo else None})
        r = rows[-1]
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"
        print(f"| {workload} | {ttft} : {tpot} | {colo:.3f} ({cc}) | {p1d:.3f} | {adapt:.3f} ({ac}) | "
              f"{fmt(r['adaptive_vs_best_fixed'])} | {fmt(r['adaptive_vs_colocated'])} |")
    (HERE / "summary.json").write_text(json.dumps({"unit": "req/s per GPU (simulated, 3 draws per rate)",
                                                   "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
