"""Event traces (`disagg.trace`, `DISAGG_TRACE_DIR`): off by default; when on, the router, the
actor and the engine of a real (tiny, CPU) fleet write every event of a request in order, a step
loop writes a record per step and per call, and `benchmarks/trace_report.py` turns them into hops
and per-instance step and call summaries."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import environment, launch, launcher_environment

from disagg import trace
from disagg.cluster.launch.step_loop import StepLoop
from disagg.sampling import SamplingParams



def test_hops_follow_the_event_order_and_skip_missing_events(benchmark_script):
    requests = {"a": {name: {"t": float(i)} for i, name in enumerate(trace.EVENTS)},
                "b": {"submit": {"t": 10.0}, "placed": {"t": 10.5}, "first_token": {"t": 12.0}}}
    hops = trace.hops(requests)
    assert hops["submit -> reserved"] == [1.0] and hops["first_token -> client_first"] == [1.0]
    assert hops["submit -> placed"] == [0.5] and hops["placed -> first_token"] == [1.5]
    summary = benchmark_script("trace_report").summarize(requests)
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
    steps = trace.read_records(directory, "step")  # the actor's step loop (and launch's warm-up request)
    assert {s["instance"] for s in steps} == {"colocated-0"}
    assert {c.request_id for c in done} <= set().union(*(s["prompts"] for s in steps))
    adds = [c for c in trace.read_records(directory, "call") if c["name"] == "add"]
    assert len(adds) >= 2 and all(c["t_queued"] <= c["t_ran"] <= c["t_done"] for c in adds)
    assert len(list(Path(directory).glob("trace-*.jsonl"))) == 2  # the router's process and the actor's


def test_an_adaptive_fleet_traces_each_requests_decision_and_tpot(ray_local, tmp_path):
    """Serving: each adaptively placed request's "decision" record at its first token and its
    "tpot" record at its end (the router's `Placer.finished`), the TPOT had within the request's
    own span; none for a request of one token."""
    directory = str(tmp_path / "trace")
    with launcher_environment(DISAGG_TRACE_DIR=directory):
        cluster = launch("tiny-1p1d", router__placement="adaptive", router__slo_tpot_ms=1000)
        try:
            done = cluster.generate([[5, 6, 7, 8, 9], [11, 12], [13]],
                                    [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 3, 1)])
            models = cluster.router_stats()["placement"]["models"]
        finally:
            cluster.shutdown()
    assert [c.finish_reason for c in done] == ["length"] * 3
    # the router timed the first tokens' way back from the instances that computed them (`Placer.first_token`)
    assert any(m["relay_ms"] > 0 for m in models.values()), models
    decisions = {d["request"]: d for d in trace.read_records(directory, "decision")}
    tpots = {t["request"]: t for t in trace.read_records(directory, "tpot")}
    assert {c.request_id for c in done} <= set(decisions)
    # (launch's warm-up requests have theirs too) the 1-token request has no TPOT
    assert {done[0].request_id, done[1].request_id} <= set(tpots) and done[2].request_id not in tpots
    requests = trace.read(directory)
    for completion, n in zip(done[:2], (4, 3)):
        record = tpots[completion.request_id]
        assert record["path"] == decisions[completion.request_id]["path"] and record["num_output"] == n
        first = requests[completion.request_id]["first_token"]["t"]
        assert 0 < record["tpot_ms"] * (n - 1) <= (time.time() - first) * 1e3 and record["predicted_tpot_ms"] > 0


def test_forwards_timed_on_the_gpu_are_traced_on_the_gpus_timeline(tmp_path, monkeypatch):
    """Async chunks read together (one call saw three forwards end) are placed end to end by their
    GPU spans and the GPU's idle time between them, the last ending at the reading: no overlap, no
    busy time above the wall. The engine's report is given directly here (`ForwardTimer` measures
    it on a GPU: tests/engine/test_engine_gpu.py)."""
    import types

    from disagg.engine.steps import StepShape, TimedForward

    monkeypatch.setenv(trace.ENV, str(tmp_path))
    chunk = StepShape(8192, 0, 0, 8192 * 8193 // 2)
    loop = StepLoop("prefill-0")
    try:
        # no work: the loop's thread never steps it; this test records on its behalf
        engine = types.SimpleNamespace(has_work=lambda: False,
                                       last_step_forwards=[TimedForward(chunk, ("a",), 0.2),
                                                           TimedForward(chunk, ("a",), 0.3, 0.0),
                                                           TimedForward(chunk, ("a",), 0.4, 0.01)])
        loop.engine = engine
        before = time.time()
        loop._record(0.0, True)
        engine.last_step_forwards = [TimedForward(StepShape(0, 1, 8193, 0), (), 0.005, 0.002)]
        time.sleep(0.02)  # read after it ended on the GPU (2 + 5 ms after the chunks)
        loop._record(0.0, True)
        samples = loop.drain()[1]
    finally:
        loop.stop()
    assert loop.fatal is None
    # the decode forward's decodes waited 2 ms on the host (the chunks had none waiting)
    assert [s.gap_s for s in samples] == [0.0, 0.0, 0.0, 0.002]
    steps = trace.read_records(str(tmp_path), "step")
    assert [round(s["t_end"] - s["t_start"], 6) for s in steps] == [0.2, 0.3, 0.4, 0.005]
    gaps = [b["t_start"] - a["t_end"] for a, b in zip(steps, steps[1:])]
    assert gaps == pytest.approx([0.0, 0.01, 0.002], abs=1e-6)
    assert before <= steps[2]["t_end"] <= steps[3]["t_start"] <= time.time()
    assert [s.get("gpu_idle_before_s") for s in steps] == [None, 0.0, 0.01, 0.002]


def test_a_forward_without_outputs_counts_as_busy_and_a_step_without_a_forward_does_not():
    """A prompt's chunk before its last yields no token but ran a forward: the instance was busy
    (counted only with outputs, a colocated fleet at chunk 512 read 8-34% busy against 29-69%)."""
    import types

    from disagg.engine.steps import StepShape

    loop = StepLoop("colocated-0")
    try:  # no work: the loop's thread never steps it; the test steps it
        engine = types.SimpleNamespace(has_work=lambda: False, step=lambda: (time.sleep(0.01), [])[1],
                                       last_step_shape=StepShape(512, 0, 0, 512 * 513 // 2), last_step_prompts=())
        loop.engine = engine
        loop._step(False)
        chunk_busy = loop.busy_s
        engine.last_step_shape = None  # nothing to run (a decode instance awaiting a push)
        loop._step(False)
    finally:
        loop.stop()
    assert loop.fatal is None and loop.num_steps == 2
    assert chunk_busy >= 0.01 and loop.busy_s == chunk_busy


def _run_to_end(loop: StepLoop, requests: dict[str, list[int]], params: SamplingParams) -> None:
    """Add ``requests`` through the loop's calls and wait until every one finished."""
    for request_id, prompt in requests.items():
        loop.call(loop.engine.add, request_id, prompt, params).result(5)
    finished: set = set()
    deadline = time.monotonic() + 60
    while finished != set(requests):
        assert time.monotonic() < deadline and loop.fatal is None, (finished, loop.fatal)
        finished |= {row[0] for row in loop.drain()[0] if row[2]}
        time.sleep(0.01)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_loop_records_every_step_and_call_of_a_real_engine(tmp_path, monkeypatch, async_scheduling):
    """A colocated engine on its step loop: the steps' prompt tokens are the prompts' minus their
    cached prefixes, their decoding sequences every token after the first, each prompt is named
    by the steps that computed it, and every call was queued before it ran."""
    import torch

    from disagg.engine import ColocatedEngine, EngineOptions
    from disagg.model import load_model

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references
    monkeypatch.setenv(trace.ENV, str(tmp_path))
    engine = ColocatedEngine(load_model("dummy:tiny", dtype=torch.float32, device="cpu"), num_pages=64,
                             page_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                             options=EngineOptions(async_scheduling=async_scheduling))
    prompts = {"a": [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21], "b": [5, 9, 17, 3, 88, 41, 7, 200, 1, 2],
               "c": [42, 43, 44]}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    loop = StepLoop("colocated-0")
    loop.call(setattr, loop, "engine", engine).result(5)
    try:
        _run_to_end(loop, {"a": prompts["a"]}, params)
        _run_to_end(loop, {"b": prompts["b"], "c": prompts["c"]}, params)  # b forks from a's prefix
    finally:
        loop.stop()
    cached = {r: e["prompt_start"]["cached"] for r, e in trace.read(str(tmp_path)).items()}
    assert cached["b"] > 0 and cached["a"] == cached["c"] == 0
    steps = trace.read_records(str(tmp_path), "step")
    assert len(steps) == loop.num_steps and all(s["instance"] == "colocated-0" for s in steps)
    assert all(s["t_start"] < s["t_end"] for s in steps)  # each ran a forward
    assert all(a["t_end"] <= b["t_start"] for a, b in zip(steps, steps[1:]))  # one thread: no overlap
    assert sum(s["num_prefill_tokens"] for s in steps) == sum(len(p) - cached[r] for r, p in prompts.items())
    assert sum(s["num_decode_seqs"] for s in steps) == len(prompts) * (params.max_tokens - 1)
    assert all(s["num_context_tokens"] >= s["num_decode_seqs"] for s in steps)
    assert all(s["num_prompts"] == len(s["prompts"]) and bool(s["prompts"]) == bool(s["num_prefill_tokens"])
               for s in steps)
    assert sum("a" in s["prompts"] for s in steps) == 2  # 11 tokens under an 8-token budget: two chunks
    assert set().union(*(s["prompts"] for s in steps)) == set(prompts)
    calls = trace.read_records(str(tmp_path), "call")
    assert [c["name"] for c in calls] == ["setattr", "add", "add", "add"]
    assert all(c["instance"] == "colocated-0" and c["t_queued"] <= c["t_ran"] <= c["t_done"] for c in calls)


def test_the_report_summarizes_each_instances_steps_and_calls(tmp_path, monkeypatch, capsys, benchmark_script):
    """Step and call records written by `trace.record` (beside a request's event, which alone
    makes the per-request view): per instance, the report's steps, busy fraction, gaps, prompt
    tokens and call waits, printed and in ``--json``."""
    with environment(DISAGG_TRACE_DIR=str(tmp_path)):
        trace.event("submit", "r0")
        for t_start, t_end, tokens in [(100.0, 100.010, 100), (100.030, 100.050, 0), (100.050, 100.060, 300)]:
            trace.record("step", instance="prefill-0", t_start=t_start, t_end=t_end, num_prefill_tokens=tokens,
                         num_decode_seqs=0, num_context_tokens=0, num_prompts=1 if tokens else 0)
        for instance, name, wait_s in [("prefill-0", "add", 0.005), ("prefill-0", "add", 0.015),
                                       ("decode-0", "reserve", 0.001)]:
            trace.record("call", instance=instance, name=name, t_queued=200.0, t_ran=200.0 + wait_s,
                         t_done=200.5)
    assert list(trace.read(str(tmp_path))) == ["r0"]
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["trace_report.py", str(tmp_path), "--json", str(out)])
    benchmark_script("trace_report").main()
    report = json.loads(out.read_text())
    assert set(report) == {"unplaced", "instances", "decisions"} and report["decisions"] == {}
    prefill, decode = report["instances"]["prefill-0"], report["instances"]["decode-0"]
    assert prefill["steps"] == 3 and prefill["busy"] == pytest.approx(0.040 / 0.060)
    assert prefill["step_ms"] == pytest.approx({"n": 3, "p50_ms": 10.0, "p90_ms": 10.0, "mean_ms": 40 / 3})
    assert prefill["gap_ms"] == pytest.approx({"n": 2, "p50_ms": 10.0, "p90_ms": 0.0, "mean_ms": 10.0})
    assert prefill["prompt_tokens"] == {"n": 2, "p50": 200, "p90": 100, "mean": 200}
    assert prefill["call_wait_ms"] == {"add": pytest.approx({"n": 2, "p50_ms": 10.0, "p90_ms": 5.0, "mean_ms": 10.0})}
    assert decode["steps"] == 0 and decode["busy"] == 0.0
    assert decode["call_wait_ms"]["reserve"]["p50_ms"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "prefill-0: 3 steps" in printed and "call add waited" in printed and "decode-0: 0 steps" in printed


def test_the_report_splits_each_instances_steps_by_the_path_of_their_prompts(benchmark_script):
    """A step carrying a pushed prompt is told apart from steps of kept or local prompts and from
    steps without one (two H200s: a pushing step ran eagerly, 28.6 ms against 10.0 graphed)."""
    def step(t, ms, tokens, decodes, prompts):
        return {"instance": "prefill-0", "t_start": t, "t_end": t + ms / 1e3, "num_prefill_tokens": tokens,
                "num_decode_seqs": decodes, "num_context_tokens": 0, "prompts": prompts}

    steps = [step(0.0, 28.0, 150, 80, ["a", "b"]), step(0.1, 10.0, 140, 70, ["b"]),
             step(0.2, 6.0, 0, 60, []), step(0.3, 12.0, 100, 50, ["c"]), step(0.4, 30.0, 210, 90, ["a"])]
    module = benchmark_script("trace_report")
    got = module.summarize_instances(steps, [], {"a": "remote", "b": "kept"})["prefill-0"]["by_prompts"]
    assert set(got) == {"remote", "kept", "none", "unplaced"}
    assert got["remote"]["n"] == 2 and got["remote"]["step_ms"]["mean_ms"] == pytest.approx(29.0)
    assert got["remote"]["prompt_tokens"] == 180 and got["remote"]["decodes"] == 85
    assert got["kept"]["step_ms"]["p50_ms"] == pytest.approx(10.0) and got["none"]["n"] == 1
    assert got["unplaced"]["prompt_tokens"] == 100


def test_the_report_splits_a_sweep_by_bench_run(tmp_path, capsys, monkeypatch, benchmark_script):
    """``--by-run``: each `disagg bench` run's requests (``benchN-...``) and the steps and calls
    inside their span, apart from the other runs' (a sweep's rates in one trace)."""
    with environment(DISAGG_TRACE_DIR=str(tmp_path)):
        trace.event("submit", "bench2-chat-0-0")
        trace.event("placed", "bench2-chat-0-0", path="remote")
        trace.record("step", instance="prefill-0", t_start=time.time(), t_end=time.time() + 1e-3,
                     num_prefill_tokens=10, num_decode_seqs=0, num_context_tokens=0, num_prompts=1)
        trace.event("first_token", "bench2-chat-0-0")
        time.sleep(0.01)
        for i in range(2):
            trace.event("submit", f"bench3-chat-{i}-{i}")
            trace.event("placed", f"bench3-chat-{i}-{i}", path="local")
            for _ in range(2):
                trace.record("step", instance="decode-0", t_start=time.time(), t_end=time.time() + 1e-3,
                             num_prefill_tokens=4, num_decode_seqs=1, num_context_tokens=9, num_prompts=1)
            trace.event("first_token", f"bench3-chat-{i}-{i}")
    module = benchmark_script("trace_report")
    runs = module.by_run(trace.read(str(tmp_path)))
    assert {run: sorted(group) for run, group in runs.items()} == {
        "bench2": ["bench2-chat-0-0"], "bench3": ["bench3-chat-0-0", "bench3-chat-1-1"]}
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["trace_report", str(tmp_path), "--by-run", "--json", str(out)])
    module.main()
    report = json.loads(out.read_text())
    assert set(report) == {"bench2", "bench3"}
    assert {name: row["steps"] for name, row in report["bench2"]["instances"].items()} == {"prefill-0": 1}
    assert {name: row["steps"] for name, row in report["bench3"]["instances"].items()} == {"decode-0": 4}
    assert report["bench3"]["local"]["submit -> placed"]["n"] == 2 and "remote" in report["bench2"]
    assert "== bench3: 2 requests" in capsys.readouterr().out


def test_the_report_sets_each_paths_predicted_ttft_beside_the_actual(tmp_path, monkeypatch, benchmark_script):
    """Decision records: per path taken, the chosen prediction's TTFT against the TTFT since the
    decision (and only a run's own requests' decisions with --by-run)."""
    def decision(request, path, predicted, actual):
        preds = [{"path": p, "prefill": None, "decode": "decode-0", "ttft_ms": predicted if p == path else 999.0,
                  "tpot_ms": 10.0, "admissible": True} for p in ("remote", "local", "kept")]
        trace.record("decision", request=request, t=time.time(), prompt_len=8, chosen=path, path=path,
                     ttft_ms=actual, predictions=preds)

    with environment(DISAGG_TRACE_DIR=str(tmp_path)):
        trace.event("submit", "bench1-chat-0-0")
        decision("bench1-chat-0-0", "remote", 20.0, 30.0)
        decision("bench1-chat-1-1", "remote", 10.0, 20.0)
        decision("bench1-chat-2-2", "local", 40.0, 20.0)
        trace.event("first_token", "bench1-chat-2-2")
        decision("bench9-chat-0-0", "local", 40.0, 80.0)  # another run's
        for request, path, predicted, had in (("bench1-chat-0-0", "remote", 10.0, 12.0), ("bench1-chat-2-2", "local", 20.0, 10.0),
                                               ("bench9-chat-0-0", "local", 20.0, 90.0)):
            trace.record("tpot", t=time.time(), request=request, path=path, num_output=5,
                         predicted_tpot_ms=predicted, tpot_ms=had)
    module = benchmark_script("trace_report")
    summary = module.summarize_decisions(trace.read_records(str(tmp_path), "decision")[:3],
                                         trace.read_records(str(tmp_path), "tpot")[:2])
    assert summary["remote"]["n"] == 2 and summary["remote"]["ratio"]["p50"] == pytest.approx(1.75)
    assert summary["local"]["predicted_ms"]["p50_ms"] == 40.0 and summary["local"]["ratio"]["p50"] == 0.5
    assert summary["remote"]["tpot"]["n"] == 1 and summary["remote"]["tpot"]["ratio"]["p50"] == pytest.approx(1.2)
    assert summary["local"]["tpot"]["actual_ms"]["p50_ms"] == 10.0 and summary["local"]["tpot"]["ratio"]["p50"] == 0.5
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["trace_report", str(tmp_path), "--by-run", "--json", str(out)])
    module.main()
    report = json.loads(out.read_text())
    assert report["bench1"]["decisions"]["local"]["n"] == 1 and report["bench1"]["decisions"]["remote"]["n"] == 1
    assert report["bench1"]["decisions"]["local"]["tpot"]["n"] == 1  # not bench9's
    assert report["bench1"]["decisions"]["local"]["tpot"]["ratio"]["p50"] == 0.5


def test_the_report_windows_the_decisions_over_time(tmp_path, monkeypatch, capsys, benchmark_script):
    """--window S: per S seconds since the first decision, the paths taken, the decisions with no
    admissible path and the chosen path's predicted TTFT / TPOT beside what its requests had."""
    def decision(request, t, path, admissible, predicted, actual):
        preds = [{"path": p, "prefill": None, "decode": "decode-0", "ttft_ms": predicted if p == path else 99.0,
                  "tpot_ms": 10.0, "admissible": admissible} for p in ("remote", "local", "kept")]
        trace.record("decision", request=request, t=t, prompt_len=8, chosen=path, path=path, ttft_ms=actual,
                     predictions=preds)

    t0 = 1000.0
    with environment(DISAGG_TRACE_DIR=str(tmp_path)):
        decision("bench1-chat-0-0", t0, "local", True, 10.0, 20.0)
        decision("bench1-chat-1-1", t0 + 1.0, "local", True, 30.0, 40.0)
        decision("bench1-chat-2-2", t0 + 4.9, "remote", False, 50.0, 80.0)
        decision("bench1-chat-3-3", t0 + 12.0, "kept", True, 5.0, 6.0)
        trace.record("tpot", t=t0 + 20, request="bench1-chat-3-3", path="kept", num_output=9,
                     predicted_tpot_ms=8.0, tpot_ms=12.0)
    module = benchmark_script("trace_report")
    windows = module.summarize_windows(trace.read_records(str(tmp_path), "decision"),
                                       trace.read_records(str(tmp_path), "tpot"), 5.0)
    assert [w["start_s"] for w in windows] == [0.0, 10.0]  # the empty 5-10 s left out
    first, last = windows
    assert first["n"] == 3 and first["no_admissible"] == 1 and first["paths"] == {"local": 2, "remote": 1}
    assert first["ttft_ms"] == {"predicted": 30.0, "actual": 40.0} and first["tpot_ms"]["actual"] is None
    assert last["paths"] == {"kept": 1} and last["tpot_ms"] == {"predicted": 8.0, "actual": 12.0}
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["trace_report", str(tmp_path), "--window", "5", "--json", str(out)])
    module.main()
    assert json.loads(out.read_text())["windows"] == windows
    assert "decisions per 5 s" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["trace_report", str(tmp_path), "--window", "0"])
    with pytest.raises(SystemExit):
        module.main()
    assert "--window: expected seconds > 0, got 0" in capsys.readouterr().err
