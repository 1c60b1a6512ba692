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

Rank pairs (`link_bytes_per_token`): every rank has its own link of ``bytes_per_s``, and a push
from an instance of a ranks into one of b runs every (prefill rank i, decode rank j) pair at once,
each carrying the heads both hold that i writes (`transfer/heads.py`, `routes_of`). A token takes
the time the busiest link needs for its bytes: a prefill rank's egress (the sum of its pairs: its
share of the heads, or more where the decode side replicates a head on several ranks) or a decode
rank's ingress (its own share, each head written once: for a > b, a/b senders fill it). At a = b
that is one rank's share, rank i to rank i. Modelled per push only: the pushes of two prefill
instances into one decode instance at once do not share its ranks' ingress.
Used by `instance.py` only; pure Python (torch only for the empty KV tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np
import torch

from disagg.errors import InvalidArgument
from disagg.transfer.connector import ClosedReservation, KVConnector, KVPoll, KVReceiver, KVSender, RecvDest
from disagg.transfer.heads import kv_heads_of, writer_of


def link_bytes_per_token(src_bytes: float, src_ranks: int, dst_bytes: float, dst_ranks: int,
                         num_kv_heads: int | None = None) -> float:
    """KV bytes per token on the busiest link of a push from an instance of ``src_ranks`` ranks,
    each holding ``src_bytes`` per token (its heads, all layers), into one of ``dst_ranks`` ranks
    holding ``dst_bytes`` each (module docstring: rank pairs).

    ``num_kv_heads``: the model's KV heads; None infers them from the two shares (exact unless
    both sides replicate heads, which is then priced as if the narrower side did not).

    Raises:
        ValueError: a share or rank count not above 0, or heads that do not shard over the ranks.
    """
    if not (src_bytes > 0 and dst_bytes > 0 and src_ranks >= 1 and dst_ranks >= 1):
        raise ValueError(f"link_bytes_per_token: expected shares > 0 bytes and ranks >= 1, got {src_bytes} B x "
                         f"{src_ranks} ranks -> {dst_bytes} B x {dst_ranks} ranks")
    if src_ranks == dst_ranks:
        return float(src_bytes)  # rank i to rank i: one share per link
    heads = num_kv_heads or _kv_heads(src_bytes, src_ranks, dst_bytes, dst_ranks)
    head_bytes = dst_bytes / len(kv_heads_of(heads, dst_ranks, 0))
    egress = [0] * src_ranks  # heads each prefill rank writes, over all its pairs
    for j in range(dst_ranks):
        for head in kv_heads_of(heads, dst_ranks, j):
            egress[writer_of(head, heads, src_ranks)] += 1
    ingress = len(kv_heads_of(heads, dst_ranks, 0))  # every decode rank: its own heads, once each
    return max(max(egress), ingress) * head_bytes


def _kv_heads(src_bytes: float, src_ranks: int, dst_bytes: float, dst_ranks: int) -> int:
    """The model's KV heads as two shares imply them: where both sides hold the same bytes in all
    (no head replicated) any multiple of both rank counts prices alike, their least one; else the
    side with fewer bytes in all holds each head once, the other one head a rank."""
    src_total, dst_total = src_bytes * src_ranks, dst_bytes * dst_ranks
    if math.isclose(src_total, dst_total, rel_tol=1e-6):
        return math.lcm(src_ranks, dst_ranks)
    return max(1, round(min(src_total, dst_total) / min(src_bytes, dst_bytes)))


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
        bytes_per_token: KV bytes of one token on one rank (its heads, all layers).
        bytes_per_s: each rank's link bandwidth.
        link_bytes: per destination PE, the bytes per token on the busiest link of a push there
            (`link_bytes_per_token`); a PE absent: ``bytes_per_token`` (the same TP both sides).
    """

    def __init__(self, clock: Callable[[], float], bytes_per_token: float, bytes_per_s: float,
                 link_bytes: Mapping[int, float] | None = None) -> None:
        super().__init__()
        self.clock = clock
        self.bytes_per_token = bytes_per_token
        self.bytes_per_s = bytes_per_s
        self.link_bytes = dict(link_bytes or {})
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
        pes = np.concatenate([plan.push_pes[plan.push_slots >= 0], plan.copy_pes])
        num_tokens = len(pes)
        if num_tokens:
            self.free_at = max(start_s, self.free_at) + self._bytes(pes) / self.bytes_per_s
        done_at = max(end_s, self.free_at)
        for seq_id, complete in zip(plan.send_seq_ids.tolist(), plan.send_complete.tolist()):
            if complete:
                self._dests.pop(seq_id).ticket.at = done_at
        self.num_pushed_tokens += num_tokens
        return num_tokens, Done(done_at, self.clock)

    def _bytes(self, pes: np.ndarray) -> float:
        """The busiest link's bytes for tokens going to ``pes`` (one receiver PE per token)."""
        if not self.link_bytes:
            return len(pes) * self.bytes_per_token
        targets, counts = np.unique(pes, return_counts=True)
        return sum(int(n) * self.link_bytes.get(int(pe), self.bytes_per_token) for pe, n in zip(targets, counts))

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
    """One simulated instance's connector: an empty KV tensor, a `SimSender` over its links
    (``link_bytes``: `SimSender`'s) and a `SimReceiver` (PE ``pe``)."""

    backend = "sim"

    def __init__(self, pe: int, clock: Callable[[], float], bytes_per_token: float, bytes_per_s: float,
                 link_bytes: Mapping[int, float] | None = None) -> None:
        self.pe = pe
        self._sender = SimSender(clock, bytes_per_token, bytes_per_s, link_bytes)
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
