"""Time from a killed instance to the fleet at full strength (`cluster.rebuild`), on a CPU fleet.

Per run: launch CONFIG (``cluster.rebuild_after_s`` 0, ``cluster.rebuild_drain_s`` from
``--drain-s``), keep ``--concurrency`` greedy requests of ``--max-tokens`` streaming (each one
that ends is followed by the next), kill ``--victim``, and read: the seconds from the kill to
full strength (every instance of the config alive in one new heap: the rebuild's end) and to the
first request after it that went prefill -> decode with its KV pushed; the router's figures
(drain, kill, start, migrated); the longest wait for a first token and the longest gap in any
stream's tokens (what a client sees of the unavailability); and how many requests failed (any
finish other than length is one). One JSON line (one run, one Ray head: run it again for more).

    python3 benchmarks/bench_rebuild.py                                   # tiny-1p1d, ~20 s
    python3 benchmarks/bench_rebuild.py --victim decode-0 --drain-s 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import ray

from disagg.cluster import Cluster
from disagg.config import Config
from disagg.sampling import SamplingParams

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class Load:
    """``concurrency`` streams kept going on their own thread and loop until `stop`."""

    def __init__(self, cluster: Cluster, concurrency: int, max_tokens: int) -> None:
        self.cluster, self.params = cluster, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.finishes: list[str] = []
        self.token_times: list[list[float]] = []
        self.ttft_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(concurrency)), daemon=True)
        self._thread.start()

    async def _run(self, concurrency: int) -> None:
        await asyncio.gather(*(self._stream(i) for i in range(concurrency)))

    async def _stream(self, slot: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = [3 + (slot * 31 + n * 7 + j) % 250 for j in range(8 + (slot * 13 + n) % 80)]
            times: list[float] = []
            finish, sent = "none", time.monotonic()
            async for delta in self.cluster.stream(prompt, self.params):
                times += [time.monotonic()] * len(delta.token_ids)
                if delta.finished:
                    finish = delta.finish_reason
            self.finishes.append(finish)
            self.token_times.append(times)
            self.ttft_s.append(times[0] - sent if times else float("inf"))
            n += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def longest_gap_s(self) -> float:
        return max((b - a for times in self.token_times for a, b in zip(times, times[1:])), default=0.0)


def run_once(config: Config, victim: str, concurrency: int, max_tokens: int) -> dict:
    with Cluster.launch(config) as cluster:
        load = Load(cluster, concurrency, max_tokens)
        time.sleep(2.0)  # streams going
        killed_at = time.monotonic()
        ray.kill(cluster.instance(victim).actor, no_restart=True)
        while cluster.rebuild_phase is None and time.monotonic() < killed_at + 30:
            time.sleep(0.01)  # the death seen
        while cluster.rebuild_phase is not None:
            time.sleep(0.01)
        full_s = time.monotonic() - killed_at
        pushed = cluster.stats()["instances"][0].get("pushed_bytes", 0)
        while True:  # the first request placed after the rebuild that pushed KV
            (done,) = cluster.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, ignore_eos=True), timeout_s=60)
            if cluster.stats()["instances"][0].get("pushed_bytes", 0) > pushed:
                break
        push_s = time.monotonic() - killed_at
        time.sleep(2.0)  # streams on the new fleet
        load.stop()
        stats = cluster.stats()
        return {"victim": victim, "drain_s_setting": config.cluster.rebuild_drain_s,
                "kill_to_full_strength_s": round(full_s, 3), "kill_to_first_push_s": round(push_s, 3),
                "router": stats["rebuild"]["last"], "requests": len(load.finishes),
                "failed": sum(f != "length" for f in load.finishes),
                "longest_ttft_s": round(max(load.ttft_s), 3), "longest_token_gap_s": round(load.longest_gap_s(), 3),
                "degraded_after": stats["degraded"], "instances": [i["name"] for i in stats["instances"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny-1p1d")
    parser.add_argument("--victim", default="prefill-0")
    parser.add_argument("--drain-s", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    config = Config.from_yaml(CONFIGS / f"{args.config}.yaml").override(
        {"cluster.rebuild_after_s": 0.0, "cluster.rebuild_drain_s": args.drain_s})
    print(json.dumps(run_once(config, args.victim, args.concurrency, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
