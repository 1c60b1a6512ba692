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

Page hand-out order (`disagg.pages`), each under the cache's order ("runs") and TVM's free stack
("tvm_stack", selectable only here, by swapping the pool of a fresh cache): runs per request of
a 4,096-token prompt on a fresh cache and after the demo's pattern (46,000 pages of 16 tokens;
requests of 40,000, 24,000 and 20,000 tokens, in turn, until the cache is full; every other one
finished), and the mean run length (pages per run of each request's page table, prompt plus
decode growth, at its end) after a churn of 10,000 random requests; plus the time of
`remove_sequence` + `add_sequence` + the prompt's reservation under each order.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from disagg import posmap
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


class TvmStackPool:
    """TVM's free-page stack (the cache's order before hand-out by runs), for comparison only.

    Implements what `PagedKVCache` calls on its pool on the paths these benchmarks take (no fork
    copies, so nothing is ever parked).
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, -1, -1))
        self.deferred: dict[int, None] = {}
        self.touched: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int, after: int | None = None) -> list[int]:
        pages = self.free[len(self.free) - n :][::-1]
        del self.free[len(self.free) - n :]
        return pages

    def take_after(self, after: int | None, n: int) -> list[int]:
        return []

    def take_many(self, afters: list, counts: list[int]) -> list[list[int]]:
        pages = self.take(sum(counts))
        ends = np.cumsum(counts).tolist()
        return [pages[end - n : end] for n, end in zip(counts, ends)]

    def give(self, pages) -> None:
        self.free.extend(pages)

    def num_untouched(self, pages) -> int:
        return sum(1 for _ in pages)

    def release_deferred(self) -> None:
        pass


def new_cache(num_pages: int, order: str) -> PagedKVCache:
    """A fresh cache handing out pages by runs (the cache's order) or TVM's stack."""
    cache = PagedKVCache(num_pages=num_pages, page_size=PAGE_SIZE)
    if order == "tvm_stack":
        cache._pool = TvmStackPool(num_pages)
        cache._copies.pool = cache._pool
    return cache


def recv(cache: PagedKVCache, seq_id: int, num_tokens: int) -> int:
    """Reserve a prompt of `num_tokens` as a receiver does; return the runs of its map."""
    cache.add_sequence(seq_id)
    cmap = cache.disagg_prepare_recv(seq_id, num_tokens)
    cache.end_forward()
    return cmap[0]


def page_runs(table: np.ndarray) -> int:
    return int(np.count_nonzero(np.diff(table) != 1)) + 1 if len(table) else 0


def bench_page_order(order: str, churn: int, seed: int = 0) -> dict:
    """Runs per request (fresh, demo pattern) and mean run length after `churn` requests."""
    fresh = recv(new_cache(46_000, order), 0, 4096)
    cache = new_cache(46_000, order)
    sizes, seq_id = (40_000, 24_000, 20_000), 0
    while cache.num_free_pages * PAGE_SIZE >= sizes[seq_id % 3]:
        recv(cache, seq_id, sizes[seq_id % 3])
        seq_id += 1
    for finished in range(1, seq_id, 2):
        cache.remove_sequence(finished)
    demo = recv(cache, seq_id, 4096)
    # Churn: requests of 16..8192 prompt tokens on 8,192 pages; each step one request arrives
    # (random ones finish until it fits, and half the time one more finishes), and every 8th
    # step every running request decodes 16 tokens (a page each, interleaved).
    rng = np.random.default_rng(seed)
    cache = new_cache(8192, order)
    running: list[int] = []
    pages = runs = 0
    times = []
    for request in range(churn):
        length = int(rng.integers(16, 8193))
        start = time.perf_counter()
        while running and (cache.num_free_pages < length // PAGE_SIZE + 2 or rng.random() < 0.5 / len(running)):
            done = running.pop(int(rng.integers(len(running))))
            table = cache._seqs[done].table
            pages, runs = pages + len(table), runs + page_runs(table)
            cache.remove_sequence(done)
        recv(cache, request, length)
        times.append(time.perf_counter() - start)
        running.append(request)
        if request % 8 == 7:
            ids = running[: cache.num_free_pages]  # 16 tokens take at most one page each
            cache.begin_forward(ids, [PAGE_SIZE] * len(ids))
            cache.end_forward()
    return {
        "order": order,
        "runs_fresh_4096": fresh,
        "runs_after_demo_4096": demo,
        "demo_requests": seq_id,
        "churn_requests": churn,
        "churn_mean_run_pages": pages / max(runs, 1),
        "churn_mean_runs_per_request": runs / max(churn - len(running), 1),
        "churn_step": percentiles(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_cache.json"))
    parser.add_argument("--reps", type=int, default=2000, help="timed decode steps (prefill: reps / 10)")
    parser.add_argument("--churn", type=int, default=10_000, help="requests of the page-order churn")
    args = parser.parse_args()
    page_order = [bench_page_order(order, args.churn) for order in ("tvm_stack", "runs")]
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
        "page_order": page_order,
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
    print(f"{'page order':10s} {'runs fresh':>10s} {'runs demo':>10s} {'churn run len':>14s} "
          f"{'runs/req':>9s} {'step median':>12s}")
    for row in page_order:
        print(f"{row['order']:10s} {row['runs_fresh_4096']:10d} {row['runs_after_demo_4096']:10d} "
              f"{row['churn_mean_run_pages']:14.1f} {row['churn_mean_runs_per_request']:9.2f} "
              f"{row['churn_step']['median_ms']:10.3f}ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
