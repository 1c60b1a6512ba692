"""Replay of request-ownership faults on tiny-1p1d (CPU actors), with counts.

Classes: an abort that reaches the router before its request's submit (sent before `stream`
began, or while the router's loop is busy right after it began), each id then reused once; an
abort that comes after its request ended, the id then reused; a killed prefill actor while
requests decode, wait for their first decode token, or sit in its queue; a killed decode actor
while requests decode there or sit in the prefill queue for it (that fleet's decode instance
answering reservations mid-forward, `scheduler.overlap_reservations`): the requests the dead
actor held migrate to the survivor and finish like the others; prefix caches reset again
and again (`Cluster.reset_prefix_cache`) while requests that share prefixes run, fork from cached
pages and push. Counted over every request:
wrong outputs (an aborted request with tokens, a finished one whose tokens differ from an
in-process colocated engine, a request failed or migrated that its dead instance did not hold),
hangs (no last delta in time), and the pages still held once the fleet is idle. All must be 0.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))  # cluster_helpers, hooked_actor
from cluster_helpers import (BackgroundStream, hold_router_loop, launch, mixed_prompts,  # noqa: E402
                             reference_tokens)
from hooked_actor import HookedInstanceActor  # noqa: E402

from disagg.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(600)
LEASE_S = 2.0
HANG_S = 60.0
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


class Tally:
    """Counts of one fault class."""

    def __init__(self) -> None:
        self.counts = {"tried": 0, "wrong_outputs": 0, "hangs": 0, "pages_leaked": 0}
        self.notes: list[str] = []

    def wrong(self, what: str) -> None:
        self.counts["wrong_outputs"] += 1
        self.notes.append(what)

    def check_finished(self, name: str, tokens: list[int], last, want: list[int]) -> None:
        self.counts["tried"] += 1
        if last is None:
            self.counts["hangs"] += 1
            self.notes.append(f"{name}: no last delta")
        elif (last.finish_reason, last.error, tokens) != ("length", None, want):
            self.wrong(f"{name}: {last.finish_reason} {last.error} {tokens} != {want}")

    def check_aborted(self, name: str, tokens: list[int], last) -> None:
        self.counts["tried"] += 1
        if last is None:
            self.counts["hangs"] += 1
            self.notes.append(f"{name}: no last delta")
        elif last.finish_reason != "abort" or tokens:
            self.wrong(f"{name}: {last.finish_reason} with {len(tokens)} tokens, expected an abort with none")

    def check_stream(self, name: str, stream: BackgroundStream, want: list[int]) -> None:
        done = stream.done.wait(HANG_S)
        self.check_finished(name, stream.token_ids, stream.deltas[-1] if done and stream.deltas else None, want)

    def check_migrated(self, cluster, num_requests: int) -> None:
        """Exactly the ``num_requests`` the dead actor held migrated (the router's count)."""
        migrated = cluster.router_stats()["counts"].get("migrated", 0)
        if migrated != num_requests:
            self.wrong(f"{migrated} requests migrated, expected the {num_requests} the dead actor held")

    def count_leaks(self, cluster, timeout_s: float) -> None:
        """Pages not free on the live instances once they are idle (waits up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [i for i in cluster.stats()["instances"] if i["alive"]]
            held = sum(i["total_pages"] - i["free_pages"] for i in live)
            if held == 0 or time.monotonic() > deadline:
                self.counts["pages_leaked"] += held
                return
            time.sleep(0.1)


async def _collect(stream) -> tuple[list[int], object]:
    tokens, last = [], None
    try:
        async with asyncio.timeout(HANG_S):
            async for delta in stream:
                tokens.extend(delta.token_ids)
                last = delta
    except TimeoutError:
        return tokens, None
    return tokens, last


def _replay_early_and_late_aborts(cluster, prompts: list[list[int]], want: list[list[int]]) -> dict:
    early, late = Tally(), Tally()

    async def run() -> None:
        for i, prompt in enumerate(prompts):
            rid = f"early-{i}"
            stream = cluster.stream(prompt, PARAMS, request_id=rid)
            if i % 2:  # the abort follows the stream's submit while the router's loop is busy
                with hold_router_loop(cluster):
                    first = asyncio.ensure_future(stream.__anext__())
                    await asyncio.sleep(0.05)
                    cluster.abort(rid)
                delta = await first
                tokens, last = await _collect(stream)
                tokens, last = delta.token_ids + tokens, last or delta
            else:  # the abort goes before the stream began: the router remembers it
                cluster.abort(rid)
                tokens, last = await _collect(stream)
            early.check_aborted(rid, tokens, last)
            early.check_finished(f"{rid} reused", *await _collect(cluster.stream(prompt, PARAMS, request_id=rid)),
                                 want[i])
        for i, prompt in enumerate(prompts):
            rid = f"late-{i}"
            late.check_finished(rid, *await _collect(cluster.stream(prompt, PARAMS, request_id=rid)), want[i])
            cluster.abort(rid)  # the request ended: this abort must hit nothing
            late.check_finished(f"{rid} reused", *await _collect(cluster.stream(prompt, PARAMS, request_id=rid)),
                                want[i])

    asyncio.run(run())
    early.count_leaks(cluster, timeout_s=15)
    return {"abort_before_submit": early, "late_abort_then_reuse": late}


def _replay_killed_prefill(cluster, prompts: list[list[int]], ray) -> Tally:
    """Four decoding, one between its first token and its first decode token, three queued; the
    prefill actor is killed: the last four migrate to the decode instance, and all eight finish."""
    tally = Tally()
    prefill, decode = (cluster.instance(name).actor for name in ("prefill-0", "decode-0"))
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    long_want = reference_tokens(prompts, [64] * len(prompts))
    decoding = [BackgroundStream(cluster, p, params) for p in prompts[:4]]
    _wait_until(lambda: all(len(s.token_ids) >= 2 for s in decoding))
    ray.get(decode.pause_steps.remote(0))
    first_only = BackgroundStream(cluster, prompts[4], params)
    _wait_until(lambda: len(first_only.token_ids) == 1)
    ray.get(prefill.pause_steps.remote(0))
    queued = [BackgroundStream(cluster, p, params) for p in prompts[5:8]]
    _wait_until(lambda: ray.get(prefill.stats.remote())["waiting"] == 3)
    ray.kill(prefill, no_restart=True)
    _wait_until(lambda: not cluster.instance("prefill-0").alive)
    ray.get(decode.resume_steps.remote())
    for i, stream in enumerate(decoding):
        tally.check_stream(f"decoding-{i}", stream, long_want[i])
    tally.check_stream("first-only", first_only, long_want[4])
    for i, stream in enumerate(queued):
        tally.check_stream(f"queued-{i}", stream, long_want[5 + i])
    tally.check_migrated(cluster, 4)
    tally.count_leaks(cluster, timeout_s=LEASE_S + 15)
    return tally


def _replay_killed_decode(cluster, prompts: list[list[int]], ray) -> Tally:
    """Three decoding, three queued in the prefill engine for the decode instance; the decode
    actor is killed: all six migrate to the prefill instance (kept; the queued ones' pushes
    aborted there) and finish."""
    tally = Tally()
    prefill, decode = (cluster.instance(name).actor for name in ("prefill-0", "decode-0"))
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    long_want = reference_tokens(prompts[:6], [64] * 6)
    decoding = [BackgroundStream(cluster, p, params) for p in prompts[:3]]
    _wait_until(lambda: all(len(s.token_ids) >= 2 for s in decoding))
    ray.get(decode.pause_steps.remote(0))
    ray.get(prefill.pause_steps.remote(0))
    queued = [BackgroundStream(cluster, p, params) for p in prompts[3:6]]
    _wait_until(lambda: ray.get(prefill.stats.remote())["waiting"] == 3)
    ray.kill(decode, no_restart=True)
    _wait_until(lambda: not cluster.instance("decode-0").alive)
    ray.get(prefill.resume_steps.remote())
    for i, stream in enumerate(decoding):
        tally.check_stream(f"decoding-{i}", stream, long_want[i])
    for i, stream in enumerate(queued):
        tally.check_stream(f"queued-{i}", stream, long_want[3 + i])
    tally.check_migrated(cluster, 6)
    tally.count_leaks(cluster, timeout_s=15)
    return tally


def _replay_reset_mid_flight(cluster, prompts: list[list[int]], want: list[list[int]]) -> Tally:
    """Every request's prompt shares a 40-token system prompt (cached pages to fork from on both
    instances); two rounds of them run concurrently while another thread resets every instance's
    prefix cache in bursts (three resets a few milliseconds apart). After each burst it waits
    until some request has forked from the cache again, so the resets land while forked requests
    run however fast the machine is (resetting without pause, a slow CI machine once saw 31 resets
    and no fork at all: the replay proved nothing)."""
    import threading

    tally, stop, resets = Tally(), threading.Event(), [0]

    def hits() -> int:
        return sum(i.get("prefix_hit_tokens", 0) for i in cluster.stats()["instances"])

    def keep_resetting() -> None:
        while not stop.is_set():
            for _ in range(3):
                cluster.reset_prefix_cache()
                resets[0] += 1
                time.sleep(0.005)
            seen = hits()
            while not stop.is_set() and hits() == seen:
                stop.wait(0.01)

    async def run() -> None:
        for round_ in range(2):
            outs = await asyncio.gather(*(_collect(cluster.stream(p, PARAMS, request_id=f"reset-{round_}-{i}"))
                                          for i, p in enumerate(prompts)))
            for i, (tokens, last) in enumerate(outs):
                tally.check_finished(f"reset-{round_}-{i}", tokens, last, want[i])

    before = hits()
    resetter = threading.Thread(target=keep_resetting, daemon=True)
    resetter.start()
    try:
        asyncio.run(run())
    finally:
        stop.set()
        resetter.join(HANG_S)
    if resets[0] < 3 or hits() == before:  # else the replay proved nothing: no reset, or no fork
        tally.notes.append(f"{resets[0]} resets and {hits() - before} prefix-hit tokens during the requests")
        tally.counts["wrong_outputs"] += 1
    cluster.reset_prefix_cache()  # what is cached once idle is not held: every page must come back
    tally.count_leaks(cluster, timeout_s=15)
    return tally


def test_fault_replay_counts(ray_local):
    prompts = mixed_prompts(8, seed=7)
    want = reference_tokens(prompts, [PARAMS.max_tokens] * len(prompts))
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False) as cluster:
        tallies = _replay_early_and_late_aborts(cluster, prompts, want)
        shared = [prompts[5][:40] + p for p in prompts]  # prompts[5] has 90 tokens: a 40-token system prompt
        tallies["reset_mid_flight"] = _replay_reset_mid_flight(
            cluster, shared, reference_tokens(shared, [PARAMS.max_tokens] * len(shared)))
        tallies["killed_prefill"] = _replay_killed_prefill(cluster, prompts, ray_local)
    # The decode instance answers reservations mid-forward here (`scheduler.overlap_reservations`):
    # killed with such calls in flight, it still migrates exactly its own requests.
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False,
                scheduler__overlap_reservations=True) as cluster:
        tallies["killed_decode"] = _replay_killed_decode(cluster, prompts, ray_local)
    report = {name: tally.counts for name, tally in tallies.items()}
    print("fault replay:", report)
    notes = [note for tally in tallies.values() for note in tally.notes]
    tried = {name: counts["tried"] for name, counts in report.items()}
    assert tried == {"abort_before_submit": 16, "late_abort_then_reuse": 16, "reset_mid_flight": 16,
                     "killed_prefill": 8, "killed_decode": 6}, report
    for name, counts in report.items():
        assert (counts["wrong_outputs"], counts["hangs"], counts["pages_leaked"]) == (0, 0, 0), (name, counts, notes)


def _wait_until(predicate, timeout_s: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
