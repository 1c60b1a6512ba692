"""Which HTTP status a cluster-side failure becomes, decided by the error's type (`disagg.errors`).

Before a stream begins, `cluster.stream` raises: `ValueError` for bad input (400), `QueueFull`
when router.max_queue requests already wait (429), `NoLiveInstance` when the cluster is shut down
(503). Once a request runs, the cluster ends it with a `StreamDelta` whose typed ``cause`` says
why: `RequestRefused` (an engine refused the input, e.g. a token id outside the vocabulary: 400
naming the field), `NoLiveInstance` / `InstanceDied` (503), `RequestTimedOut` (504), a
`TransferError` such as a lease expiry (500), anything else (500). Used by `app.py`, for the
status before a stream and for the in-band error during one.
"""

from __future__ import annotations

import asyncio

from disagg.cluster.serve.errors import APIError
from disagg.errors import (ClusterError, InstanceDied, NoLiveInstance, OutOfPages, QueueFull, RequestRefused,
                           RequestTimedOut, TransferError)

# The engine argument a `RequestRefused` names -> the request field a client sent it as.
_PARAM_OF_ARGUMENT = {"prompt_token_ids": "prompt", "prompt_len": "prompt", "max_tokens": "max_tokens",
                      "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
                      "stop_token_ids": "stop"}


def to_api_error(err: BaseException, message: str | None = None) -> APIError:
    """Map an error raised by `cluster.stream` (or carried by its last delta) to an `APIError`.

    Args:
        err: the exception; its type decides the status.
        message: the client-facing message; default: a sentence built from ``err``.
    """
    if isinstance(err, (QueueFull, OutOfPages)):
        return APIError(429, message or f"the cluster is overloaded: {err}", type="rate_limit_error",
                        code="queue_full")
    if isinstance(err, (NoLiveInstance, InstanceDied)):
        return APIError(503, message or f"no healthy instance can serve the request: {err}",
                        type="service_unavailable", code="no_healthy_instance")
    if isinstance(err, RequestRefused):
        return APIError(400, message or f"the cluster refused the request: {err}",
                        param=_PARAM_OF_ARGUMENT.get(err.argument), code="invalid_request")
    if isinstance(err, TransferError):
        return APIError(500, message or f"the request's KV transfer failed: {err}", type="server_error",
                        code="kv_transfer_failed")
    if isinstance(err, (RequestTimedOut, asyncio.TimeoutError, TimeoutError)):
        return APIError(504, message or f"the request timed out on the cluster: {err}", type="timeout",
                        code="timeout")
    if isinstance(err, (ValueError, TypeError)):
        return APIError(400, message or f"the cluster refused the request: {err}", code="invalid_request")
    code = "cluster_error" if isinstance(err, ClusterError) else "internal_error"
    return APIError(500, message or f"the cluster failed the request: {type(err).__name__}: {err}",
                    type="server_error", code=code)


def failed_request_error(message: str, finish_reason: str, cause: BaseException | None) -> APIError:
    """The error of a request the cluster ended with `finish_reason` "error" or "abort".

    Args:
        message: what the client is told (the cluster's text).
        finish_reason: the cluster's finish reason.
        cause: the delta's typed cause, or None (then a 500 with code ``request_<finish_reason>``).
    """
    if cause is None:
        return APIError(500, message, type="server_error", code=f"request_{finish_reason}")
    return to_api_error(cause, message)
