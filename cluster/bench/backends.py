"""The two things the bench can drive: an in-process `Cluster`, or an OpenAI-compatible server.

`ClusterBackend` wraps `cluster.stream(prompt_token_ids, params)` (the cluster's router runs on
its own loop; the stream bridges to ours) and passes each `StreamDelta`'s emit times through,
so the client overhead (actor emit -> client sees it) is measured. `HttpBackend` posts to
`/v1/completions` with a token-id prompt, `stream=True`, `ignore_eos=True`, `return_token_ids`
(vLLM's extension: exact tokens per chunk) and reads the SSE
chunks with httpx, as vLLM's `openai` request function does with aiohttp; the usage block at the
end gives the output token count. Both run in the bench process.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from disagg.cluster.bench.runner import Chunk
from disagg.cluster.bench.workloads import SampleRequest

logger = logging.getLogger(__name__)
_RUN_IDS = itertools.count()


class ClusterBackend:
    """Serve bench requests with a launched `disagg.cluster.Cluster` (greedy, EOS ignored)."""

    def __init__(self, cluster: Any, *, name: str = "cluster") -> None:
        self.cluster = cluster
        self.name = name
        self._prefix = f"bench{next(_RUN_IDS)}"
        self._count = itertools.count()

    async def open(self) -> None:
        self._prefix = f"bench{next(_RUN_IDS)}"  # request ids stay unique across runs

    async def aclose(self) -> None:
        return None

    async def stream(self, request: SampleRequest) -> AsyncIterator[Chunk]:
        from disagg.sampling import SamplingParams

        params = SamplingParams(max_tokens=request.expected_output_len, temperature=0.0, ignore_eos=True)
        request_id = f"{self._prefix}-{request.request_id}-{next(self._count)}"
        # Closing the cluster's stream aborts the request there (a timeout or a cancelled run).
        async with contextlib.aclosing(self.cluster.stream(request.prompt_token_ids, params,
                                                           request_id=request_id)) as deltas:
            async for delta in deltas:
                if delta.error:
                    yield Chunk(0, error=str(delta.error))
                    return
                yield Chunk(len(delta.token_ids), tuple(delta.emit_times or ()))
                if delta.finished:
                    return


class HttpBackend:
    """Serve bench requests with an OpenAI-compatible `/v1/completions` server (SSE streaming).

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        model: the model name to send; None asks `/v1/models` for the first one.
        endpoint: the completions path.
        api_key: sent as a Bearer token when given.
        transport: an httpx transport to use instead of the network (tests).
    """

    def __init__(self, base_url: str, *, model: str | None = None, endpoint: str = "/v1/completions",
                 api_key: str | None = None, transport: Any = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url: expected an http:// or https:// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = self.base_url
        self._transport = transport
        self._client = None

    async def open(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                         timeout=httpx.Timeout(None, connect=30.0),
                                         limits=httpx.Limits(max_connections=None), transport=self._transport)
        if self.model is None:
            response = await self._client.get("/v1/models")
            response.raise_for_status()
            models = response.json().get("data") or []
            if not models:
                raise RuntimeError(f"{self.base_url}/v1/models lists no model; pass --model")
            self.model = models[0]["id"]

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
                text = (await response.aread()).decode(errors="replace")[:500]
                yield Chunk(0, error=f"HTTP {response.status_code}: {text}")
                return
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is not None:
                    yield chunk


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
