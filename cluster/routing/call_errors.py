"""What a failed actor call of the router means: the typed error a request ends with, the line
a dead actor is logged with, and the reason each ending is counted under.

The router (`disagg.cluster.routing.router`) calls these on its event loop when an actor call
raises: `RayTaskError` (the engine raised: `cause_of` unwraps it; `refusal_error` types a
refused request) or `RayActorError` (the actor is gone: `death_reason`), and when an engine
ends a request on its own with an error (`engine_ended_error`). `failure_reason` names
the counters of `Router.snapshot` (``aborts``, ``failures``) and the ``reason`` label of
their `/metrics` families.
"""

from __future__ import annotations

import re

import ray

from disagg.cluster.launch.instance import Instance
from disagg.cluster.routing.requests import RoutedRequest, Stage
from disagg.errors import ClusterError, DisaggError, RequestRefused, SignalTimeout, TransferError
from disagg.transfer.verify import DIGEST_MISMATCH


def failure_reason(error: BaseException | None) -> str:
    """The reason an abort or failure is counted under: its error type in snake case
    (``RequestTimedOut`` -> ``request_timed_out``), ``caller`` for an abort without one."""
    if error is None:
        return "caller"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()


def refusal_error(inst: Instance, message: str, cause: BaseException) -> ClusterError:
    """The error of a request ``inst``'s engine did not accept: `RequestRefused` for bad input
    (the engine's ValueError/TypeError; `InvalidArgument` names the argument at fault)."""
    if isinstance(cause, (ValueError, TypeError)):
        return RequestRefused(message, instance=inst.name, argument=getattr(cause, "argument", None))
    return ClusterError(message)


def cause_of(err: ray.exceptions.RayTaskError) -> BaseException:
    """What the actor's method raised (the error itself when Ray kept no cause)."""
    cause = getattr(err, "cause", None)
    return cause if cause is not None else err


def death_reason(err: ray.exceptions.RayActorError) -> str:
    """The reason an instance whose actor is gone died, as `InstanceDied` and the log give it."""
    text = str(err).strip().splitlines()
    return f"its actor exited ({type(err).__name__}: {text[0] if text else 'no detail'})"


def engine_ended_error(req: RoutedRequest, inst: Instance, reason: str | None, error: str | None) -> DisaggError:
    """The typed error of a request ``inst``'s engine ended on its own. A decode engine ends a
    request whose pages failed their digest check (`transfer.verify`) with a `TransferError`,
    and one whose first token has not come (still "prefilling") otherwise only when its lease
    expires: the KV never landed."""
    message = error or f"{inst.name} ended the request (finish_reason {reason})"
    if inst is req.decode and req.prefill is not None and message.startswith(DIGEST_MISMATCH):
        return TransferError(message, request_id=req.request_id, src_pe=req.prefill.pe, dst_pe=inst.pe)
    if req.stage == Stage.PREFILLING and inst is req.decode and reason == "error":
        return SignalTimeout(message, request_id=req.request_id, src_pe=req.prefill.pe, dst_pe=inst.pe)
    return ClusterError(message)
