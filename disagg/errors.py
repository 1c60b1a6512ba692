"""Project exception types.

Every error that disagg raises on purpose derives from `DisaggError`, so a caller can catch the
project's errors apart from bugs. Errors caused by bad caller input also derive from the matching
builtin (`ValueError`, `TypeError`) so generic handlers keep working. Imported by every layer;
imports nothing.
"""

from __future__ import annotations


class DisaggError(Exception):
    """Base class of every error raised on purpose by disagg.

    Errors pickle with their attributes (keyword-only constructor arguments included), so they
    cross process boundaries (Ray actors) intact.
    """

    def __reduce__(self):
        return (_restore_error, (type(self), self.args, self.__dict__))


def _restore_error(cls: type, args: tuple, state: dict) -> DisaggError:
    """Unpickle a `DisaggError` without calling its constructor (see `DisaggError.__reduce__`)."""
    for base in cls.__mro__:  # the builtin base that lays out the object (OSError for timeouts)
        if base.__module__ == "builtins":
            try:
                err = base.__new__(cls)
                break
            except TypeError:
                continue
    err.args = args
    err.__dict__.update(state)
    return err


class ConfigError(DisaggError, ValueError):
    """A configuration value is invalid; the message names the field path."""


class CacheError(DisaggError, ValueError):
    """A page-table operation was misused (bad id, length, batch or map). State is unchanged."""


class SequenceNotFound(CacheError):
    """The sequence id is not in the cache."""


class SequenceExists(CacheError):
    """The sequence id is already in the cache."""


class ForwardStateError(CacheError):
    """begin_forward/end_forward called out of order (a forward is open, or none is)."""


class PositionMapError(CacheError):
    """A compressed position map is malformed or does not cover the tokens it must."""


class OutOfPages(DisaggError, RuntimeError):
    """The cache has too few free pages for the request. State is unchanged; callers queue or preempt.

    Attributes:
        num_needed: pages the operation needed.
        num_free: pages free when it was refused.
    """

    def __init__(self, message: str, *, num_needed: int, num_free: int) -> None:
        super().__init__(message)
        self.num_needed = num_needed
        self.num_free = num_free


class HeapError(DisaggError, RuntimeError):
    """A symmetric-heap operation failed (bootstrap, collective mismatch, closed heap, timeout)."""


class TransferError(DisaggError, RuntimeError):
    """Moving one request's KV from a source PE to a destination PE failed.

    Attributes:
        request_id: the request (sequence) whose KV was being moved, or None for heap-wide work.
        src_pe: the sending PE.
        dst_pe: the receiving PE.
    """

    def __init__(self, message: str, *, request_id: int | str | None, src_pe: int, dst_pe: int) -> None:
        super().__init__(f"{message} (request {request_id}, PE {src_pe} -> PE {dst_pe})")
        self.request_id = request_id
        self.src_pe = src_pe
        self.dst_pe = dst_pe


class SignalTimeout(TransferError, TimeoutError):
    """A wait on a doorbell word did not see the expected value before its timeout."""


class CacheIntegrityError(DisaggError, RuntimeError):
    """The page-table bookkeeping broke one of its invariants (a bug, not caller misuse)."""


class ClusterError(DisaggError, RuntimeError):
    """Launching or running the Ray cluster failed (placement, bootstrap, an instance died)."""


class PreflightError(ClusterError):
    """The fleet failed a check before its first request (geometry, weights, pages, reachability)."""


class QueueFull(ClusterError):
    """The router's queue already holds router.max_queue requests; nothing was queued. Retry later."""


class NoLiveInstance(ClusterError):
    """No live instance can take the request (none of a role is left, or the cluster is shutting down).

    Attributes:
        role: the role with no live instance ("prefill", "decode", "colocated"), or None when the
            whole cluster is stopping.
    """

    def __init__(self, message: str, *, role: str | None = None) -> None:
        super().__init__(message)
        self.role = role


class InstanceDied(ClusterError):
    """The instance holding a request died (its actor exited or its engine failed).

    Attributes:
        instance: the dead instance's name ("decode-0").
        reason: why it is considered dead.
    """

    def __init__(self, message: str, *, instance: str, reason: str) -> None:
        super().__init__(message)
        self.instance = instance
        self.reason = reason


class InvalidArgument(DisaggError, ValueError):
    """An engine call's argument the engine refuses; the message starts with ``argument``.

    Attributes:
        argument: the argument at fault ("prompt_token_ids", "dest", "max_tokens", ...): the
            router reports it without parsing the message (`RequestRefused.argument`).
    """

    def __init__(self, message: str, *, argument: str) -> None:
        super().__init__(message)
        self.argument = argument


class InvalidArgumentType(InvalidArgument, TypeError):
    """`InvalidArgument` for an argument of the wrong type (also a TypeError)."""


class RequestRefused(ClusterError, ValueError):
    """An instance's engine refused the request's input (e.g. a token id outside the vocabulary).

    Attributes:
        instance: the refusing instance's name.
        argument: the engine argument at fault (`InvalidArgument.argument`: "prompt_token_ids",
            "max_tokens", ...), or None when the engine named none.
    """

    def __init__(self, message: str, *, instance: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.instance = instance
        self.argument = argument


class RequestTimedOut(ClusterError, TimeoutError):
    """A request ran past router.request_timeout_s and was aborted.

    Attributes:
        timeout_s: the limit, seconds.
        stage: where the request was when it timed out ("queued", "decoding", ...).
    """

    def __init__(self, message: str, *, timeout_s: float, stage: str) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s
        self.stage = stage
