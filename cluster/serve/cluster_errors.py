"""Which HTTP status a cluster-side failure becomes.

Before a stream begins, `Router.submit` (behind `cluster.stream`) raises: `ValueError` for bad
input (400), `ClusterError` "queue is full" when router.max_queue requests already wait (429);
other `ClusterError`s mean the fleet cannot serve (503). Once a request runs, the cluster ends
it with a `StreamDelta` whose `error` says why: an instance died or none is live (503), it timed
out (504), anything else (500). Until the cluster raises distinct classes for these cases, the
queue-full, no-live-instance, timeout and refused-input cases are told apart by their messages.
Used by `app.py`, for the status before a stream and for the in-band error during one.
"""

from __future__ import annotations

import asyncio

from disagg.cluster.serve.errors import APIError
from disagg.errors import ClusterError, OutOfPages

_QUEUE_FULL = ("queue is full", "queuefull", "overloaded")
_NO_INSTANCE = ("no live", "no healthy", "died", "shutting down", "is dead")
_TIMED_OUT = ("timed out", "timeout")
# An instance's engine rejected the request's input at add/reserve (e.g. a token id outside the
# vocabulary, which the server cannot check while the cluster does not expose vocab_size).
_BAD_INPUT = ("refused the request", "prompt_token_ids:")


def _says(err: BaseException, phrases: tuple[str, ...]) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return any(p in text for p in phrases)


def to_api_error(err: BaseException) -> APIError:
    """Map an exception raised by `cluster.stream` (or by the router behind it) to an `APIError`."""
    if isinstance(err, OutOfPages) or _says(err, _QUEUE_FULL):
        return APIError(429, f"the cluster is overloaded: {err}", type="rate_limit_error", code="queue_full")
    if isinstance(err, ClusterError) or _says(err, _NO_INSTANCE):
        return APIError(503, f"no healthy instance can serve the request: {err}", type="service_unavailable",
                        code="no_healthy_instance")
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
        return APIError(504, f"the request timed out on the cluster: {err}", type="timeout", code="timeout")
    if isinstance(err, (ValueError, TypeError)):
        return APIError(400, f"the cluster refused the request: {err}", code="invalid_request")
    return APIError(500, f"the cluster failed the request: {type(err).__name__}: {err}", type="server_error",
                    code="internal_error")


def failed_request_error(message: str, finish_reason: str) -> APIError:
    """The error of a request the cluster ended with `finish_reason` "error" or "abort" and a message."""
    lowered = message.lower()
    if any(p in lowered for p in _BAD_INPUT):
        return APIError(400, message, param="prompt" if "prompt_token_ids" in lowered else None,
                        code="invalid_request")
    if any(p in lowered for p in _TIMED_OUT):
        return APIError(504, message, type="timeout", code="timeout")
    if any(p in lowered for p in _NO_INSTANCE):
        return APIError(503, message, type="service_unavailable", code="no_healthy_instance")
    return APIError(500, message, type="server_error", code=f"request_{finish_reason}")
