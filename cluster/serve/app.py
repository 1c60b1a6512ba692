"""The FastAPI app of `disagg serve`: OpenAI routes over a launched `Cluster`.

`build_app(cluster, config)` wires the routes (/v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, /reset_prefix_cache), the guards (API key on /v1 and /reset_prefix_cache, body
size limit, CORS when origins are given),
OpenAI-shaped error handlers with a catch-all, and a `ServerMetrics` registry. A request's path:
validate (protocol.py) -> tokenize and check the context (prompts.py, in a worker thread) ->
admit (a bounded count of requests in flight, else 429) -> run on the cluster (generation.py) ->
answer as one JSON body or as server-sent events (streaming.py). A client that disconnects,
before or during its stream, has its request aborted on the cluster. Runs in uvicorn's event
loop; `cluster.stream` bridges to the router's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from disagg.cluster.serve.errors import APIError, CatchAllMiddleware, validation_message
from disagg.cluster.serve.generation import Chunk, Generation, GenerationFailed
from disagg.cluster.serve.guards import ApiKeyMiddleware, BodyLimitMiddleware, resolve_api_key
from disagg.cluster.serve.metrics import CONTENT_TYPE, ServerMetrics
from disagg.cluster.serve.prompts import ModelLimits, PreparedRequest, prepare_chat, prepare_completion
from disagg.cluster.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from disagg.cluster.serve.streaming import ResponseFormat, sse_events
from disagg.cluster.serve import cluster_errors

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as token ids is ~1 MB of JSON
DEFAULT_MAX_CONCURRENT_REQUESTS = 4096


class ClientGone(Exception):
    """The client disconnected before its response began."""


class ServerState:
    """What the routes share: the cluster, the model's limits, the admission count, the metrics.

    Built before the cluster exists (so /health can answer 503 while it launches); `attach`
    hands it the launched cluster.
    """

    def __init__(self, config: Any, max_concurrent_requests: int) -> None:
        self.serve = config.serve
        self.cluster: Any | None = None
        self.model_name = ""
        self.limits: ModelLimits | None = None
        self.metrics: ServerMetrics | None = None
        self.max_concurrent_requests = max_concurrent_requests
        self.num_in_flight = 0

    def attach(self, cluster: Any) -> None:
        """Serve `cluster` (launched: its preflight passed) from now on."""
        self.model_name = getattr(self.serve, "served_model_name", None) or cluster.model_name
        self.limits = ModelLimits(
            name=self.model_name, max_model_len=cluster.max_model_len, tokenizer=cluster.tokenizer,
            vocab_size=getattr(cluster, "vocab_size", None),
            max_tokens_default=getattr(self.serve, "max_tokens_default", 256))
        metrics = ServerMetrics(self.model_name)
        metrics.watch_cluster(cluster.stats)
        self.metrics = metrics
        self.cluster = cluster

    @property
    def healthy(self) -> bool:
        return self.cluster is not None and bool(self.cluster.healthy)

    @property
    def degraded(self) -> list[dict]:
        """The cluster's dead instances (`Cluster.degraded`: name, role, why, replaced_by); [] before attach."""
        return list(getattr(self.cluster, "degraded", None) or [])

    def health(self) -> JSONResponse:
        """/health: 200 ``{"status": "ok" | "degraded", "degraded": [...]}`` while some instance
        serves (degraded: some died, the survivors took their work over) or the fleet is being
        rebuilt (then with ``"rebuild"``: its phase, `Cluster.rebuild_phase`; requests queue for
        it); 503 with the dead instances named when none can serve."""
        degraded = self.degraded
        if not self.healthy:
            response = _unavailable()
            return JSONResponse({**response.body(), "degraded": degraded}, status_code=response.status)
        body = {"status": "degraded" if degraded else "ok", "degraded": degraded}
        phase = getattr(self.cluster, "rebuild_phase", None)
        return JSONResponse(body if phase is None else {**body, "rebuild": phase})

    def admit(self) -> None:
        """Count one more request in flight; 503 when no instance is healthy, 429 when full."""
        if not self.healthy:
            raise _unavailable()
        if self.num_in_flight >= self.max_concurrent_requests:
            raise APIError(429, f"the server is at its limit of {self.max_concurrent_requests} requests in "
                           "flight; retry later", type="rate_limit_error", code="too_many_requests")
        self.num_in_flight += 1
        self.metrics.in_flight.set(self.num_in_flight)

    def release(self, generation: Generation) -> None:
        self.num_in_flight -= 1
        self.metrics.in_flight.set(self.num_in_flight)
        self.metrics.record(generation.times, len(generation.prepared.prompt_token_ids))

    def record_failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.record_failure(reason)


def _unavailable() -> APIError:
    return APIError(503, "no healthy instance is serving: the cluster is still launching (preflight not "
                    "passed) or has lost its workers; see /health", type="service_unavailable",
                    code="no_healthy_instance")


def build_app(cluster: Any | None, config: Any = None, *, max_concurrent_requests: int | None = None,
              max_body_bytes: int | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    """The OpenAI-compatible app over a launched cluster (or one still launching).

    Args:
        cluster: a launched `Cluster` (model_name, max_model_len, tokenizer, healthy, stream,
            stats), or None: every route but /health answers 503 until
            `app.state.server.attach(cluster)`.
        config: the `Config` whose `serve` section applies; default `cluster.config`.
        max_concurrent_requests: requests in flight before new ones get 429; default
            serve.max_concurrent_requests when the config has it, else 4096.
        max_body_bytes: largest request body, bytes; default serve.max_body_bytes, else 4 MiB.
        allowed_origins: origins browsers may call the API from (CORS; ["*"]: any); None: no
            CORS headers (vLLM allows every origin by default; here it takes `--allowed-origins`).

    Returns:
        the FastAPI app; `app.state.server` is its `ServerState`.
    """
    if config is None:
        if cluster is None:
            raise ValueError("build_app: give a cluster or a config; got neither")
        config = cluster.config
    serve = config.serve
    max_concurrent_requests = (max_concurrent_requests or getattr(serve, "max_concurrent_requests", None)
                               or DEFAULT_MAX_CONCURRENT_REQUESTS)
    max_body_bytes = max_body_bytes or getattr(serve, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
    state = ServerState(config, max_concurrent_requests)
    if cluster is not None:
        state.attach(cluster)
    app = FastAPI(title="disagg", summary="OpenAI-compatible API of a disaggregated prefill/decode cluster",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    # Added last runs first: the API key is checked before the body is even read; CORS answers a
    # browser's preflight (which carries no key) before that; the catch-all wraps everything.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=resolve_api_key(serve.api_key))
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(CatchAllMiddleware, on_error=state.record_failure)
    _install_error_handlers(app, state)
    _install_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        state.record_failure(exc.code or str(exc.status))
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        state.record_failure("invalid_request")
        return APIError(400, message, param=param, code="invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
        return error.response(exc.headers)  # 405 keeps its Allow header


def _install_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        return state.health()

    @app.get("/metrics")
    def metrics() -> Response:  # sync: FastAPI runs it in a worker thread; cluster.stats() blocks
        if state.metrics is None:
            raise _unavailable()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> Response:  # sync: a worker thread waits for every instance
        """Forget every instance's cached prefixes (vLLM's endpoint; `disagg bench` calls it
        before each run). Guarded by the API key when one is set."""
        if not state.healthy:
            raise _unavailable()
        return JSONResponse({"freed_pages": state.cluster.reset_prefix_cache()})

    @app.get("/v1/models")
    async def models() -> ModelList:
        if state.limits is None:
            raise _unavailable()
        return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.limits.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if not state.healthy:
            raise _unavailable()
        prepared = await asyncio.to_thread(prepare_completion, body, state.limits)  # tokenizes: off the loop
        return await _respond(state, request, body, prepared, "completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if not state.healthy:
            raise _unavailable()
        prepared = await asyncio.to_thread(prepare_chat, body, state.limits)
        return await _respond(state, request, body, prepared, "chat", "chatcmpl")


async def _respond(state: ServerState, request: Request, body: Any, prepared: PreparedRequest,
                   kind: str, id_prefix: str) -> Response:
    """Run one admitted request and answer it (JSON, or SSE when body.stream)."""
    state.admit()
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    generation = Generation(state.cluster, request_id, prepared, state.limits.tokenizer)
    chunks = generation.chunks()
    fmt = ResponseFormat(kind=kind, response_id=request_id, model=state.model_name,
                         prompt_token_ids=prepared.prompt_token_ids,
                         include_usage=body.include_usage(), return_token_ids=body.return_token_ids)
    try:
        if body.stream:
            first = await _until_disconnect(request, anext(chunks))
            return EventStream(sse_events(first, chunks, fmt, _error_body),
                               on_close=lambda: _close(chunks, state, generation),
                               headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        collected = await _until_disconnect(request, _collect(chunks))
        await _close(chunks, state, generation)
        return JSONResponse(fmt.full_response(collected), headers={"X-Request-Id": request_id})
    except ClientGone:
        await _close(chunks, state, generation)
        return Response(status_code=499)
    except Exception as err:
        await _close(chunks, state, generation)
        raise _as_api_error(err) from err
    except BaseException:  # the handler itself was cancelled (server shutting down)
        await _close(chunks, state, generation)
        raise


async def _collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


async def _close(chunks: Any, state: ServerState, generation: Generation) -> None:
    """Close the generation (aborting it on the cluster if unfinished) and count it out, once."""
    if generation.released:
        return
    generation.released = True
    with contextlib.suppress(Exception):
        await chunks.aclose()
    state.release(generation)


class EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: done, client gone, error, or never
    iterated (Starlette may cancel it before its first chunk when the client leaves)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], *, on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(events, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._on_close()


async def _until_disconnect(request: Request, awaitable: Any) -> Any:
    """Await `awaitable` unless the client disconnects first (then cancel it, raise ClientGone)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
        watch.cancel()
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _as_api_error(err: BaseException) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, GenerationFailed):
        return cluster_errors.failed_request_error(str(err), err.finish_reason, err.cause)
    mapped = cluster_errors.to_api_error(err)
    if mapped.status >= 500:
        logger.error("request failed: %s: %s", type(err).__name__, err)
    return mapped


def _error_body(err: BaseException) -> dict:
    return _as_api_error(err).body()
