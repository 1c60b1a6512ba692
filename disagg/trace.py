"""Event traces: where a request's time goes, hop by hop, across processes, and what each
instance's step loop did meanwhile.

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

Records that belong to no request go to the same files as ``{"kind": ..., ...}`` (`record`;
`read` skips them, `read_records` returns them). Each instance's step loop (`disagg.cluster.
step_loop`) writes two kinds, times in wall-clock seconds:

    step    one `engine.step()` that read a forward's tokens (t_start to t_end on the loop's
            thread; it may also launch the next forward): instance, t_start, t_end, the forward's
            num_prefill_tokens, num_decode_seqs and num_context_tokens, num_prompts (requests
            whose prompt tokens it computed) and, up to `MAX_PROMPT_IDS` of them, prompts (ids)
    call    one call the loop ran between steps (add, reserve, abort, ...): instance, name,
            t_queued (handed to the loop), t_ran (it began), t_done

`benchmarks/trace_report.py DIR` prints the median and p90 of every hop, and per instance its
steps' durations, gaps and prompt tokens and its calls' waits: where a request's time goes
between the router, the instances' loops and their forwards (a launch-bound prompt step shows as
steps far longer than their tokens explain). Pure Python (json, os, threading); costs one
environment lookup per event while off.
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
MAX_PROMPT_IDS = 16  # a step record lists its prompts' ids up to this many (num_prompts: all)

_lock = threading.Lock()
_files: dict[str, Any] = {}


def enabled() -> bool:
    """Whether `DISAGG_TRACE_DIR` is set now."""
    return bool(os.environ.get(ENV))


def event(name: str, request_id: Hashable, **fields: Any) -> None:
    """Append one event of ``request_id`` to this process's trace file (nothing while off)."""
    directory = os.environ.get(ENV)
    if directory:
        _write(directory, {"event": name, "request": str(request_id), "t": time.time(), **fields})


def record(kind: str, **fields: Any) -> None:
    """Append one record of ``kind`` ("step", "call": no request's event) to this process's
    trace file (nothing while off); ``fields`` carry their own times."""
    directory = os.environ.get(ENV)
    if directory:
        _write(directory, {"kind": kind, **fields})


def _write(directory: str, line: dict) -> None:
    text = json.dumps(line) + "\n"
    with _lock:
        out = _files.get(directory)
        if out is None:
            os.makedirs(directory, exist_ok=True)
            out = _files[directory] = open(os.path.join(directory, f"trace-{os.getpid()}.jsonl"), "a",
                                           buffering=1, encoding="utf-8")
        out.write(text)


def _lines(directory: str):
    """Every line of every trace file under ``directory``, parsed, file by file."""
    for name in sorted(os.listdir(directory)):
        if name.startswith("trace-") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name), encoding="utf-8") as lines:
                yield from (json.loads(line) for line in lines)


def read(directory: str) -> dict[str, dict[str, dict]]:
    """Every request's events under ``directory``: {request: {event: its first record}}."""
    requests: dict[str, dict[str, dict]] = {}
    for line in _lines(directory):
        if "event" in line:
            requests.setdefault(line["request"], {}).setdefault(line["event"], line)
    return requests


def read_records(directory: str, kind: str) -> list[dict]:
    """Every record of ``kind`` under ``directory``, in each process's order (files by name)."""
    return [line for line in _lines(directory) if line.get("kind") == kind]


def hops(requests: dict[str, dict[str, dict]]) -> dict[str, list[float]]:
    """Seconds between consecutive events (in `EVENTS` order, skipping the ones a request lacks),
    per hop name "a -> b", over every request that has both ends."""
    out: dict[str, list[float]] = {}
    for events in requests.values():
        seen = [name for name in EVENTS if name in events]
        for a, b in zip(seen, seen[1:]):
            out.setdefault(f"{a} -> {b}", []).append(events[b]["t"] - events[a]["t"])
    return out
