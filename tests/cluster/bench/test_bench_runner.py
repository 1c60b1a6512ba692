"""The runner's timing logic against scripted backends (unit tests, not the end-to-end test).

A scripted backend advances a fake clock before each chunk, so TTFT, ITL, E2EL and the client
overhead (receive time minus the emit times the chunk carries) come out exactly; failures,
timeouts, ordering and the concurrency cap are checked with real asyncio scheduling. The
ClusterBackend and HttpBackend adapters are driven by a fake cluster stream and an httpx mock.
"""

from __future__ import annotations

import asyncio
import json
import math
import types

import httpx
import pytest

from disagg.cluster.bench import runner
from disagg.cluster.bench.backends import ClusterBackend, HttpBackend, parse_sse_line
from disagg.cluster.bench.runner import Chunk, run
from disagg.cluster.bench.workloads import SampleRequest


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return 5000.0 + self.now


class ScriptedBackend:
    """Per request id: a list of (seconds before the chunk, tokens, error)."""

    name = "scripted"

    def __init__(self, scripts, clock: FakeClock | None = None, emit_lag: float = 0.0) -> None:
        self.scripts, self.clock, self.emit_lag = scripts, clock, emit_lag
        self.in_flight = self.max_in_flight = 0
        self.opened = self.closed = 0

    async def open(self):
        self.opened += 1

    async def aclose(self):
        self.closed += 1

    async def stream(self, request):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for gap, tokens, error in self.scripts[request.request_id]:
                if self.clock is not None:
                    self.clock.now += gap
                    await asyncio.sleep(0)
                else:
                    await asyncio.sleep(gap)
                emitted = [self.clock.time() - self.emit_lag] * tokens if self.clock else []
                yield Chunk(tokens, emitted, error)
        finally:
            self.in_flight -= 1


def _req(rid: str, n_out: int = 4, n_in: int = 3) -> SampleRequest:
    return SampleRequest(rid, list(range(n_in)), n_out)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=fake.perf_counter, time=fake.time))
    return fake


def test_exact_timing_of_one_request(clock):
    backend = ScriptedBackend({"a": [(0.1, 1, None), (0.02, 1, None), (0.03, 2, None)]}, clock, emit_lag=0.001)
    result = run(backend, [_req("a")], request_rate=math.inf, max_concurrency=1)
    (out,) = result.outputs
    assert out.success and out.error == ""
    assert out.ttft == pytest.approx(0.1)
    assert out.itl == pytest.approx([0.02, 0.03])        # one gap per chunk, as vLLM records them
    assert out.latency == pytest.approx(0.15)
    assert out.output_len == 4 and out.prompt_len == 3
    assert out.tpot == pytest.approx(0.05 / 3)
    assert out.client_overheads == pytest.approx([0.001] * 4)
    assert result.duration_s == pytest.approx(0.15)
    assert backend.opened == backend.closed == 1


def test_failures_are_records_not_crashes(clock):
    scripts = {"ok": [(0.1, 1, None), (0.1, 1, None)],
               "err": [(0.1, 1, None), (0.1, 0, "decode worker died")],
               "empty": []}
    result = run(ScriptedBackend(scripts, clock), [_req("ok"), _req("err"), _req("empty")],
                 request_rate=math.inf, max_concurrency=1)
    ok, err, empty = result.outputs
    assert ok.success and ok.output_len == 2
    assert not err.success and err.output_len == 0 and "decode worker died" in err.error
    assert not empty.success and "without a token" in empty.error


def test_server_token_count_wins(clock):
    backend = ScriptedBackend({"a": [(0.1, 1, None), (0.1, 1, None)]}, clock)
    original = backend.stream

    async def with_usage(request):
        async for chunk in original(request):
            yield chunk
        yield Chunk(0, total_tokens=7)

    backend.stream = with_usage
    (out,) = run(backend, [_req("a")], request_rate=math.inf).outputs
    assert out.output_len == 7 and out.itl == pytest.approx([0.1])


def test_timeout_cancels_and_counts_as_failed():
    backend = ScriptedBackend({"slow": [(5.0, 1, None)], "fast": [(0.0, 1, None)]})
    result = run(backend, [_req("slow"), _req("fast")], request_rate=math.inf, request_timeout_s=0.05)
    slow, fast = result.outputs
    assert not slow.success and "TimeoutError" in slow.error
    assert fast.success
    assert backend.in_flight == 0                         # the slow stream was closed


def test_concurrency_cap_order_and_warmups():
    scripts = {f"r{i}": [(0.01, 1, None), (0.01, 1, None)] for i in range(6)}
    backend = ScriptedBackend(scripts)
    done = []
    result = run(backend, [_req(f"r{i}") for i in range(6)], request_rate=math.inf, max_concurrency=2,
                 num_warmups=2, on_done=done.append)
    assert backend.max_in_flight == 2
    assert len(result.outputs) == 6 and len(done) == 6 and len(result.warmup_outputs) == 2
    assert [o.start_time for o in result.outputs] == sorted(o.start_time for o in result.outputs)


def test_bad_runner_arguments():
    with pytest.raises(ValueError, match="empty workload"):
        run(ScriptedBackend({}), [], request_rate=1.0)
    with pytest.raises(ValueError, match="--max-concurrency"):
        run(ScriptedBackend({}), [_req("a")], request_rate=1.0, max_concurrency=0)


class FakeCluster:
    """Records what the adapter asks for and streams StreamDelta-shaped objects."""

    def __init__(self, error_at: int | None = None) -> None:
        self.calls = []
        self.error_at = error_at

    async def stream(self, prompt, params, request_id=None):
        self.calls.append((prompt, params, request_id))
        for i in range(params.max_tokens):
            last = i == params.max_tokens - 1
            error = "boom" if i == self.error_at else None
            yield types.SimpleNamespace(request_id=request_id, token_ids=[i], emit_times=[1.0 + i],
                                        finished=last or error is not None, finish_reason="length" if last else None,
                                        error=error)
            if error:
                return


def test_cluster_backend_adapter():
    cluster = FakeCluster()
    backend = ClusterBackend(cluster)
    result = run(backend, [_req("a", n_out=3), _req("b", n_out=1)], request_rate=math.inf)
    assert [o.output_len for o in result.outputs] == [3, 1]
    (prompt, params, rid), _ = cluster.calls
    assert prompt == [0, 1, 2] and params.max_tokens == 3 and params.ignore_eos and params.temperature == 0.0
    assert len({call[2] for call in cluster.calls}) == 2
    assert all(lag > 0 for lag in result.outputs[0].client_overheads)
    failing = run(ClusterBackend(FakeCluster(error_at=1)), [_req("c", n_out=3)], request_rate=math.inf)
    assert not failing.outputs[0].success and "boom" in failing.outputs[0].error


def _sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def test_http_backend_streams_completions():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        seen.append(json.loads(request.content))
        body = _sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                    {"choices": [{"text": "", "finish_reason": "length"}]},
                    {"choices": [], "usage": {"completion_tokens": 2}}, "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    backend = HttpBackend("http://bench.test", transport=httpx.MockTransport(handler))
    (out,) = run(backend, [_req("a", n_out=2)], request_rate=math.inf).outputs
    assert out.success and out.output_len == 2 and len(out.itl) == 1
    body = seen[0]
    assert body["model"] == "tiny" and body["prompt"] == [0, 1, 2] and body["max_tokens"] == 2
    assert body["stream"] and body["ignore_eos"]


def test_http_backend_error_status():
    transport = httpx.MockTransport(lambda request: httpx.Response(503, text="overloaded"))
    backend = HttpBackend("http://bench.test", model="m", transport=transport)
    (out,) = run(backend, [_req("a")], request_rate=math.inf).outputs
    assert not out.success and "HTTP 503" in out.error and "overloaded" in out.error
    with pytest.raises(ValueError, match="--base-url"):
        HttpBackend("localhost:8000")


def test_parse_sse_line():
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("data: [DONE]") is None
    chunk = parse_sse_line('data: {"choices": [{"text": "x", "token_ids": [1, 2], "emit_times": [3.0, 4.0]}]}')
    assert chunk.num_tokens == 2 and list(chunk.emit_times) == [3.0, 4.0]
    assert parse_sse_line('data: {"error": "bad"}').error == "bad"


def test_cluster_stream_closed_on_timeout():
    closed = []

    class SlowCluster:
        async def stream(self, prompt, params, request_id=None):
            try:
                yield types.SimpleNamespace(token_ids=[1], emit_times=[1.0], finished=False, error=None)
                await asyncio.sleep(10)
            finally:
                closed.append(request_id)        # the real cluster aborts the request here

    result = run(ClusterBackend(SlowCluster()), [_req("a")], request_rate=math.inf, request_timeout_s=0.05)
    assert not result.outputs[0].success and "TimeoutError" in result.outputs[0].error
    assert len(closed) == 1


def test_warm_up_sends_workload_requests_together():
    scripts = {f"r{i}": [(0.01, 1, None)] for i in range(3)}
    backend = ScriptedBackend(scripts)
    outs = runner.warm_up(backend, [_req(f"r{i}") for i in range(3)], 5)
    assert len(outs) == 5 and all(o.success for o in outs)
    assert backend.max_in_flight == 5 and backend.opened == backend.closed == 1
    assert runner.warm_up(backend, [_req("r0")], 0) == []


def test_http_backend_resets_the_prefix_cache_or_warns_once(caplog):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path, request.headers.get("authorization")))
        return httpx.Response(200 if "ok" in request.url.host else 404, json={})

    assert asyncio.run(HttpBackend("http://ok.test", api_key="k", transport=httpx.MockTransport(handler)).reset_prefix_cache())
    assert calls == [("POST", "/reset_prefix_cache", "Bearer k")]
    backend = HttpBackend("http://other.test", transport=httpx.MockTransport(handler))
    with caplog.at_level("WARNING"):
        assert not asyncio.run(backend.reset_prefix_cache()) and not asyncio.run(backend.reset_prefix_cache())
    assert [r.getMessage().count("answered HTTP 404") for r in caplog.records] == [1]


def test_cluster_backend_request_ids_name_the_run_the_deployment_and_the_process():
    import os

    from disagg.cluster.bench.backends import ClusterBackend

    one, two = ClusterBackend(None, name="colocated-8192[x=1]"), ClusterBackend(None, name="colocated-8192[x=1]")
    run, label, pid = one._prefix.split(".")
    assert run.startswith("bench") and label == "colocated_8192_x_1" and pid == str(os.getpid())
    assert "-" not in one._prefix and one._prefix != two._prefix
    before = one._prefix
    asyncio.run(one.open())
    assert one._prefix != before
