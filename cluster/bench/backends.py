"""The two things the bench can drive: an in-process `Cluster`, or an OpenAI-compatible server.

`ClusterBackend` wraps `cluster.stream(prompt_token_ids, params)` (the cluster's router runs on
its own loop; the stream bridges to ours) and passes each `StreamDelta`'s emit times through,
so the client overhead (actor emit -> client sees it) is measured. `HttpBackend` posts to
`/v1/completions` with a token-id prompt, `stream=True`, `ignore_eos=True`, `return_token_ids`
(vLLM's extension: exact tokens per chunk) and reads the SSE chunks with httpx, as vLLM's
`openai` request function does with aiohttp; the usage block at the end gives the output token
count. `HttpBackend.check` asks /v1/models before any run, so an unreachable server or a refused
key is one `TargetError` line rather than a run of failed requests. Both run in the bench process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from disagg import trace
from disagg.cluster.bench.runner import Chunk
from disagg.cluster.bench.workloads import SampleRequest
from disagg.errors import DisaggError

logger = logging.getLogger(__name__)
_RUN_IDS = itertools.count()


class ClusterBackend:
    """Serve bench requests with a launched `disagg.cluster.Cluster` (greedy, EOS ignored)."""

    def __init__(self, cluster: Any, *, name: str = "cluster") -> None:
        self.cluster = cluster
        self.name = name
        self._prefix = self._run_prefix()
        self._count = itertools.count()

    async def open(self) -> None:
        self._prefix = self._run_prefix()  # request ids stay unique across runs

    def _run_prefix(self) -> str:
        """``benchN.<label>.<pid>``: unique across runs, deployments and bench processes (a trace
        directory shared by several deployments' runs groups by it: `trace_report.py --by-run`)."""
        label = re.sub(r"[^A-Za-z0-9_]+", "_", self.name).strip("_") or "cluster"
        return f"bench{next(_RUN_IDS)}.{label}.{os.getpid()}"

    async def aclose(self) -> None:
        return None

    async def stream(self, request: SampleRequest) -> AsyncIterator[Chunk]:
        from disagg.sampling import SamplingParams

        params = SamplingParams(max_tokens=request.expected_output_len, temperature=0.0, ignore_eos=True)
        request_id = f"{self._prefix}-{request.request_id}-{next(self._count)}"
        trace.event("client_send", request_id)
        first = True
        # Closing the cluster's stream aborts the request there (a timeout or a cancelled run).
        async with contextlib.aclosing(self.cluster.stream(request.prompt_token_ids, params,
                                                           request_id=request_id)) as deltas:
            async for delta in deltas:
                if delta.error:
                    yield Chunk(0, error=str(delta.error))
                    return
                if first and delta.token_ids:
                    trace.event("client_first", request_id)
                    first = False
                yield Chunk(len(delta.token_ids), tuple(delta.emit_times or ()))
                if delta.finished:
                    return


class TargetError(DisaggError):
    """The server to benchmark cannot be used (unreachable, refuses the key, lists no model); one line."""


class HttpBackend:
    """Serve bench requests with an OpenAI-compatible `/v1/completions` server (SSE streaming).

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        model: the model name to send; None asks `/v1/models` for the first one.
        endpoint: the completions path.
        api_key: sent as a Bearer token when given.
        headers: more headers (vLLM's `--header`); they win over the key's.
        verify: check TLS certificates (False: vLLM's `--insecure`).
        transport: an httpx transport to use instead of the network (tests).
    """

    def __init__(self, base_url: str, *, model: str | None = None, endpoint: str = "/v1/completions",
                 api_key: str | None = None, headers: dict[str, str] | None = None, verify: bool = True,
                 transport: Any = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url: expected an http:// or https:// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.headers.update(headers or {})
        self.name = self.base_url
        self._verify = verify
        self._transport = transport
        self._client = None
        self._warned_reset = False

    async def open(self) -> None:
        self._connect()
        if self.model is None:
            self.model = await self._first_model()

    def _connect(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, verify=self._verify,
                                         timeout=httpx.Timeout(None, connect=30.0),
                                         limits=httpx.Limits(max_connections=None), transport=self._transport)

    async def check(self, ready_timeout_s: float = 0.0) -> None:
        """Ask /v1/models once before any run (retrying up to `ready_timeout_s` while unreachable), so a
        wrong URL or key is one line, not a run of failed requests; learn the model name if unset.

        Raises:
            TargetError: unreachable, HTTP 401/403 (the key), or no model to send.
        """
        import httpx

        deadline = time.monotonic() + ready_timeout_s
        while True:
            self._connect()
            try:
                listed = await self._first_model(required=self.model is None)
                self.model = self.model or listed
                return
            except httpx.TransportError as err:
                if time.monotonic() >= deadline:
                    raise TargetError(f"cannot reach {self.base_url} ({type(err).__name__}: {err or 'no answer'});"
                                      " is the server up? (--ready-check-timeout-sec N waits for it)") from None
            finally:
                await self.aclose()
            await asyncio.sleep(1.0)

    async def _first_model(self, required: bool = True) -> str | None:
        url = f"{self.base_url}/v1/models"
        response = await self._client.get("/v1/models")
        if response.status_code in (401, 403):
            raise TargetError(f"{url} answered HTTP {response.status_code}: {_reason(response)}; pass the "
                              "server's key with --api-key KEY or OPENAI_API_KEY=KEY")
        if response.status_code != 200:
            if not required:
                return None
            raise TargetError(f"{url} answered HTTP {response.status_code}: {_reason(response)}; name the "
                              "model with --model")
        models = response.json().get("data") or []
        if not models and required:
            raise TargetError(f"{url} lists no model; name the model with --model")
        return models[0]["id"] if models else None

    async def reset_prefix_cache(self) -> bool:
        """POST /reset_prefix_cache (vLLM's and `disagg serve`'s); whether the server did. A server
        without it (404/405: e.g. vLLM outside dev mode) is warned about once and left as it is."""
        import httpx

        try:
            async with httpx.AsyncClient(headers=self.headers, verify=self._verify, timeout=60.0,
                                         transport=self._transport) as client:
                status = (await client.post(f"{self.base_url}/reset_prefix_cache")).status_code
        except httpx.TransportError as err:
            status = f"no answer ({type(err).__name__})"
        if status == 200:
            return True
        if not self._warned_reset:
            logger.warning("%s/reset_prefix_cache answered HTTP %s: runs may hit on the prefixes of earlier "
                           "ones (--keep-prefix-cache silences this)", self.base_url, status)
            self._warned_reset = True
        return False

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def stream(self, request: SampleRequest) -> AsyncIterator[Chunk]:
        body = {"model": self.model, "prompt": request.prompt_token_ids,
                "max_tokens": request.expected_output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        async with self._client.stream("POST", self.endpoint, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                yield Chunk(0, error=f"HTTP {response.status_code}: {_reason(response)}")
                return
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is not None:
                    yield chunk


def _reason(response: Any) -> str:
    """An error response's message (OpenAI's {"error": {"message"}}, FastAPI's {"detail"}), one line."""
    try:
        body = response.json()
        error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
        text = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        text = response.text
    return " ".join(str(text).split())[:300] or response.reason_phrase


def parse_sse_line(line: str) -> Chunk | None:
    """One SSE line of a streamed completion -> a Chunk (None for keep-alives and [DONE]).

    A chunk with choices counts as one token unless it lists ``token_ids`` (a disagg extension,
    as are ``emit_times``); a usage block gives the server's output token count.
    """
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload in ("", "[DONE]"):
        return None
    data = json.loads(payload)
    if "error" in data:
        return Chunk(0, error=str(data["error"]))
    usage = data.get("usage") or {}
    total = usage.get("completion_tokens")
    choices = data.get("choices") or []
    if not choices:
        return Chunk(0, total_tokens=total)
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if token_ids is not None:
        num_tokens = len(token_ids)
    else:  # a closing chunk with only a finish_reason carries no token
        num_tokens = 0 if choice.get("finish_reason") and not choice.get("text") else 1
    return Chunk(num_tokens, tuple(choice.get("emit_times") or ()), total_tokens=total)
