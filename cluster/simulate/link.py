"""A KV connector on the virtual clock: pushes take the link's time, reservations land by it.

The simulated instances (`instance.py`) are `EngineCore`s; this is the connector each holds in
place of a symmetric heap's (`disagg.transfer.connector`'s interface, backend ``"sim"``). No
byte moves: what is simulated is when.

    sender (prefill side)                      receiver (decode side)
    attach(seq_id, dest)                       reserve(request_id, cmap) -> RecvDest whose
    push(plan, start_s, end_s): the forward's     ticket is a `Landing` (at infinity)
      pushed tokens go over this instance's    poll(): LANDED once the clock reaches the
      link after the pushes before them; a        landing (no lease expires: the simulator
      dest whose last token it writes lands       models no failures)
      at max(forward end, link free)

A link carries one forward's tokens after the other at ``bytes_per_s``, from the forward's start
(layer by layer beside it); the forward's pushes are done, and its completed destinations land,
no earlier than the forward's end. A push's `Completion` is the clock reaching that time, so the
engine frees a pushed prompt's pages (`KVSender.poll_retired`) at its first step after it.
Used by `instance.py` only; pure Python (torch only for the empty KV tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

from disagg.errors import InvalidArgument
from disagg.transfer.connector import ClosedReservation, KVConnector, KVPoll, KVReceiver, KVSender, RecvDest


@dataclass
class Landing:
    """`RecvDest.ticket` of a simulated reservation: when its KV has landed (virtual seconds;
    infinity until the forward that pushes its last token is launched)."""

    at: float = math.inf


@dataclass(frozen=True)
class Done:
    """A `Completion` on the virtual clock: done once ``clock() >= at``."""

    at: float
    clock: Callable[[], float]

    def query(self) -> bool:
        return self.clock() >= self.at


class SimSender(KVSender):
    """The sending side over one link (module docstring).

    Args:
        clock: the fleet's virtual clock.
        bytes_per_token: KV bytes of one token (all layers).
        bytes_per_s: the link's bandwidth.
    """

    def __init__(self, clock: Callable[[], float], bytes_per_token: float, bytes_per_s: float) -> None:
        super().__init__()
        self.clock = clock
        self.bytes_per_token = bytes_per_token
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0  # when the link has sent everything pushed so far
        self.num_pushed_tokens = 0
        self._dests: dict[int, RecvDest] = {}

    def attach(self, seq_id: int, dest: RecvDest) -> None:
        self._dests[seq_id] = dest

    def detach(self, seq_id: int) -> None:
        self._dests.pop(seq_id, None)

    def fence(self) -> Done | None:
        return Done(self.free_at, self.clock) if self.free_at > self.clock() else None

    def push(self, plan, start_s: float, end_s: float) -> tuple[int, Done]:
        """Send a forward's KV (``plan``'s pushed and copied tokens), the forward running from
        ``start_s`` to ``end_s``; land the destinations it completes. Returns the tokens sent and
        when they are all done."""
        num_tokens = int(np.count_nonzero(plan.push_slots >= 0)) + len(plan.copy_remote_slots)
        if num_tokens:
            self.free_at = max(start_s, self.free_at) + num_tokens * self.bytes_per_token / self.bytes_per_s
        done_at = max(end_s, self.free_at)
        for seq_id, complete in zip(plan.send_seq_ids.tolist(), plan.send_complete.tolist()):
            if complete:
                self._dests.pop(seq_id).ticket.at = done_at
        self.num_pushed_tokens += num_tokens
        return num_tokens, Done(done_at, self.clock)

    # The simulated runner sends a whole forward with `push`; the model's per-layer hooks never run.
    def begin_forward(self, plan) -> None:
        raise NotImplementedError("the simulated runner sends a forward's KV with SimSender.push")

    def save_layer(self, layer: int, k: Any, v: Any, *, k_scale: Any = None, v_scale: Any = None) -> None:
        raise NotImplementedError("the simulated runner sends a forward's KV with SimSender.push")

    def end_forward(self) -> Done | None:
        raise NotImplementedError("the simulated runner sends a forward's KV with SimSender.push")

    def can_save_written(self, plan) -> bool:
        return False

    def save_written(self, plan) -> Done | None:
        raise NotImplementedError("the simulated runner sends a forward's KV with SimSender.push")


class SimReceiver(KVReceiver):
    """The receiving side: reservations that land when their `Landing` says (module docstring)."""

    def __init__(self, pe: int, clock: Callable[[], float]) -> None:
        self.pe = pe
        self.clock = clock
        self.lease_s = math.inf
        self.num_landed = self.num_cancelled = 0
        self.wait_s = 0.0
        self._open: dict[Hashable, tuple[Landing, float]] = {}  # request id -> (its landing, reserved at)
        self._quarantined: dict[Hashable, Any] = {}

    def reserve(self, request_id: Hashable, cmap: Sequence[int], *, num_cached_tokens: int = 0) -> RecvDest:
        landing = Landing()
        self._open[request_id] = (landing, self.clock())
        return RecvDest(request_id, list(cmap), self.pe, landing, num_cached_tokens)

    def state(self, request_id: Hashable) -> KVPoll:
        landing, _ = self._open[request_id]
        return KVPoll.LANDED if self.clock() >= landing.at else KVPoll.WAITING

    def poll(self) -> list[ClosedReservation]:
        now = self.clock()
        closed = []
        for request_id, (landing, reserved_at) in list(self._open.items()):
            if now >= landing.at:
                del self._open[request_id]
                self.num_landed += 1
                self.wait_s += now - reserved_at
                closed.append(ClosedReservation(request_id, KVPoll.LANDED, now - reserved_at,
                                                self._quarantined.pop(request_id, None)))
        return closed

    def cancel(self, dest: RecvDest) -> Any:
        entry = self._open.get(dest.request_id)
        if entry is None or entry[0] is not dest.ticket:
            raise InvalidArgument(f"dest: request {dest.request_id!r} has no open reservation here", argument="dest")
        del self._open[dest.request_id]
        self.num_cancelled += 1
        return self._quarantined.pop(dest.request_id, None)

    def quarantine(self, request_id: Hashable, handle: Any) -> None:
        self._quarantined[request_id] = handle

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def reserved_ids(self) -> set[Hashable]:
        return set(self._open)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantined)


class SimConnector(KVConnector):
    """One simulated instance's connector: an empty KV tensor, a `SimSender` over its link and a
    `SimReceiver` (PE ``pe``)."""

    backend = "sim"

    def __init__(self, pe: int, clock: Callable[[], float], bytes_per_token: float, bytes_per_s: float) -> None:
        self.pe = pe
        self._sender = SimSender(clock, bytes_per_token, bytes_per_s)
        self._receiver = SimReceiver(pe, clock)

    def alloc_kv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def check_dest(self, request_id: Hashable, dest: RecvDest) -> None:
        if not isinstance(dest.ticket, Landing):
            raise InvalidArgument(f"dest.ticket: request {request_id!r}: expected a simulated reservation's "
                                  f"Landing, got {type(dest.ticket).__name__}", argument="dest.ticket")

    @property
    def sender(self) -> SimSender:
        return self._sender

    @property
    def receiver(self) -> SimReceiver:
        return self._receiver
