"""Per-request event traces: where a request's time goes, hop by hop, across processes.

Off unless the environment variable `DISAGG_TRACE_DIR` names a directory (environment-only, as
`DISAGG_LOG`; a fleet's launcher passes it to its actors). Then every process appends one JSON
line per event to ``DIR/trace-<pid>.jsonl``: ``{"event": ..., "request": ..., "t": time.time(),
...}``, wall clock, so events of the router and the actors of one host line up. A request's
events, in order (`EVENTS`):

    client_send     the bench's client hands it to the cluster (`cluster/bench/backends.py`)
    submit          the router accepts it (`Router.submit`)
    reserved        disaggregated: a decode instance reserved its pages (router, after the call)
    placed          the router sent it to the instance that computes its prompt (``path``:
                    colocated, local, kept or remote)
    actor_add       that instance's actor received it (`InstanceActor.add`)
    engine_add      its step loop ran the add, between two steps (`StepLoop`)
    prompt_start    its first prompt chunk was launched (`EngineCore._launch`)
    first_emit      the step that sampled its first token ended (`EngineCore.step`)
    first_token     the router received that token (`Router._on_rows`)
    client_first    the bench's client received it

`benchmarks/trace_report.py DIR` prints the median and p90 of every hop. The first hunt it
served: benchmarks/records/prompt-graphs-2026-11-27 (a launch-bound eager prompt step). Pure
Python (json, os, threading); costs one environment lookup per event while off.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Hashable

ENV = "DISAGG_TRACE_DIR"
EVENTS = ("client_send", "submit", "reserved", "placed", "actor_add", "engine_add", "prompt_start",
          "first_emit", "first_token", "client_first")

_lock = threading.Lock()
_files: dict[str, Any] = {}


def enabled() -> bool:
    """Whether `DISAGG_TRACE_DIR` is set now."""
    return bool(os.environ.get(ENV))


def event(name: str, request_id: Hashable, **fields: Any) -> None:
    """Append one event of ``request_id`` to this process's trace file (nothing while off)."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    line = json.dumps({"event": name, "request": str(request_id), "t": time.time(), **fields}) + "\n"
    with _lock:
        out = _files.get(directory)
        if out is None:
            os.makedirs(directory, exist_ok=True)
            out = _files[directory] = open(os.path.join(directory, f"trace-{os.getpid()}.jsonl"), "a",
                                           buffering=1, encoding="utf-8")
        out.write(line)


def read(directory: str) -> dict[str, dict[str, dict]]:
    """Every trace file under ``directory``: {request: {event: its first record}}."""
    requests: dict[str, dict[str, dict]] = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("trace-") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(directory, name), encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                requests.setdefault(record["request"], {}).setdefault(record["event"], record)
    return requests


def hops(requests: dict[str, dict[str, dict]]) -> dict[str, list[float]]:
    """Seconds between consecutive events (in `EVENTS` order, skipping the ones a request lacks),
    per hop name "a -> b", over every request that has both ends."""
    out: dict[str, list[float]] = {}
    for events in requests.values():
        seen = [name for name in EVENTS if name in events]
        for a, b in zip(seen, seen[1:]):
            out.setdefault(f"{a} -> {b}", []).append(events[b]["t"] - events[a]["t"])
    return out
