"""Which HTTP status a cluster-side exception becomes.

The router raises when it cannot take a request: its bounded queue is full (429), no healthy
instance remains (503), the request timed out (504), or the input is bad (400). Everything
else is a 500 whose message says what failed. Used by `app.py` for errors raised before a
stream begins and, in-band, for errors raised during one.
"""

from __future__ import annotations

import asyncio

from disagg.cluster.serve.errors import APIError
from disagg.errors import OutOfPages


def to_api_error(err: BaseException) -> APIError:
    """Map an exception from `cluster.stream` (or the router behind it) to an `APIError`."""
    name = type(err).__name__
    if isinstance(err, OutOfPages) or "QueueFull" in name or "Overloaded" in name:
        return APIError(429, f"the cluster is overloaded ({err}); retry later", type="rate_limit_error",
                        code="queue_full")
    if "NoHealthy" in name or "Unavailable" in name or "Shutdown" in name:
        return APIError(503, f"no healthy instance can serve the request: {err}", type="service_unavailable",
                        code="no_healthy_instance")
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
        return APIError(504, f"the request timed out on the cluster: {err}", type="timeout", code="timeout")
    if isinstance(err, (ValueError, TypeError)):
        return APIError(400, f"the cluster refused the request: {err}", code="invalid_request")
    return APIError(500, f"the cluster failed the request: {name}: {err}", type="server_error",
                    code="internal_error")
