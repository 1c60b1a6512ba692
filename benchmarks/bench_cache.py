"""Benchmark the page-table bookkeeping: `PagedKVCache.begin_forward` + `end_forward` on the CPU.

    python3 benchmarks/bench_cache.py --out results/bench_cache.json [--reps 2000]

Cases: a decode batch of 256 sequences of about 4096 tokens (page size 16; lengths staggered so
that, as in serving, about 1 in 16 sequences needs a new page per step), the worst decode step
(every sequence needs a page at once), and a prefill batch of 16 x 2048 tokens into fresh
sequences; plus the decode batch with every sequence windowed, or marked to send (the
per-sequence paths). Figures are medians (with p90/p99) of many timed calls. Anchor, from the same run: the
least numpy work any plan builder must do (concatenate the batch's page tables, cumsum their
lengths, gather the new tokens' slots with precomputed indices); the ratio is what the rest of
the bookkeeping (lookups, checks, page allocation, positions, transfer arrays) costs on top.
Target: the decode batch in at most 1 ms (a GPU decode step of an 8B model is about 5 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from disagg.cache import PagedKVCache

PAGE_SIZE = 16
DECODE_TARGET_MS = 1.0


def cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {
        "median_ms": float(np.median(ms)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "min_ms": float(ms.min()),
        "reps": len(seconds),
    }


def anchor_seconds(cache: PagedKVCache, seq_ids: list[int], num_new: int, reps: int) -> list[float]:
    """Time the irreducible numpy work of a plan over the same sequences.

    That is: concatenate the page tables, cumsum their lengths, and gather the slots of the
    last `num_new` positions of every sequence (token -> page index precomputed, untimed).
    """
    tables = [cache._seqs[i].table for i in seq_ids]
    counts = np.array([len(t) for t in tables])
    ends = np.array([cache.seq_length(i) for i in seq_ids])
    positions = (ends[:, None] - num_new + np.arange(num_new)).reshape(-1)
    index = np.repeat(np.cumsum(counts) - counts, num_new) + positions // PAGE_SIZE
    offset = positions % PAGE_SIZE
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        indices = np.concatenate(tables)
        np.cumsum(np.fromiter(map(len, tables), dtype=np.int64, count=len(tables)))
        indices[index] * PAGE_SIZE + offset
        times.append(time.perf_counter() - start)
    return times


def bench_decode(num_seqs: int, seq_len: int, reps: int, aligned: bool = False, mode: str = "plain") -> dict:
    """Decode steps over `num_seqs` sequences of about `seq_len` tokens.

    Modes: "plain"; "windowed" (every sequence has a sliding window of `seq_len` with 4 sinks, so
    each step slides); "sending" (every sequence is marked to send to a receiver, so each step
    also fills push arrays).
    """
    pages_per_seq = (seq_len + reps + PAGE_SIZE) // PAGE_SIZE + 1
    cache = PagedKVCache(num_pages=num_seqs * pages_per_seq, page_size=PAGE_SIZE)
    seq_ids = list(range(num_seqs))
    for seq_id in seq_ids:
        cache.add_sequence(seq_id)
        if mode == "windowed":
            cache.enable_sliding_window(seq_id, seq_len, 4)
    # Aligned: every sequence fills its last page together (worst step every 16th call);
    # staggered: sequence i is i % 16 tokens short, so ~1/16 of them need a page per step.
    lens = [seq_len if aligned else seq_len - (i % PAGE_SIZE) for i in seq_ids]
    cache.begin_forward(seq_ids, lens)
    cache.end_forward()
    ones = [1] * num_seqs
    if mode == "sending":
        map_len = seq_len + reps + 1
        for seq_id in seq_ids:
            cache.disagg_mark_send(seq_id, 0, [1, seq_id * map_len, map_len], recver_pe=1)
        cache.begin_forward(seq_ids, ones)  # drains the page-to-page copies of the prompts
        cache.end_forward()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        cache.begin_forward(seq_ids, ones)
        cache.end_forward()
        times.append(time.perf_counter() - start)
    if aligned:
        # Only steps where every sequence took a page: its length before the step was a multiple of 16.
        first = (PAGE_SIZE - seq_len % PAGE_SIZE) % PAGE_SIZE
        times = times[first::PAGE_SIZE]
    return {"times": times, "anchor": anchor_seconds(cache, seq_ids, 1, 500)}


def bench_prefill(num_seqs: int, seq_len: int, reps: int) -> dict:
    """Prefill batches of `num_seqs` fresh sequences of `seq_len` tokens each."""
    pages = num_seqs * (seq_len // PAGE_SIZE + 1)
    cache = PagedKVCache(num_pages=pages, page_size=PAGE_SIZE)
    seq_ids = list(range(num_seqs))
    lens = [seq_len] * num_seqs
    times, anchor = [], []
    for _ in range(reps):
        for seq_id in seq_ids:
            cache.add_sequence(seq_id)
        start = time.perf_counter()
        cache.begin_forward(seq_ids, lens)
        cache.end_forward()
        times.append(time.perf_counter() - start)
        anchor += anchor_seconds(cache, seq_ids, seq_len, 1)
        for seq_id in seq_ids:
            cache.remove_sequence(seq_id)
    return {"times": times, "anchor": anchor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_cache.json"))
    parser.add_argument("--reps", type=int, default=2000, help="timed decode steps (prefill: reps / 10)")
    args = parser.parse_args()
    cases = {
        "decode 256 x ~4096 tok, page 16": bench_decode(256, 4096, args.reps, aligned=False),
        "decode 256 x 4096 tok, every seq takes a page": bench_decode(256, 4096, args.reps, aligned=True),
        "decode 256 x ~4096 tok, sliding windows": bench_decode(256, 4096, args.reps, mode="windowed"),
        "decode 256 x ~4096 tok, all marked to send": bench_decode(256, 4096, args.reps, mode="sending"),
        "prefill 16 x 2048 tok, page 16": bench_prefill(16, 2048, max(args.reps // 10, 20)),
    }
    figures = []
    for name, case in cases.items():
        ours, anchor = percentiles(case["times"]), percentiles(case["anchor"])
        row = {"name": name, **ours, "anchor_median_ms": anchor["median_ms"]}
        row["ratio_to_anchor"] = ours["median_ms"] / anchor["median_ms"]
        if name.startswith("decode 256 x ~4096"):
            row["target_ms"] = DECODE_TARGET_MS
            row["meets_target"] = ours["median_ms"] <= DECODE_TARGET_MS
        figures.append(row)
    result = {
        "benchmark": "bench_cache",
        "anchor": "numpy floor of a plan: concatenate page tables, cumsum lengths, gather new slots",
        "machine": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "figures": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'case':48s} {'median':>8s} {'p90':>8s} {'p99':>8s} {'anchor':>8s} {'ratio':>6s} {'target':>7s}")
    for f in figures:
        target = f"{f['target_ms']:.1f} ms" if "target_ms" in f else ""
        print(
            f"{f['name']:48s} {f['median_ms']:6.3f}ms {f['p90_ms']:6.3f}ms {f['p99_ms']:6.3f}ms "
            f"{f['anchor_median_ms']:6.3f}ms {f['ratio_to_anchor']:6.1f} {target:>7s}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
