"""`disagg serve` on the real cluster of configs/tiny-1p1d.yaml (one prefill + one decode actor on
the CPU, /dev/shm heap): the `openai` client against uvicorn on 127.0.0.1, one cluster for the
module. Token ids must equal `Cluster.generate`'s; a client that leaves mid-stream frees its pages
on both instances; bad requests get their status; /metrics parses and moves; 200 concurrent
streams come back whole and unmixed. The kernels run their torch references here
(TRITON_INTERPRET=0 for the actors): the kernels are tested through the interpreter elsewhere."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.cluster import Cluster
from disagg.cluster.serve import BackgroundServer, build_app
from disagg.config import Config
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(240)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-1p1d.yaml"
LEASE_S = 8.0  # decode pages of a request whose prefill refused it come back after the lease
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 11)] for i in range(200)]


@pytest.fixture(scope="module")
def served(ray_local):
    config = Config.from_yaml(CONFIG).override({"router.lease_s": LEASE_S})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")  # passed on to the actors
        cluster = Cluster.launch(config)
    try:
        with BackgroundServer(build_app(cluster, config)) as server:
            yield cluster, server
    finally:
        cluster.shutdown()


def _client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60, **kwargs)


def _pages_all_free(cluster) -> bool:
    stats = cluster.stats()
    return stats["router"]["live"] == 0 and all(
        inst["free_pages"] == inst["total_pages"] for inst in stats["instances"])


def _wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_health_and_models(served):
    cluster, server = served
    assert httpx.get(server.base_url + "/health").status_code == 200
    card = _client(server).models.list().data[0]
    assert card.id == cluster.model_name and card.model_extra["max_model_len"] == cluster.max_model_len


def test_completion_token_ids_equal_generate(served):
    cluster, server = served
    prompts = PROMPTS[:3]
    expected = [c.token_ids for c in cluster.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))]
    client = _client(server)
    for prompt, want in zip(prompts, expected):
        out = client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == want
        assert out.usage.completion_tokens == len(want) and out.usage.prompt_tokens == len(prompt)
        ids = []
        for chunk in client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=8, temperature=0,
                                               stream=True, extra_body={"return_token_ids": True}):
            ids += chunk.choices[0].model_extra["token_ids"]
        assert ids == want


def test_seeded_sampling_equals_generate(served):
    cluster, server = served
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=1234)
    want = cluster.generate([PROMPTS[4]], params)[0].token_ids
    out = _client(server).completions.create(model=cluster.model_name, prompt=PROMPTS[4], max_tokens=8,
                                             temperature=0.9, top_p=0.8, seed=1234,
                                             extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == want


def test_chat_without_tokenizer_is_400(served):
    cluster, server = served
    with pytest.raises(openai.BadRequestError, match="no tokenizer") as info:
        _client(server).chat.completions.create(model=cluster.model_name, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == "messages"


def test_client_disconnect_mid_stream_frees_pages_on_both_sides(served):
    cluster, server = served
    body = {"prompt": PROMPTS[5] * 8, "max_tokens": 3000, "stream": True, "ignore_eos": True, "temperature": 0}
    aborts_before = cluster.stats()["router"]["counts"].get("abort", 0)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line)
        for _ in range(3):
            assert next(lines).startswith("data: {")
        during = cluster.stats()
        decode = [inst for inst in during["instances"] if inst["role"] == "decode"][0]
        assert decode["free_pages"] < decode["total_pages"] and during["router"]["live"] == 1
    assert _wait_until(lambda: _pages_all_free(cluster)), cluster.stats()
    assert cluster.stats()["router"]["counts"].get("abort", 0) == aborts_before + 1  # not run to length


@pytest.mark.parametrize("content, status, param", [
    (b'{"prompt": [1, 2', 400, None),
    (b'{"prompt": [1, 2], "temprature": 0}', 400, "temprature"),
    (b'{"prompt": [1, 2], "max_tokens": "8"}', 400, "max_tokens"),
    (b'{"prompt": [1, 2], "n": 2}', 400, "n"),
    (b'{"prompt": "text needs a tokenizer"}', 400, "prompt"),
    (b'{"prompt": [1, 2], "max_tokens": 4095}', 400, "max_tokens"),
    (b'{"prompt": [100000, 2], "max_tokens": 2}', 400, "prompt"),  # refused by the server (vocab_size)
    (b'{"prompt": [100000, 2], "max_tokens": 2, "stream": true}', 400, "prompt"),
])
def test_bad_requests(served, content, status, param):
    _, server = served
    response = httpx.post(server.base_url + "/v1/completions", content=content,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["param"] == param and response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_input_the_engine_refuses_is_400_naming_prompt(served, stream):
    """Without the server's vocabulary check the ids reach the cluster: the prefill engine refuses
    them (RequestRefused) and the client still gets a 400 naming `prompt`. The decode reservation
    stays quarantined until its lease closes (no ring comes), then every page is free."""
    cluster, _ = served
    app = build_app(cluster, cluster.config)
    limits = app.state.server.limits
    app.state.server.limits = dataclasses.replace(limits, vocab_size=None)
    with BackgroundServer(app) as server:
        response = httpx.post(server.base_url + "/v1/completions",
                              json={"prompt": [100000, 2], "max_tokens": 2, "stream": stream})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt" and "prefill-0" in error["message"]
    assert _wait_until(lambda: _pages_all_free(cluster), LEASE_S + 15)


def test_oversize_body_and_api_key(served):
    cluster, _ = served
    config = cluster.config.override({"serve.api_key": "k-123"})
    with BackgroundServer(build_app(cluster, config, max_body_bytes=4096)) as server:
        url = server.base_url + "/v1/completions"
        assert httpx.post(url, json={"prompt": [1]}).status_code == 401
        assert httpx.post(url, json={"prompt": [1]}, headers={"Authorization": "Bearer nope"}).status_code == 401
        auth = {"Authorization": "Bearer k-123"}
        response = httpx.post(url, json={"prompt": list(range(3, 2000))}, headers=auth)
        assert response.status_code == 413 and "4096 bytes" in response.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            _client(server).completions.create(model=cluster.model_name, prompt=[1, 2], max_tokens=2)
        out = openai.OpenAI(base_url=server.base_url + "/v1", api_key="k-123", max_retries=0).completions.create(
            model=cluster.model_name, prompt=[1, 2], max_tokens=2)
        assert out.usage.completion_tokens >= 1


def _samples(server) -> dict:
    text = httpx.get(server.base_url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0)


def test_metrics_parse_and_move(served):
    cluster, server = served
    model = {"model_name": cluster.model_name}
    prefill, decode = {"instance": "prefill-0", "role": "prefill"}, {"instance": "decode-0", "role": "decode"}
    before = _samples(server)
    out = _client(server).completions.create(model=cluster.model_name, prompt=PROMPTS[9], max_tokens=6,
                                             temperature=0, extra_body={"ignore_eos": True})
    after = _samples(server)
    assert _delta(after, before, "disagg:generation_tokens_total", **model) == 6
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert _delta(after, before, f"disagg:{histogram}_seconds_count", **model) == 1, histogram
    assert _delta(after, before, "disagg:inter_token_latency_seconds_count", **model) >= 5
    assert after[("disagg:kv_pages_total", tuple(sorted(decode.items())))] == 256
    assert after[("disagg:instance_alive", tuple(sorted(prefill.items())))] == 1
    assert _delta(after, before, "disagg:router_requests_total", outcome="submitted") == 1
    assert out.choices[0].finish_reason == "length"
    # The KV crossed: pushed bytes (the prompt's tokens, every layer's K and V) and a push rate on
    # the prefill side, one more rung doorbell and its wait on the decode side.
    assert _delta(after, before, "disagg:kv_pushed_bytes_total", **prefill) > 0
    assert after[("disagg:kv_push_gbps", tuple(sorted(prefill.items())))] > 0
    assert _delta(after, before, "disagg:kv_doorbells_rung_total", **decode) == 1
    assert _delta(after, before, "disagg:doorbell_wait_seconds_total", **decode) > 0
    for inst in (prefill, decode):
        labels = tuple(sorted(inst.items()))
        assert after[("disagg:num_preemptions_total", labels)] == 0
        queried = _delta(after, before, "disagg:prefix_cache_queries_total", **inst)
        assert queried > 0 and 0 <= _delta(after, before, "disagg:prefix_cache_hits_total", **inst) < queried
        assert {("disagg:num_requests_running", labels), ("disagg:num_requests_waiting", labels),
                ("disagg:kv_pages_used", labels)} <= set(after)
    assert ("disagg:num_requests_queued", ()) in after


def test_metrics_count_aborts_and_failures_by_reason(served):
    cluster, server = served
    before = _samples(server)
    body = {"prompt": PROMPTS[3], "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
        assert next(line for line in response.iter_lines() if line).startswith("data: {")
    limits = server.app.state.server.limits
    server.app.state.server.limits = dataclasses.replace(limits, vocab_size=None)  # reach the engine
    try:
        refused = httpx.post(server.base_url + "/v1/completions", json={"prompt": [100000, 2], "max_tokens": 2})
    finally:
        server.app.state.server.limits = limits
    assert refused.status_code == 400
    assert _wait_until(lambda: _pages_all_free(cluster), LEASE_S + 15)
    after = _samples(server)
    assert _delta(after, before, "disagg:cluster_request_aborts_total", reason="caller") == 1
    assert _delta(after, before, "disagg:cluster_request_failures_total", reason="request_refused") == 1
    model = cluster.model_name
    assert _delta(after, before, "disagg:request_aborts_total", model_name=model, reason="client_disconnect") == 1
    assert _delta(after, before, "disagg:request_failures_total", model_name=model, reason="invalid_request") == 1


def test_200_concurrent_streams_nothing_lost_or_mixed(served):
    cluster, server = served
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in cluster.generate(PROMPTS, params)]

    async def one(client, prompt):
        ids, prompt_echo, usage, reasons = [], None, None, []
        stream = await client.completions.create(
            model=cluster.model_name, prompt=prompt, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                continue
            extra = chunk.choices[0].model_extra
            prompt_echo = extra.get("prompt_token_ids", prompt_echo)
            ids += extra["token_ids"]
            reasons.append(chunk.choices[0].finish_reason)
        return ids, prompt_echo, usage, reasons

    async def run_all():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        http = httpx.AsyncClient(limits=limits, timeout=180)
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                                      http_client=http) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))
    results = asyncio.run(run_all())
    for prompt, want, (ids, prompt_echo, usage, reasons) in zip(PROMPTS, expected, results):
        assert prompt_echo == prompt and ids == want and len(ids) == 6
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        assert usage.completion_tokens == 6 and usage.prompt_tokens == len(prompt)
    assert _wait_until(lambda: _pages_all_free(cluster))


def test_reset_prefix_cache_frees_the_cached_pages(served):
    cluster, server = served
    prompt = [(11 * j) % 250 + 3 for j in range(70)]  # several whole pages: cached on both instances
    _client(server).completions.create(model=cluster.model_name, prompt=prompt, max_tokens=2, temperature=0.0)
    assert _wait_until(lambda: cluster.stats()["router"]["live"] == 0)
    cached = {inst["name"]: inst["prefix_cached_pages"] for inst in cluster.stats()["instances"]}
    assert all(cached.values()), cached
    affinity = cluster._router.placer.affinity  # the router's belief of what each instance holds
    assert affinity is not None and sum(affinity.num_pages(name) for name in cached) > 0
    response = httpx.post(server.base_url + "/reset_prefix_cache")
    assert response.status_code == 200 and response.json()["freed_pages"] == cached
    assert _pages_all_free(cluster) and sum(affinity.num_pages(name) for name in cached) == 0
    assert all(inst["prefix_cached_pages"] == 0 for inst in cluster.stats()["instances"])
