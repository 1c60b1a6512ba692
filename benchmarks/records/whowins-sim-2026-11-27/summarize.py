"""The who-wins table of this record from its `disagg plan` logs (logs/<policy>-<row>.log):
prints the markdown rows and writes summary.json. Run from the repository root."""

import json
import re
from pathlib import Path

HERE = Path(__file__).parent
ROWS = [("chat", "strict", 74, 17), ("chat", "relaxed", 148, 34),
        ("prefill-heavy", "strict", 149, 17), ("prefill-heavy", "relaxed", 298, 34),
        ("decode-heavy", "strict", 25, 17), ("decode-heavy", "relaxed", 50, 34),
        ("long-prompt", "strict", 712, 18), ("long-prompt", "relaxed", 1424, 36),
        ("long-prompt", "strict", 2470, 19, "-ctx33792"), ("long-prompt", "relaxed", 4940, 38, "-ctx33792")]
TAGS = {"chat": "chat", "prefill-heavy": "ph", "decode-heavy": "dh", "long-prompt": "lp"}
X_TAGS = {"-ctx33792": "lpx"}  # long-prompt on the profile with its context raised (README)


def goodputs(path: Path) -> dict[str, float]:
    found = re.findall(r"^(\S+): ([0-9.]+) req/s per GPU$", path.read_text(), re.M)
    return {label: float(value) for label, value in found}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def chunk_runs() -> dict[tuple, dict[int, float]]:
    """adaptive-chunks.jsonl (adaptive_chunks.py): (workload, ttft, tpot) -> {chunk: goodput per GPU}."""
    out = {}
    path = HERE / "adaptive-chunks.jsonl"
    for line in path.read_text().splitlines() if path.exists() else ():
        run = json.loads(line)
        out[(run["workload"], run["ttft_ms"], run["tpot_ms"])] = {
            int(re.search(r"chunk=(\d+)", k).group(1)): v for k, v in run["goodput_per_gpu"].items()}
    return out


def main() -> None:
    rows, chunks = [], chunk_runs()
    for workload, scale, ttft, tpot, *suffix in ROWS:
        suffix = suffix[0] if suffix else ""
        row = {"workload": workload, "slo": scale, "ttft_ms": ttft, "tpot_ms": tpot, "profile_suffix": suffix}
        tag = X_TAGS.get(suffix, TAGS[workload])
        for policy in ("before", "after"):
            log = HERE / "logs" / f"{policy}-{tag}-{scale[0]}.log"
            if not log.exists():
                continue
            g = goodputs(log)
            colo = {k: v for k, v in g.items() if k.startswith("colocated")}
            best = max(colo, key=lambda k: (colo[k], -int(re.search(r"chunk=(\d+)", k).group(1))))
            other = max(colo[best], g["1P1D"])
            row[policy] = {"colocated_best": colo[best], "colocated_chunk": int(re.search(r"chunk=(\d+)", best).group(1)),
                           "colocated_all": colo, "1P1D": g["1P1D"], "1P1D-adaptive": g["1P1D-adaptive"],
                           "adaptive_vs_best_fixed": ratio(g["1P1D-adaptive"], other),
                           "adaptive_vs_colocated": ratio(g["1P1D-adaptive"], colo[best])}
            if policy == "after":  # the profile's chunk (8192) from plan, the others from adaptive_chunks.py
                by_chunk = {8192: g["1P1D-adaptive"], **chunks.get((workload, float(ttft), float(tpot)), {})}
                top = max(by_chunk, key=lambda c: (by_chunk[c], c))
                row[policy].update({"adaptive_by_chunk": by_chunk, "adaptive_best_chunk": top,
                                    "adaptive_best": by_chunk[top],
                                    "adaptive_best_vs_best_fixed": ratio(by_chunk[top], other),
                                    "adaptive_best_vs_colocated": ratio(by_chunk[top], colo[best])})
        rows.append(row)
    (HERE / "summary.json").write_text(json.dumps({"unit": "req/s per GPU (simulated)", "rows": rows}, indent=1) + "\n")
    for row in rows:
        a, b, suffix = row.get("after"), row.get("before"), row["profile_suffix"]
        if a is None:
            continue
        fmt = lambda r: "-" if r is None else f"{r:.2f}x"
        print(f"| {row['workload']}{' (32k ctx)' if suffix else ''} | {row['slo']} (ttft:{row['ttft_ms']} tpot:{row['tpot_ms']}) | "
              f"{a['colocated_best']:.3f} ({a['colocated_chunk']}) | {a['1P1D']:.3f} | {a['1P1D-adaptive']:.3f} | "
              f"{fmt(a['adaptive_vs_best_fixed'])} | {fmt(a['adaptive_vs_colocated'])} | "
              f"{a['adaptive_best']:.3f} ({a['adaptive_best_chunk']}) | {fmt(a['adaptive_best_vs_best_fixed'])} | "
              + (f"{b['1P1D-adaptive']:.3f} ({fmt(b['adaptive_vs_best_fixed'])}) |" if b else "- |"))


if __name__ == "__main__":
    main()
