"""Replay of bad HTTP input against `disagg serve` on the real tiny 1P1D fleet (CPU actors, a model
WITH a tokenizer and chat template: tests/cluster/serve/tiny_hf_dir.py).

Classes replayed: malformed JSON, wrong types, lone UTF-16 surrogates, huge prompts and bodies,
bad max_tokens, unknown model, unsupported fields, bad auth; valid requests interleaved (their
token ids must equal `Cluster.generate`'s) and streams the client drops mid-way; ~80 requests. Counted over
every request: non-JSON bodies, 5xx answers, statuses other than the class's, error objects not
in OpenAI's shape, hangs, wrong outputs; then the pages still held once the fleet is idle. All
must be 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster" / "serve"))  # tiny_hf_dir
from tiny_hf_dir import write_tiny_hf_dir  # noqa: E402

from disagg.cluster import Cluster  # noqa: E402
from disagg.cluster.serve import BackgroundServer, build_app  # noqa: E402
from disagg.config import Config  # noqa: E402
from disagg.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(400)
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-1p1d.yaml"
LEASE_S = 8.0
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}
API_KEY = "k-123"


def _chat(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def _bad_input_cases(max_model_len: int) -> list[tuple[str, str, bytes | dict, int]]:
    """(class, path, body, expected status): raw bytes are sent as they are, dicts as JSON."""
    huge_text = "word " * 900_000  # 4.5 MB of text: over the 4 MiB body limit; 3.9 MB of it is not
    return [
        # malformed JSON
        ("json", CMPL, b'{"prompt": [1, 2', 400), ("json", CMPL, b'{"prompt": [1]} trailing', 400),
        ("json", CMPL, b"", 400), ("json", CMPL, b"\xff\xfe\x00garbage", 400), ("json", CMPL, b"[" * 50_000, 400),
        ("json", CMPL, b"null", 400), ("json", CMPL, b'"prompt"', 400), ("json", CHAT, b"{'messages': []}", 400),
        # wrong types
        ("types", CMPL, {"prompt": 5}, 400), ("types", CMPL, {"prompt": {"text": "x"}}, 400),
        ("types", CMPL, {"prompt": [1, "a"]}, 400), ("types", CMPL, {"prompt": [1], "max_tokens": "8"}, 400),
        ("types", CMPL, {"prompt": [1], "max_tokens": 1.5}, 400),
        ("types", CMPL, {"prompt": [1], "stream": "yes"}, 400),
        ("types", CMPL, {"prompt": [1], "temperature": "hot"}, 400), ("types", CMPL, {"prompt": [1], "stop": 7}, 400),
        ("types", CHAT, {"messages": "hello"}, 400), ("types", CHAT, _chat(5), 400),
        ("types", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400), ("types", CHAT, {"messages": []}, 400),
        # lone surrogates (the JSON escapes reach the server as they are)
        ("surrogate", CMPL, rb'{"prompt": "ab\ud800c", "max_tokens": 2}', 400),
        ("surrogate", CMPL, rb'{"prompt": ["\udc00"], "max_tokens": 2}', 400),
        ("surrogate", CMPL, rb'{"prompt": "ok", "stop": ["\ud800"], "max_tokens": 2}', 400),
        ("surrogate", CMPL, rb'{"prompt": "ok", "model": "\udfff"}', 400),
        ("surrogate", CHAT, rb'{"messages": [{"role": "user", "content": "hi \ud83d"}]}', 400),
        ("surrogate", CHAT, rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}', 400),
        ("surrogate", CHAT, rb'{"messages": [{"role": "user", "content": "hi", "name": "\udbff"}]}', 400),
        # huge prompts and bodies
        ("huge", CMPL, {"prompt": huge_text[:3_900_000]}, 400), ("huge", CHAT, _chat(huge_text[:3_900_000]), 400),
        ("huge", CMPL, {"prompt": "a" * 200_000}, 400),  # tokenized (200k tokens), then over the context
        ("huge", CMPL, {"prompt": [5] * (max_model_len + 1)}, 400), ("huge", CMPL, {"prompt": huge_text}, 413),
        # max_tokens
        ("max_tokens", CMPL, {"prompt": [1], "max_tokens": -1}, 400),
        ("max_tokens", CMPL, {"prompt": [1], "max_tokens": 0}, 400),
        ("max_tokens", CMPL, {"prompt": [1], "max_tokens": max_model_len}, 400),
        ("max_tokens", CMPL, {"prompt": [1], "max_tokens": 10 ** 30}, 400),
        ("max_tokens", CHAT, _chat("hi", max_completion_tokens=-3), 400),
        ("max_tokens", CHAT, _chat("hi", max_tokens=10 ** 12), 400),
        # unknown model
        ("model", CMPL, {"prompt": [1], "model": "gpt-4"}, 404), ("model", CHAT, _chat("hi", model="gpt-4"), 404),
        # unsupported or out-of-range fields
        ("fields", CMPL, {"prompt": [1], "max_tokenz": 3}, 400), ("fields", CMPL, {"prompt": [1], "n": 2}, 400),
        ("fields", CMPL, {"prompt": [1], "logprobs": 5}, 400),
        ("fields", CMPL, {"prompt": [1], "temperature": -1}, 400),
        ("fields", CMPL, b'{"prompt": [1], "temperature": NaN}', 400),
        ("fields", CMPL, {"prompt": [1], "top_p": 0}, 400),
        ("fields", CMPL, {"prompt": [1], "seed": 2 ** 70}, 400), ("fields", CMPL, {"prompt": [100_000]}, 400),
        ("fields", CHAT, _chat("hi", tools=[{"type": "function"}]), 400),
    ]


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    model_dir = write_tiny_hf_dir(tmp_path_factory.mktemp("tiny-hf"))
    config = Config.from_yaml(CONFIG).override({"model.source": str(model_dir), "router.lease_s": LEASE_S})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")  # passed on to the actors
        cluster = Cluster.launch(config)
    try:
        with BackgroundServer(build_app(cluster, config)) as open_server, \
                BackgroundServer(build_app(cluster, config.override({"serve.api_key": API_KEY}))) as keyed_server:
            yield cluster, open_server, keyed_server
    finally:
        cluster.shutdown()


class Tally:
    """Counts over every answer of the replay."""

    def __init__(self) -> None:
        self.counts = {"tried": 0, "non_json": 0, "server_errors": 0, "unexpected_status": 0,
                       "malformed_errors": 0, "hangs": 0, "wrong_outputs": 0}
        self.failures: list[str] = []

    def bump(self, key: str, what: str) -> None:
        self.counts[key] += 1
        self.failures.append(f"{key}: {what}")

    def send(self, client: httpx.Client, path: str, body: bytes | dict, status: int, what: str,
             headers: dict | None = None) -> dict | None:
        """Send one request; count what is wrong with its answer; return its JSON body when 200."""
        self.counts["tried"] += 1
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            response = client.post(path, content=content,
                                   headers={"Content-Type": "application/json", **(headers or {})})
        except httpx.TimeoutException:
            self.bump("hangs", what)
            return None
        if response.status_code >= 500:
            self.bump("server_errors", f"{what}: {response.status_code} {response.text[:200]}")
        if response.status_code != status:
            self.bump("unexpected_status", f"{what}: {response.status_code}, expected {status}: {response.text[:200]}")
        try:
            answer = response.json()
        except ValueError:
            self.bump("non_json", f"{what}: {response.headers.get('content-type')} {response.text[:200]!r}")
            return None
        if response.status_code != 200 and set(answer.get("error", {})) != ERROR_KEYS:
            self.bump("malformed_errors", f"{what}: {answer}")
        return answer if response.status_code == 200 else None


def _pages_in_use(cluster) -> int:
    stats = cluster.stats()
    return stats["router"]["live"] + sum(inst["total_pages"] - inst["free_pages"] for inst in stats["instances"])


def _wait_idle(cluster, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while _pages_in_use(cluster) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _pages_in_use(cluster)


def _drop_streams_midway(server, tally: Tally, num_streams: int) -> None:
    """Open streams that would run long, read two events of each, then leave."""
    body = {"prompt": [7, 8, 9] * 20, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    for k in range(num_streams):
        tally.counts["tried"] += 1
        with httpx.stream("POST", server.base_url + CMPL, json=body, timeout=60) as response:
            events = (line for line in response.iter_lines() if line)
            for _ in range(2):
                if not next(events, "").startswith("data: {"):
                    tally.bump("wrong_outputs", f"dropped stream {k}: no event")


def test_bad_http_input_replay(served):
    cluster, server, keyed = served
    tokenizer = cluster.tokenizer
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    valid = [("ids", CMPL, {"prompt": [11, 12, 13, 14], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True}, [11, 12, 13, 14]),
             ("text", CMPL, {"prompt": "The cat \U0001F600", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True}, tokenizer.encode("The cat \U0001F600"))]
    expected = {name: out.token_ids for (name, *_), out in zip(valid, cluster.generate([v[3] for v in valid], greedy))}
    tally = Tally()
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for k, (what, path, body, status) in enumerate(_bad_input_cases(cluster.max_model_len)):
            tally.send(client, path, body, status, f"{what}#{k} {path}")
            if k % 3:
                continue
            name, vpath, vbody, _ = valid[k // 3 % len(valid)]  # a valid request after every third bad one
            answer = tally.send(client, vpath, vbody, 200, f"valid {name} after {what}#{k}")
            if answer is not None and answer["choices"][0]["token_ids"] != expected[name]:
                tally.bump("wrong_outputs", f"valid {name} after {what}#{k}: {answer['choices'][0]}")
        chat = tally.send(client, CHAT, _chat("hello", max_tokens=4), 200, "valid chat")
        if chat is not None and chat["object"] != "chat.completion":
            tally.bump("wrong_outputs", f"valid chat: {chat}")
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                        {"Authorization": "Bearer"}, {"Authorization": API_KEY}):
            tally.send(client, CMPL, {"prompt": [1], "max_tokens": 2}, 401, f"auth {headers}", headers)
        tally.send(client, CMPL, {"prompt": [1], "max_tokens": 2}, 200, "auth ok",
                   {"Authorization": f"Bearer {API_KEY}"})
    _drop_streams_midway(server, tally, num_streams=4)
    leaked = _wait_idle(cluster, LEASE_S + 20)
    counts = dict(tally.counts, pages_leaked=leaked, in_flight=server.app.state.server.num_in_flight)
    assert counts["tried"] >= 70
    assert counts == dict(counts, non_json=0, server_errors=0, unexpected_status=0, malformed_errors=0, hangs=0,
                          wrong_outputs=0, pages_leaked=0, in_flight=0), (counts, tally.failures[:10])
