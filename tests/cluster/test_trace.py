"""Per-request event traces (`disagg.trace`, `DISAGG_TRACE_DIR`): off by default; when on, the
router, the actor and the engine of a real (tiny, CPU) fleet write every event of a request in
order, and `benchmarks/trace_report.py` turns them into hops."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cluster_helpers import environment, launch, launcher_environment

from disagg import trace
from disagg.sampling import SamplingParams

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "trace_report.py"


def _report_module():
    spec = importlib.util.spec_from_file_location("trace_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hops_follow_the_event_order_and_skip_missing_events():
    requests = {"a": {name: {"t": float(i)} for i, name in enumerate(trace.EVENTS)},
                "b": {"submit": {"t": 10.0}, "placed": {"t": 10.5}, "first_token": {"t": 12.0}}}
    hops = trace.hops(requests)
    assert hops["submit -> reserved"] == [1.0] and hops["first_token -> client_first"] == [1.0]
    assert hops["submit -> placed"] == [0.5] and hops["placed -> first_token"] == [1.5]
    summary = _report_module().summarize(requests)
    assert list(summary)[0] == "client_send -> submit" and summary["submit -> placed"]["n"] == 1


def test_off_unless_the_directory_is_set(tmp_path):
    with environment(DISAGG_TRACE_DIR=""):
        assert not trace.enabled()
        trace.event("submit", "off")
    with environment(DISAGG_TRACE_DIR=str(tmp_path)):
        assert trace.enabled()
        trace.event("submit", "on", extra=1)
    assert trace.read(str(tmp_path)) == {"on": {"submit": {"event": "submit", "request": "on",
                                                           "t": trace.read(str(tmp_path))["on"]["submit"]["t"],
                                                           "extra": 1}}}


def test_a_colocated_fleet_traces_every_hop_of_a_request(ray_local, tmp_path):
    directory = str(tmp_path / "trace")
    with launcher_environment(DISAGG_TRACE_DIR=directory):
        cluster = launch("tiny-colocated", instances__colocated=1)
        try:
            done = cluster.generate([[5, 6, 7, 8, 9], [11, 12]], SamplingParams(max_tokens=3, ignore_eos=True))
        finally:
            cluster.shutdown()
    assert all(c.finish_reason == "length" for c in done)
    requests = trace.read(directory)
    for completion in done:
        events = requests[completion.request_id]
        wanted = ["submit", "placed", "actor_add", "engine_add", "prompt_start", "first_emit", "first_token"]
        assert [name for name in trace.EVENTS if name in events] == wanted
        times = [events[name]["t"] for name in wanted]
        assert times == sorted(times)
        assert events["placed"]["path"] == "colocated" and events["prompt_start"]["cached"] == 0
    assert len(list(Path(directory).glob("trace-*.jsonl"))) == 2  # the router's process and the actor's
