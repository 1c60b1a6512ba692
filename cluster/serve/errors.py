"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status.

`APIError` is what route code raises; `app.py` installs handlers that turn it, FastAPI's request
validation errors (malformed JSON, unknown fields, wrong types) and Starlette's HTTP errors
(404, 405) into that shape, and `CatchAllMiddleware` (outermost) turns any other exception into a
500 in that shape, so no client ever gets a plain-text body. `validation_message` names the
offending field in the message and in `param`, as OpenAI does.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from disagg.cluster.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Tags pydantic puts in an error's `loc` for the member of a union it tried; not field names.
_UNION_TAG_CHARS = ("[", "-")
_SCALAR_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's JSON error body.

    Attributes:
        status: HTTP status code.
        message: what went wrong, naming the field, expected and got.
        type: OpenAI's error type (`invalid_request_error`, `authentication_error`, ...).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = _encodable(message)
        self.type = type
        self.param = None if param is None else _encodable(param)
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _encodable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a client's lone surrogate, echoed) as a backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class CatchAllMiddleware:
    """The last resort: an exception no handler took becomes a 500 in OpenAI's shape, logged once.

    Outermost of the app's middleware. When the response has already begun (a stream), nothing
    can be answered any more: the exception goes on to uvicorn, which closes the connection.

    Args:
        app: the wrapped ASGI app.
        on_error: called with the failure reason ("internal_error") for the metrics.
    """

    def __init__(self, app: ASGIApp, on_error: Callable[[str], None] | None = None) -> None:
        self.app = app
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, send_tracking)
        except Exception as err:
            if started:
                raise
            logger.exception("%s %s failed: %s: %s", scope.get("method"), scope.get("path"), type(err).__name__, err)
            if self._on_error is not None:
                self._on_error("internal_error")
            error = APIError(500, f"internal server error: {type(err).__name__}: {err}", type="server_error",
                             code="internal_error")
            await error.response()(scope, receive, send)


def _field_path(loc: tuple | list) -> str:
    """Dotted path of a pydantic error location, without 'body' and union member tags."""
    parts: list[str] = []
    for item in loc:
        if item == "body":
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        if item in _SCALAR_TAGS or any(c in item for c in _UNION_TAG_CHARS):
            continue
        parts.append(("." if parts else "") + item)
    return "".join(parts)


def _top_field(path: str) -> str:
    return path.split(".")[0].split("[")[0]


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic/FastAPI validation errors into (message, param) naming the first bad field.

    Args:
        errors: `exc.errors()` of a `RequestValidationError` or `ValidationError`.

    Returns:
        (message, param): param is the dotted path of the field (e.g. `messages[0].role`), or
        None when the body itself is unreadable.
    """
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "not valid JSON")
        return f"request body is not valid JSON: {detail}", None
    path = _field_path(first["loc"])
    if not path:
        got = type(first.get("input")).__name__
        return f"request body must be a JSON object; got {got}", None
    if first["type"] == "extra_forbidden":
        return f"unknown field '{path}': this server does not accept it (check its spelling)", path
    if first["type"] == "missing":
        return f"missing required field '{path}'", path
    top = _top_field(path)
    same_field = [err for err in errors if _top_field(_field_path(err["loc"])) == top]
    refusals = [err for err in same_field if err["type"] == "value_error"]
    if refusals:  # a validator's own sentence beats the type mismatches of a union's other members
        path = _field_path(refusals[0]["loc"])
        return f"invalid value for '{path}': {refusals[0]['msg'].removeprefix('Value error, ')}", path
    msgs: list[str] = []
    for err in same_field:
        if err["msg"] not in msgs:
            msgs.append(err["msg"])
    got = first.get("input")
    got_text = repr(got) if len(repr(got)) <= 80 else type(got).__name__
    return f"invalid value for '{path}': {'; or '.join(msgs[:3])} (got {got_text})", path
