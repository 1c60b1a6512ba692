"""A bounded soak of `disagg serve`'s app on tiny-1p1d (CPU actors): many requests, random client
disconnects, and the prefill instance killed and replaced (`cluster.restart`) during the run.

``SOAK_REQUESTS`` requests (``DISAGG_SOAK_REQUESTS`` overrides it) go over HTTP, ``CONCURRENCY``
at a time, each one of: a whole completion, a stream read to its end, a stream the client leaves
after a few chunks, a request the client gives up on before its answer (both aborts on the
cluster). A third of the way through, prefill-0 is killed; its replacement must serve before the
end. Counted, and all 0: wrong outputs (a completed request whose token ids differ from an
in-process colocated engine's, greedy; a stream without its end), hangs (no answer within
`HANG_S`), 5xx answers, those of the requests the killed instance held among them (`InstanceDied`:
503, counted apart: they migrate to the survivors instead, `disagg.cluster.routing.migration`), and
pages held once the fleet is idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))  # cluster_helpers
from cluster_helpers import launch, mixed_prompts, reference_tokens  # noqa: E402

from disagg.cluster.serve import BackgroundServer, build_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SOAK_REQUESTS = int(os.environ.get("DISAGG_SOAK_REQUESTS", "5000"))
CONCURRENCY = 24
HANG_S = 60.0
MAX_TOKENS = 12
POOL = mixed_prompts(24, seed=52)
KINDS = ("whole", "stream", "leave_stream", "give_up")
WEIGHTS = (4, 4, 1, 1)


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    return reference_tokens(POOL, [MAX_TOKENS] * len(POOL))


def test_soak_with_disconnects_and_a_replaced_instance(ray_local, want):
    config = {"router__lease_s": 3.0, "cluster__restart_backoff_s": 0.5, "router__request_timeout_s": HANG_S}
    with launch("tiny-1p1d", **config) as cluster, BackgroundServer(build_app(cluster)) as server:
        started = time.monotonic()
        counts = asyncio.run(_soak(server.base_url, want, lambda: ray_local.kill(
            cluster.instance("prefill-0").actor, no_restart=True)))
        counts["seconds"] = round(time.monotonic() - started, 1)
        counts["pages_leaked"] = _pages_held_once_idle(cluster)
        replacement = {inst["name"]: inst for inst in cluster.stats()["instances"]}.get("prefill-0r1", {})
        counts["replacement_steps"] = replacement.get("num_steps", 0)
        counts["migrated"] = cluster.router_stats()["counts"].get("migrated", 0)
    print("\nsoak:", counts)
    assert counts["requests"] == SOAK_REQUESTS
    assert {key: counts[key] for key in ("wrong_outputs", "hangs", "server_errors", "pages_leaked",
                                         "died_with_killed_instance")} == {
        "wrong_outputs": 0, "hangs": 0, "server_errors": 0, "pages_leaked": 0, "died_with_killed_instance": 0}, counts
    assert counts["migrated"] >= 1, counts  # the killed instance held some requests
    assert counts["replacement_steps"] > 0, counts  # the replacement served during the run
    assert counts["completed"] > SOAK_REQUESTS // 2, counts


async def _soak(base_url: str, want: list[list[int]], kill) -> dict:
    rng = random.Random(5)
    counts = dict.fromkeys(("requests", "completed", "left", "gave_up", "wrong_outputs", "hangs", "server_errors",
                            "died_with_killed_instance", "other_status"), 0)
    notes: list[str] = []
    limits = httpx.Limits(max_connections=2 * CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=HANG_S) as client:
        seats = asyncio.Semaphore(CONCURRENCY)
        tasks = []
        for i in range(SOAK_REQUESTS):
            await seats.acquire()
            if i == SOAK_REQUESTS // 3:
                kill()
            p, max_tokens = rng.randrange(len(POOL)), rng.randint(1, MAX_TOKENS)
            kind = rng.choices(KINDS, WEIGHTS)[0]
            job = _one(client, kind, POOL[p], max_tokens, want[p][:max_tokens], rng.random(), counts, notes)
            task = asyncio.ensure_future(_timed(job, counts, notes, f"request {i} ({kind})"))
            task.add_done_callback(lambda _: seats.release())
            tasks.append(task)
        await asyncio.gather(*tasks)
    counts["notes"] = notes[:10]
    return counts


async def _timed(job, counts: dict, notes: list[str], what: str) -> None:
    counts["requests"] += 1
    started = time.monotonic()
    try:
        await asyncio.wait_for(job, HANG_S)
    except asyncio.TimeoutError:
        counts["hangs"] += 1
        notes.append(f"{what}: no answer within {HANG_S:g} s (sent {started:.1f})")


async def _one(client: httpx.AsyncClient, kind: str, prompt: list[int], max_tokens: int, expected: list[int],
               luck: float, counts: dict, notes: list[str]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": kind in ("stream", "leave_stream")}
    if kind == "give_up":
        try:
            await client.post("/v1/completions", json=body, timeout=0.002 + 0.05 * luck)
        except httpx.TimeoutException:
            counts["gave_up"] += 1
            return
        counts["completed"] += 1  # answered before the client gave up: nothing to check beyond its status
        return
    if kind == "whole":
        answer = await client.post("/v1/completions", json=body)
        if _status_ok(answer.status_code, answer.text, counts, notes):
            _check(answer.json()["choices"][0]["token_ids"], expected, counts, notes)
        return
    async with client.stream("POST", "/v1/completions", json=body) as answer:
        if not _status_ok(answer.status_code, (await answer.aread()).decode() if answer.status_code != 200 else "",
                          counts, notes):
            return
        tokens, ended, leave_after = [], False, 1 + int(luck * 3)
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                ended = True
                break
            event = json.loads(data)
            if "error" in event:
                _status_ok(_error_status(event), data, counts, notes)
                return
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
            if kind == "leave_stream" and len(tokens) >= leave_after and len(tokens) < max_tokens:
                counts["left"] += 1
                return  # the client leaves: the server aborts the request
        if not ended:
            counts["wrong_outputs"] += 1
            notes.append(f"stream ended without [DONE] after {tokens}")
            return
        _check(tokens, expected, counts, notes)


_STATUS_OF_TYPE = {"service_unavailable": 503, "rate_limit_error": 429, "timeout": 504, "server_error": 500}


def _error_status(event: dict) -> int:
    """The status an in-band SSE error stands for, by its type (`disagg.cluster.serve.cluster_errors`)."""
    return _STATUS_OF_TYPE.get(event["error"].get("type"), 400)


def _status_ok(status: int, text: str, counts: dict, notes: list[str]) -> bool:
    if status == 200:
        return True
    if status == 503 and "died" in text:
        counts["died_with_killed_instance"] += 1
    elif status >= 500:
        counts["server_errors"] += 1
        notes.append(f"{status}: {text[:200]}")
    else:
        counts["other_status"] += 1
        notes.append(f"{status}: {text[:200]}")
    return False


def _check(tokens: list[int], expected: list[int], counts: dict, notes: list[str]) -> None:
    if tokens == expected:
        counts["completed"] += 1
    else:
        counts["wrong_outputs"] += 1
        notes.append(f"{tokens} != {expected}")


def _pages_held_once_idle(cluster, timeout_s: float = 30.0) -> int:
    """Pages still held on the live instances once nothing runs (after the leases expired)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.stats()
        held = sum(inst["total_pages"] - inst["free_pages"] for inst in stats["instances"] if inst["alive"])
        if (held == 0 and stats["router"]["live"] == 0) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)
