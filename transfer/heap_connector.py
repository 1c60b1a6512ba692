"""The KV connector of the symmetric-heap backends (``nvshmem``, ``shm``).

Both backends share one design over `SymmetricHeap` (`heap.py`): the KV tensor is a symmetric
allocation, so a sender writes a receiver's pages through a peer view (or segment puts) of the
same tensor; completion is a doorbell word in the receiver's symmetric memory (`doorbell.py`),
set after a system-scope fence, so the receiver learns that the KV landed by reading its own
memory. `HeapSender` is the `KVPusher` (fused append+push per layer on a transfer stream) plus
the abort fence; `HeapReceiver` is the doorbell table plus the leases (`lease.py`).
`HeapConnector` is what the registry returns for both backends (`registry.py`). Runs in every
worker process; `KVPusher` (torch and the Triton kernels) is imported when the sender is built.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

from disagg.errors import InvalidArgument
from disagg.transfer.connector import (ClosedReservation, Completion, KVConnector, KVPoll, KVReceiver, KVSender,
                                       RecvDest)
from disagg.transfer.doorbell import DoorbellTable
from disagg.transfer.heap import SymmetricHeap
from disagg.transfer.lease import Lease, LeaseBook

if TYPE_CHECKING:
    import torch

    from disagg.plan import ForwardPlan
    from disagg.transfer.pusher import KVPusher

logger = logging.getLogger(__name__)


class HeapSender(KVSender):
    """`KVSender` over a `KVPusher`: the destination's ticket is its doorbell.

    Args:
        heap: this PE's heap.
        kv: ``[num_layers, num_pages, 2, H_kv, P, D]`` from ``heap.alloc``.
        force_segment_puts, append_on_caller_stream: `KVPusher`'s.
    """

    def __init__(self, heap: SymmetricHeap, kv: torch.Tensor, *, force_segment_puts: bool = False,
                 append_on_caller_stream: bool = False) -> None:
        super().__init__()
        from disagg.transfer.pusher import KVPusher

        self.heap = heap
        self.pusher: KVPusher = KVPusher(heap, kv, force_segment_puts=force_segment_puts,
                                         append_on_caller_stream=append_on_caller_stream)
        # Per layer on the hot path: bound once.
        self._push_layer = self.pusher.push_layer_async
        self._wait_layer = self.pusher.wait_layer

    def attach(self, seq_id: int, dest: RecvDest) -> None:
        self.pusher.attach_doorbell(seq_id, dest.ticket)

    def detach(self, seq_id: int) -> None:
        self.pusher.detach_doorbell(seq_id)

    def fence(self) -> Completion | None:
        """An event after every push issued so far (None on the CPU: the shm pushes ran inline).

        On CUDA the current stream already waits for each forward's transfer streams (`KVPusher.
        end_forward`); a quiet completes the segment puts to peers without load/store access.
        """
        if not self.pusher.kv.is_cuda:
            return None
        import torch

        self.heap.quiet_async()
        event = torch.cuda.Event()
        event.record()
        return event

    def begin_forward(self, plan: ForwardPlan) -> None:
        self.pusher.begin_forward(plan)

    def save_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                   k_scale: Any = None, v_scale: Any = None) -> None:
        """One fused append+push launch on the transfer stream, then the current stream waits for
        the local pages (`KVPusher.push_layer_async`, `KVPusher.wait_layer`)."""
        self._push_layer(layer, k, v, k_scale=k_scale, v_scale=v_scale)
        self._wait_layer(layer)

    def end_forward(self) -> Completion | None:
        return self.pusher.end_forward()

    def can_save_written(self, plan: ForwardPlan) -> bool:
        return self.pusher.can_push_written(plan)

    def save_written(self, plan: ForwardPlan) -> Completion | None:
        return self.pusher.push_written(plan)


class HeapReceiver(KVReceiver):
    """`KVReceiver` over this PE's doorbell words, each reservation under a lease.

    Args:
        heap: this PE's heap (its signal words are the doorbells).
        lease_s: seconds a reservation waits for its ring.
        clock: monotonic clock of the leases (tests pass a fake one).
    """

    def __init__(self, heap: SymmetricHeap, lease_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pe = heap.rank
        self.doorbells = DoorbellTable(heap)
        self.leases = LeaseBook(self.doorbells, lease_s, clock)
        self.num_landed = 0
        self.num_cancelled = 0
        self.wait_s = 0.0

    @property
    def lease_s(self) -> float:
        return self.leases.lease_s

    @property
    def clock(self) -> Callable[[], float]:
        return self.leases.clock

    @property
    def num_armed(self) -> int:
        """Doorbell words armed (one per open reservation)."""
        return self.doorbells.num_armed

    def reserve(self, request_id: Hashable, cmap: Sequence[int], *, num_cached_tokens: int = 0) -> RecvDest:
        ticket = self.doorbells.arm(request_id)
        self.leases.open(request_id, ticket)
        return RecvDest(request_id, [int(x) for x in cmap], self.pe, ticket, num_cached_tokens=num_cached_tokens)

    def state(self, request_id: Hashable) -> KVPoll:
        lease = self.leases.get(request_id)
        if lease is None:
            raise KeyError(f"request {request_id!r} has no open reservation on PE {self.pe}")
        if self.doorbells.is_rung(lease.ticket):
            return KVPoll.LANDED
        return KVPoll.EXPIRED if self.clock() >= lease.deadline else KVPoll.WAITING

    def poll(self) -> list[ClosedReservation]:
        if not len(self.leases):
            return []
        rung, expired = self.leases.poll()
        now = self.clock()
        closed = []
        for lease in rung:
            waited = self._waited(lease, now)
            self.num_landed += 1
            self.wait_s += waited
            closed.append(ClosedReservation(lease.request_id, KVPoll.LANDED, waited, lease.handle))
        for lease in expired:
            reason = (f"lease expired: the KV of request {lease.request_id!r} did not land within "
                      f"{self.lease_s} s (doorbell word {lease.ticket.index} on PE {lease.ticket.pe})")
            closed.append(ClosedReservation(lease.request_id, KVPoll.EXPIRED, self._waited(lease, now),
                                            lease.handle, reason))
        return closed

    def _waited(self, lease: Lease, now: float) -> float:
        return max(0.0, now - (lease.deadline - self.lease_s))

    def cancel(self, dest: RecvDest) -> Any:
        lease = self.leases.get(dest.request_id)
        if lease is None:
            raise InvalidArgument(f"dest: request {dest.request_id!r} has no open reservation on PE {self.pe}",
                                  argument="dest")
        if lease.ticket != dest.ticket:
            ticket = dest.ticket
            raise InvalidArgument(f"dest.ticket: request {dest.request_id!r}'s open reservation waits on doorbell "
                                  f"word {lease.ticket.index} epoch {lease.ticket.epoch}, got word "
                                  f"{getattr(ticket, 'index', ticket)} epoch {getattr(ticket, 'epoch', '?')} "
                                  f"(an earlier reservation under the same id)", argument="dest.ticket")
        self.leases.cancel(dest.request_id)
        self.num_cancelled += 1
        return lease.handle

    def quarantine(self, request_id: Hashable, handle: Any) -> None:
        self.leases.quarantine(request_id, handle)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self.leases

    def __len__(self) -> int:
        return len(self.leases)

    def reserved_ids(self) -> set[Hashable]:
        return self.leases.ids()

    @property
    def num_quarantined(self) -> int:
        return self.leases.num_quarantined


class HeapConnector(KVConnector):
    """`KVConnector` of one PE of a symmetric heap; the registry's for ``nvshmem`` and ``shm``.

    Args:
        heap: this PE's heap, opened with `open_heap`.
        lease_s, clock: the receiver's leases.
        force_segment_puts: send with segment puts even to load/store-reachable peers.
    """

    def __init__(self, heap: SymmetricHeap, *, lease_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, force_segment_puts: bool = False) -> None:
        self.heap = heap
        self.backend = heap.backend
        self.pe = heap.rank
        self.force_segment_puts = force_segment_puts
        self._receiver = HeapReceiver(heap, lease_s, clock)
        self._kv: torch.Tensor | None = None
        self._sender: HeapSender | None = None

    def alloc_kv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self._kv is not None:
            raise RuntimeError(f"alloc_kv: PE {self.pe} already allocated its KV tensor "
                               f"(shape {tuple(self._kv.shape)}); one per connector")
        self._kv = self.heap.alloc(shape, dtype)
        return self._kv

    def check_dest(self, request_id: Hashable, dest: RecvDest) -> None:
        heap = self.heap
        ticket_pe = getattr(dest.ticket, "pe", None)
        if not 0 <= dest.pe < heap.world_size or dest.pe == heap.rank or ticket_pe != dest.pe:
            raise InvalidArgument(f"dest.pe: expected a receiver PE in [0, {heap.world_size}) other than "
                                  f"this one ({heap.rank}) and equal to its ticket's, got {dest.pe} "
                                  f"(ticket PE {ticket_pe})", argument="dest.pe")

    @property
    def sender(self) -> HeapSender:
        """Built on the first pushed prompt: a receive-only instance never needs one."""
        if self._sender is None:
            if self._kv is None:
                raise RuntimeError(f"sender: PE {self.pe} has no KV tensor yet; call alloc_kv first")
            self._sender = HeapSender(self.heap, self._kv, force_segment_puts=self.force_segment_puts)
        return self._sender

    @property
    def receiver(self) -> HeapReceiver:
        return self._receiver
