"""The HTTP layer over a `FakeCluster` (see fake_cluster.py): routes, SSE, errors, guards, aborts,
metrics. Real OpenAI client and raw httpx against uvicorn on 127.0.0.1. The same surface on the
real cluster is tested in test_serve_cluster.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from fake_cluster import CharTokenizer, FakeCluster
from prometheus_client.parser import text_string_to_metric_families

from disagg.cluster import Cluster
from disagg.cluster.serve import BackgroundServer, build_app
from disagg.cluster.serve.command import serve_config
from disagg.config import Config
from disagg.errors import (ClusterError, InstanceDied, NoLiveInstance, QueueFull, RequestRefused, RequestTimedOut,
                           SignalTimeout)

pytestmark = pytest.mark.timeout(60)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-1p1d.yaml"


def _client(server, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=20)


def _sse(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final '[DONE]'."""
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def _wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_completion_text_and_token_ids(serve_fake):
    server, _ = serve_fake()
    out = _client(server).completions.create(model="fake", prompt="hello", max_tokens=7, temperature=0,
                                             extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == "hellohe" and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == [ord(c) for c in "hellohe"]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 7


def test_stream_sends_chunks_usage_and_done(serve_fake):
    server, _ = serve_fake()
    body = {"prompt": [104, 105], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=20)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _sse(response)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hih"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["usage"] is None and c["id"] == usage["id"] for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_stop_string_truncates_and_aborts(serve_fake):
    server, fake = serve_fake()
    client = _client(server)
    out = client.completions.create(model="fake", prompt="abcdef", max_tokens=30, stop=["cd", "zz"])
    assert out.choices[0].text == "ab" and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == "cd"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="fake", prompt="abcdef", max_tokens=30, stop="def", stream=True)]
    assert "".join(pieces) == "abc"
    assert _wait_until(lambda: not fake.active)


def test_stop_token_id_ends_without_its_text(serve_fake):
    server, _ = serve_fake()
    out = _client(server).completions.create(model="fake", prompt="abc", max_tokens=10, stop=[ord("c")],
                                             extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == "ab" and choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == ord("c")
    assert choice.model_extra["token_ids"] == [ord("a"), ord("b"), ord("c")]


def test_sampling_fields_reach_the_cluster(serve_fake):
    server, fake = serve_fake()
    _client(server).completions.create(model="fake", prompt=[70, 71], max_tokens=5, temperature=0.7, top_p=0.9,
                                       seed=11, stop=[99, 98], extra_body={"top_k": 4, "ignore_eos": True})
    params = fake.params_of[fake.started[-1]]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (5, 0.7, 0.9, 4, 11)
    assert set(params.stop_token_ids) == {99, 98} and params.ignore_eos
    _client(server).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                            max_completion_tokens=3, temperature=0, seed=2)
    params = fake.params_of[fake.started[-1]]
    assert (params.max_tokens, params.temperature, params.seed, params.top_p) == (3, 0.0, 2, 1.0)


def test_chat_stream_and_not(serve_fake):
    server, _ = serve_fake()
    client = _client(server)
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="fake", messages=messages, max_tokens=6)
    assert out.choices[0].message.content == "<user>" and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="fake", messages=messages, max_tokens=6, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == "<user>"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_tokenizer_or_template_is_400(serve_fake):
    for tokenizer in (None, CharTokenizer(chat_template=False)):
        server, _ = serve_fake(FakeCluster(tokenizer=tokenizer))
        with pytest.raises(openai.BadRequestError) as info:
            _client(server).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
        assert info.value.body["code"] == "no_chat_template" and info.value.body["param"] == "messages"


def test_text_prompt_and_stop_strings_need_a_tokenizer(serve_fake):
    server, _ = serve_fake(FakeCluster(tokenizer=None))
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.completions.create(model="fake", prompt="text", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stop"):
        client.completions.create(model="fake", prompt=[1, 2], max_tokens=2, stop=["x"])
    assert client.completions.create(model="fake", prompt=[1, 2], max_tokens=2).choices[0].text == ""


@pytest.mark.parametrize("content, status, param, words", [
    (b'{"prompt": "x",', 400, None, "not valid JSON"),
    (b'{"prompt": "x", "max_tokenz": 3}', 400, "max_tokenz", "unknown field 'max_tokenz'"),
    (b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens", "valid integer"),
    (b'{"prompt": "x", "n": 3}', 400, "n", "only n=1"),
    (b'{"prompt": [1, 2], "max_tokens": 255}', 400, "max_tokens", "maximum context length is 256"),
    (b'{"prompt": [1, 2], "model": "gpt-4"}', 404, "model", "does not exist"),
    (b'{"prompt": [1, 2], "seed": -1}', 400, "seed", "seed"),
])
def test_bad_requests_get_openai_errors(serve_fake, content, status, param, words):
    server, fake = serve_fake()
    response = httpx.post(server.base_url + "/v1/completions", content=content,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"]
    assert not fake.started  # refused before reaching the cluster


def test_prompt_longer_than_context_is_400(serve_fake):
    server, _ = serve_fake()
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": list(range(1, 300))})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_oversize_body_is_413(serve_fake):
    server, _ = serve_fake(max_body_bytes=1000)
    body = json.dumps({"prompt": list(range(1, 500))}).encode()
    assert httpx.post(server.base_url + "/v1/completions", content=body).status_code == 413

    def chunked():  # no Content-Length: counted as it arrives
        yield body[:600]
        yield body[600:]
    response = httpx.post(server.base_url + "/v1/completions", content=chunked())
    assert response.status_code == 413 and "limit is 1000 bytes" in response.json()["error"]["message"]


def test_api_key_on_every_v1_route(serve_fake, monkeypatch):
    monkeypatch.setenv("DISAGG_API_KEY", "sekret")
    server, _ = serve_fake()
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/reset_prefix_cache"):
        response = httpx.post(server.base_url + path, json={}) if "/v1/models" not in path else httpx.get(server.base_url + path)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    reset = httpx.post(server.base_url + "/reset_prefix_cache", headers={"Authorization": "Bearer sekret"})
    assert reset.status_code == 200 and reset.json() == {"freed_pages": {"prefill0": 0, "decode0": 0}}
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    assert _client(server, "sekret").models.list().data[0].id == "fake"
    assert httpx.get(server.base_url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_full_server_answers_429(serve_fake):
    server, fake = serve_fake(FakeCluster(tokenizer=CharTokenizer(), step_s=0.05), max_concurrent_requests=1)

    async def two():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
            slow = asyncio.create_task(client.completions.create(model="fake", prompt=[1], max_tokens=10))
            await asyncio.sleep(0.2)
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model="fake", prompt=[1], max_tokens=1)
            return await slow
    assert asyncio.run(two()).choices[0].finish_reason == "length"


@pytest.mark.parametrize("exc, status", [
    (QueueFull("the router's queue is full (4096 requests waiting, router.max_queue); retry later"), 429),
    (NoLiveInstance("the cluster is shut down"), 503), (ValueError("prompt too long"), 400),
    (ClusterError("queue is full; no live instance; died; timed out"), 500),  # the type decides, not the text
])
def test_cluster_refusals_map_to_status_by_type(serve_fake, exc, status):
    server, _ = serve_fake(FakeCluster(fail_with=exc))
    assert httpx.post(server.base_url + "/v1/completions", json={"prompt": [1]}).status_code == status
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1], "stream": True})
    assert response.status_code == status


@pytest.mark.parametrize("cause, status, param, code", [
    (InstanceDied("decode-0 died", instance="decode-0", reason="exit"), 503, None, "no_healthy_instance"),
    (NoLiveInstance("no live decode instance", role="decode"), 503, None, "no_healthy_instance"),
    (RequestRefused("prefill-0.add failed: prompt_token_ids: expected ids in [0, 256)", instance="prefill-0",
                    argument="prompt_token_ids"), 400, "prompt", "invalid_request"),
    (RequestTimedOut("timed out after 1 s", timeout_s=1.0, stage="decoding"), 504, None, "timeout"),
    (SignalTimeout("its KV did not land", request_id="r", src_pe=0, dst_pe=1), 500, None, "kv_transfer_failed"),
    (ClusterError("refused the request: prompt_token_ids: died, timed out"), 500, None, "cluster_error"),
    (None, 500, None, "request_error"),
])
def test_in_band_failures_map_to_status_by_type(serve_fake, cause, status, param, code):
    server, _ = serve_fake(FakeCluster(error_after=1, error_cause=cause))  # one token, then the failure
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": [65], "max_tokens": 4})
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (status, param, code)
    events = _sse(httpx.post(server.base_url + "/v1/completions",
                             json={"prompt": [65], "max_tokens": 4, "stream": True}))
    assert events[-1] == "[DONE]" and (events[-2]["error"]["code"], events[-2]["error"]["param"]) == (code, param)


def test_unhealthy_cluster_is_503(serve_fake):
    server, fake = serve_fake(FakeCluster(healthy=False))
    assert httpx.get(server.base_url + "/health").status_code == 503
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1]})
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_healthy_instance"
    fake.healthy = True
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_error_mid_stream_is_sent_in_band(serve_fake):
    server, fake = serve_fake(FakeCluster(error_after=2))
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": [65], "max_tokens": 9, "stream": True})
    events = _sse(response)
    assert events[-1] == "[DONE]" and "died" in events[-2]["error"]["message"] and len(events) == 4
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": [65], "max_tokens": 9})
    assert response.status_code == 503 and "died" in response.json()["error"]["message"]
    assert not fake.active


def test_client_disconnect_mid_stream_closes_the_cluster_stream(serve_fake):
    server, fake = serve_fake(FakeCluster(tokenizer=CharTokenizer(), step_s=0.02))
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={"prompt": [65], "max_tokens": 200, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert len(fake.active) == 1
    assert _wait_until(lambda: not fake.active), "the cluster stream stayed open after the client left"
    assert _wait_until(lambda: server_in_flight(server) == 0)


def test_client_disconnect_before_first_token_closes_the_cluster_stream(serve_fake):
    server, fake = serve_fake(FakeCluster(tokenizer=CharTokenizer(), step_s=0.5))
    for stream in (False, True):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/completions", timeout=0.2,
                       json={"prompt": [65], "max_tokens": 50, "stream": stream})
        assert _wait_until(lambda: len(fake.started) == 1 + stream and not fake.active)


def server_in_flight(server) -> int:
    return server.app.state.server.num_in_flight


def _samples(server) -> dict:
    text = httpx.get(server.base_url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_move(serve_fake):
    server, _ = serve_fake()
    before = _samples(server)
    label = (("model_name", "fake"),)
    assert before[("disagg:generation_tokens_total", label)] == 0
    _client(server).completions.create(model="fake", prompt="abc", max_tokens=5)
    httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "n": 2})
    after = _samples(server)
    assert after[("disagg:generation_tokens_total", label)] == 5
    assert after[("disagg:prompt_tokens_total", label)] == 3
    assert after[("disagg:request_success_total", (("finished_reason", "length"), ("model_name", "fake")))] == 1
    assert after[("disagg:time_to_first_token_seconds_count", label)] == 1
    assert after[("disagg:inter_token_latency_seconds_count", label)] == 4
    assert after[("disagg:e2e_request_latency_seconds_count", label)] == 1
    for phase in ("queue", "prefill", "decode"):  # from the cluster's RequestMetrics on the last delta
        assert after[(f"disagg:request_{phase}_time_seconds_count", label)] == 1
    assert after[("disagg:request_failures_total", (("model_name", "fake"), ("reason", "invalid_request")))] == 1
    assert after[("disagg:kv_pages_total", (("instance", "decode0"), ("role", "decode")))] == 1024
    assert after[("disagg:num_requests_queued", ())] == 0


def test_routes_answer_503_until_a_cluster_is_attached():
    fake = FakeCluster(tokenizer=CharTokenizer())
    app = build_app(None, fake.config)
    with BackgroundServer(app) as server:
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("POST", "/v1/completions")):
            response = httpx.request(method, server.base_url + path, json={"prompt": [1]})
            assert response.status_code == 503 and response.json()["error"]["code"] == "no_healthy_instance"
        app.state.server.attach(fake)
        assert httpx.get(server.base_url + "/health").status_code == 200
        assert _client(server).completions.create(model="fake", prompt=[66], max_tokens=2).choices[0].text == "BB"


def test_serve_config_binds_first_then_launches_and_stops_on_sigint(monkeypatch):
    probe_socket = socket.socket()
    probe_socket.bind(("127.0.0.1", 0))
    port = probe_socket.getsockname()[1]
    probe_socket.close()
    config = Config.from_yaml(CONFIG).override({"serve.port": port})
    fake = FakeCluster(tokenizer=CharTokenizer())
    launching, proceed, statuses = threading.Event(), threading.Event(), []

    def launch(cfg):
        assert cfg is config
        launching.set()
        proceed.wait(10)
        return fake
    monkeypatch.setattr(Cluster, "launch", staticmethod(launch))

    def probe():
        launching.wait(10)
        statuses.append(httpx.get(f"http://127.0.0.1:{port}/health").status_code)
        proceed.set()
        _wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200)
        statuses.append(httpx.get(f"http://127.0.0.1:{port}/health").status_code)
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=probe)
    thread.start()
    serve_config(config, log_level="warning")
    thread.join(10)
    assert statuses == [503, 200] and fake.shut_down
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_metrics_survive_a_failing_cluster_stats(serve_fake):
    class Flaky(FakeCluster):
        def stats(self):
            raise ClusterError("stats: an instance failed to answer")
    server, _ = serve_fake(Flaky(tokenizer=CharTokenizer()))
    samples = _samples(server)
    assert ("disagg:generation_tokens_total", (("model_name", "fake"),)) in samples
    assert not any(name == "disagg:kv_pages_total" for name, _ in samples)
