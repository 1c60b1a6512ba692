"""The router's deltas to a caller's event loop: one `call_soon_threadsafe` per delta (before
`disagg.cluster.cluster.Handoff`) against one per router loop turn (`Handoff`), with the shapes of
a busy two-instance fleet: every ``--period-ms`` each instance's batch emits one delta to each of
``--streams`` / 2 requests; the caller's loop has one task per stream reading its queue. Reports,
per way, the router thread's CPU seconds, the process's, and the delay from a batch's emission
to its deltas' reads (p50 / p99 ms), as JSON.

    python3 benchmarks/bench_handoff.py                       # ~15 s on 2 cores
    python3 benchmarks/bench_handoff.py --streams 340 --period-ms 6 --seconds 3 --out results/handoff.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

from disagg.cluster.cluster import Handoff


def run(way: str, streams: int, period_s: float, seconds: float) -> dict:
    router_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=router_loop.run_forever, daemon=True)
    thread.start()
    caller_loop = asyncio.new_event_loop()
    queues = [asyncio.Queue() for _ in range(streams)]
    handoff = Handoff(router_loop, caller_loop)
    rounds = max(1, int(seconds / period_s))
    delays: list[float] = []
    cpu: dict[str, float] = {}

    def put(queue: asyncio.Queue, item: float) -> None:
        if way == "per-delta":
            caller_loop.call_soon_threadsafe(queue.put_nowait, item)
        else:
            handoff.put(queue, item)

    def batch(half: int) -> None:  # one instance's batch: a delta to each of its streams
        now = time.perf_counter()
        for queue in queues[half::2]:
            put(queue, now)

    async def emit() -> None:
        cpu["router_start"] = time.thread_time()
        for _ in range(rounds):
            router_loop.call_soon(batch, 0)
            router_loop.call_soon(batch, 1)
            await asyncio.sleep(period_s)
        cpu["router_s"] = time.thread_time() - cpu["router_start"]

    async def read(queue: asyncio.Queue) -> None:
        for _ in range(rounds):
            sent = await queue.get()
            delays.append(time.perf_counter() - sent)

    async def main() -> None:
        readers = [asyncio.ensure_future(read(q)) for q in queues]
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(emit(), router_loop))
        await asyncio.gather(*readers)

    process0, wall0 = time.process_time(), time.perf_counter()
    caller_loop.run_until_complete(main())
    wall = time.perf_counter() - wall0
    router_loop.call_soon_threadsafe(router_loop.stop)
    thread.join(5)
    caller_loop.close()
    delays.sort()
    return {"way": way, "deltas": len(delays), "wall_s": round(wall, 3), "router_cpu_s": round(cpu["router_s"], 3),
            "process_cpu_s": round(time.process_time() - process0, 3),
            "delay_p50_ms": round(1e3 * statistics.median(delays), 3),
            "delay_p99_ms": round(1e3 * delays[int(0.99 * (len(delays) - 1))], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=340, help="live requests (both instances)")
    parser.add_argument("--period-ms", type=float, default=6.0, help="an engine step's time")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    ways = ("per-delta", "handoff") * 2  # alternating, twice each
    rows = [run(way, args.streams, args.period_ms / 1e3, args.seconds) for way in ways]
    by = {way: [r for r in rows if r["way"] == way] for way in ("per-delta", "handoff")}
    summary = {"streams": args.streams, "period_ms": args.period_ms, "seconds": args.seconds, "runs": rows,
               "router_cpu_ratio": round(sum(r["router_cpu_s"] for r in by["handoff"])
                                         / sum(r["router_cpu_s"] for r in by["per-delta"]), 3),
               "process_cpu_ratio": round(sum(r["process_cpu_s"] for r in by["handoff"])
                                          / sum(r["process_cpu_s"] for r in by["per-delta"]), 3)}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
