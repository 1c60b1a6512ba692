"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status.

`APIError` is what route code raises; `app.py` installs handlers that turn it, FastAPI's request
validation errors (malformed JSON, unknown fields, wrong types) and Starlette's HTTP errors
(404, 405) into that shape. `validation_message` names the offending field in the message and
in `param`, as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from disagg.cluster.serve.protocol import ErrorInfo, ErrorResponse

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
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


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
    top = path.split(".")[0].split("[")[0]
    msgs: list[str] = []
    for err in errors:
        err_path = _field_path(err["loc"])
        if err_path.split(".")[0].split("[")[0] == top:
            msg = err["msg"].removeprefix("Value error, ")
            if msg not in msgs:
                msgs.append(msg)
    if first["type"] == "value_error":
        return f"invalid value for '{path}': {msgs[0]}", path
    got = first.get("input")
    got_text = repr(got) if len(repr(got)) <= 80 else type(got).__name__
    return f"invalid value for '{path}': {'; or '.join(msgs[:3])} (got {got_text})", path
