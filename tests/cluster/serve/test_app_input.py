"""Bad input at the HTTP layer over a `FakeCluster`: every error body is OpenAI's JSON (a lone UTF-16
surrogate is a 400 naming the field, an unexpected exception a 500 in JSON), prompts are tokenized
off the event loop (/health answers meanwhile), text too long for the context is refused before
it is tokenized, and --root-path / --allowed-origins behave. The surrogate cases use the real
`Tokenizer` of a tiny HF directory (tiny_hf_dir.py), which raises TypeError on a surrogate."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from fake_cluster import CharTokenizer, FakeCluster
from tiny_hf_dir import write_tiny_hf_dir

from disagg.cluster.serve import BackgroundServer, build_app, prompts
from disagg.model.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(60)
ERROR_KEYS = {"message", "type", "param", "code"}


class CountingTokenizer(CharTokenizer):
    """CharTokenizer that counts encode calls and can block in them until released."""

    def __init__(self, gate: bool = False, fail_with: BaseException | None = None) -> None:
        super().__init__()
        self.calls = 0
        self.entered, self.release = threading.Event(), threading.Event()
        if not gate:
            self.release.set()
        self.fail_with = fail_with

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        self.entered.set()
        self.release.wait(30)
        if self.fail_with is not None:
            raise self.fail_with
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(write_tiny_hf_dir(tmp_path_factory.mktemp("tiny-hf")))


def _error(response: httpx.Response) -> dict:
    """The error object of a response, checking it is OpenAI's JSON shape."""
    assert response.headers["content-type"] == "application/json", (response.status_code, response.text[:200])
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"] and error["type"]
    return error


def _post(server, path: str, body: bytes, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, content=body, headers={"Content-Type": "application/json"},
                      timeout=20, **kwargs)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", rb'{"prompt": "ab\ud800c"}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["ab\udc00"]}', "prompt[0]"),
    ("/v1/completions", rb'{"prompt": "ok", "stop": ["x", "\ud800"]}', "stop[1]"),
    ("/v1/completions", rb'{"prompt": "ok", "model": "\ud800"}', "model"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi \ud83d"}]}', "messages[0].content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}',
     "messages[0].name"),
])
def test_lone_surrogate_is_a_400_naming_the_field(serve_fake, hf_tokenizer, path, body, param):
    server, fake = serve_fake(FakeCluster(tokenizer=hf_tokenizer))
    response = _post(server, path, body)
    error = _error(response)
    assert response.status_code == 400 and error["param"] == param and "surrogate" in error["message"]
    assert not fake.started
    pair = _post(server, "/v1/completions", rb'{"prompt": "ab\ud83d\ude00", "max_tokens": 2}')  # a valid pair
    assert pair.status_code == 200 and pair.json()["usage"]["prompt_tokens"] == 6  # 2 + the emoji's 4 bytes


@pytest.mark.parametrize("method, path, body, status", [
    ("GET", "/nowhere", None, 404),
    ("POST", "/v1/models", b"{}", 405),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/completions", b"\xff\xfe not utf-8", 400),
    ("POST", "/v1/completions", b"[" * 100_000, 400),  # nesting deeper than the JSON parser's recursion
    ("POST", "/v1/completions", b'"a string"', 400),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 1e400}', 400),
    ("POST", "/v1/completions", b'{"prompt": [1], "temperature": NaN}', 400),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": -5}', 400),
    ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 100000000000000000000000}', 400),
    ("POST", "/v1/completions", b'{"prompt": [1], "seed": 100000000000000000000000}', 400),
    ("POST", "/v1/chat/completions", b'{"messages": []}', 400),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400),
])
def test_every_error_is_openai_json(serve_fake, method, path, body, status):
    server, fake = serve_fake()
    response = httpx.request(method, server.base_url + path, content=body, timeout=20,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == status
    _error(response)
    if status == 405:
        assert response.headers["allow"]
    assert not fake.started


def test_an_unexpected_exception_is_a_500_in_json(serve_fake):
    server, _ = serve_fake(FakeCluster(tokenizer=CountingTokenizer(fail_with=RuntimeError("tokenizer crashed"))))
    response = _post(server, "/v1/completions", b'{"prompt": "hello"}')
    error = _error(response)
    assert response.status_code == 500 and error["code"] == "internal_error" and "tokenizer crashed" in error["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'disagg:request_failures_total{model_name="fake",reason="internal_error"} 1.0' in metrics


def test_health_answers_while_a_prompt_is_tokenized(serve_fake):
    """The tokenizer blocks until released: /health must answer meanwhile (the loop is free)."""
    tokenizer = CountingTokenizer(gate=True)
    server, _ = serve_fake(FakeCluster(tokenizer=tokenizer))
    answers: list[httpx.Response] = []
    big = threading.Thread(target=lambda: answers.append(_post(
        server, "/v1/completions", json.dumps({"prompt": "x" * 200, "max_tokens": 2}).encode(), )))
    big.start()
    try:
        assert tokenizer.entered.wait(10)
        health = httpx.get(server.base_url + "/health", timeout=5)
        assert health.status_code == 200 and not answers  # answered before the big request
    finally:
        tokenizer.release.set()
        big.join(30)
    assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == "xx"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_text_that_cannot_fit_is_refused_before_tokenizing(serve_fake, path):
    tokenizer = CountingTokenizer()
    server, fake = serve_fake(FakeCluster(tokenizer=tokenizer, max_model_len=256))
    too_long = "y" * (256 * prompts.MAX_CHARS_PER_TOKEN + 1)
    field = "prompt" if "chat" not in path else "messages"
    body = {"prompt": too_long} if field == "prompt" else {
        "messages": [{"role": "user", "content": too_long[:1000]}, {"role": "user", "content": too_long[1000:]}]}
    response = _post(server, path, json.dumps(body).encode())
    error = _error(response)
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == field
    assert "characters" in error["message"] and tokenizer.calls == 0
    at_bound = {"prompt": too_long[:-1]} if field == "prompt" else {"messages": [{"role": "user", "content": "z"}]}
    response = _post(server, path, json.dumps(at_bound).encode())  # tokenized, then judged by its tokens
    assert tokenizer.calls == 1 and response.status_code == (400 if field == "prompt" else 200)
    assert not fake.active


def test_unknown_model_is_404_before_tokenizing(serve_fake):
    tokenizer = CountingTokenizer()
    server, _ = serve_fake(FakeCluster(tokenizer=tokenizer))
    response = _post(server, "/v1/completions", b'{"prompt": "hello", "model": "gpt-4"}')
    assert response.status_code == 404 and _error(response)["code"] == "model_not_found" and tokenizer.calls == 0


def test_root_path_keeps_the_api_key_on_v1(monkeypatch):
    monkeypatch.setenv("DISAGG_API_KEY", "k")
    fake = FakeCluster(tokenizer=CharTokenizer())
    with BackgroundServer(build_app(fake), root_path="/api") as server:
        assert httpx.get(server.base_url + "/v1/models").status_code == 401
        models = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer k"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake"
        assert httpx.get(server.base_url + "/health").status_code == 200


def test_cors_only_for_the_allowed_origins():
    fake = FakeCluster(tokenizer=CharTokenizer())
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with BackgroundServer(build_app(fake)) as server:
        assert "access-control-allow-origin" not in httpx.get(server.base_url + "/v1/models", headers=preflight).headers
    with BackgroundServer(build_app(fake, allowed_origins=["https://app.example"])) as server:
        response = httpx.options(server.base_url + "/v1/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(server.base_url + "/v1/completions", headers=dict(preflight, Origin="https://evil"))
        assert other.status_code == 400
