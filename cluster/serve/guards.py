"""The server's guards, as ASGI middleware: the API key on /v1 routes and the request body size limit.

Both answer before the route runs (so an unauthenticated or oversize request is never parsed),
in OpenAI's error shape. `ApiKeyMiddleware` wants `Authorization: Bearer <key>` on every path
under /v1 (compared in constant time); /health and /metrics stay open, as vLLM's are.
`BodyLimitMiddleware` refuses a body over the limit with 413, by its Content-Length or, for a
chunked body, as soon as the bytes read pass the limit; it replays the body it read to the app.
"""

from __future__ import annotations

import hmac
import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from disagg.cluster.serve.errors import APIError

API_KEY_ENV = "DISAGG_API_KEY"
PROTECTED_PREFIXES = ("/v1", "/reset_prefix_cache")  # what an API key guards: serving and state changes


def resolve_api_key(configured: str | None) -> str | None:
    """The key to require: `serve.api_key`, else the DISAGG_API_KEY environment variable, else None."""
    return configured or os.environ.get(API_KEY_ENV) or None


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>` is sent on a /v1 route.

    Args:
        app: the wrapped ASGI app.
        api_key: the required key; None disables the check.
    """

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._key is None or scope["type"] != "http" or not _route_path(scope).startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if not header:
            error = APIError(401, "no API key provided: send 'Authorization: Bearer <key>' (the server's "
                             "serve.api_key or DISAGG_API_KEY)", code="invalid_api_key")
        elif scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            error = APIError(401, "incorrect API key provided", code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the routes see: uvicorn puts `--root-path` in front of it (as Starlette strips it)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BodyLimitMiddleware:
    """413 when a request body is larger than `max_body_bytes`.

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: the largest body accepted, bytes.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(int(length)).response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._too_large(size, streamed=True).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self, size: int, streamed: bool = False) -> APIError:
        got = f"more than {self.max_body_bytes}" if streamed else str(size)
        return APIError(413, f"request body too large: the limit is {self.max_body_bytes} bytes, got "
                        f"{got} bytes", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out `body` once, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
