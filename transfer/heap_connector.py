"""The KV connector of the symmetric-heap backends (``nvshmem``, ``shm``).

Both backends share one design over `SymmetricHeap` (`heap.py`): the KV tensor is a symmetric
allocation, so a sender writes a receiver's pages through a peer view (or segment puts) of the
same tensor; completion is a doorbell word in the receiver's symmetric memory (`doorbell.py`),
set after a system-scope fence, so the receiver learns that the KV landed by reading its own
memory. `HeapSender` is the `KVPusher` (fused append+push per layer on a transfer stream) plus
the abort fence; `HeapReceiver` is the doorbell table plus the leases (`lease.py`).
`HeapConnector` is what the registry returns for both backends (`registry.py`). With ``verify``
(`transfer.verify`) the sender writes a digest of each request's pushed KV beside its doorbell and
the receiver checks it before the reservation closes as landed (`verify.py`; with head routes, one
digest per sender and receiver rank). With a `HeadLayout` whose sides differ in tensor
parallelism (`heads.py`), the KV tensor views a flat allocation of the wider side's bytes, the
sender pushes by head routes and the receiver arms one doorbell word per sender rank. Runs in
every worker process; `KVPusher` (torch and the Triton kernels) is imported when the sender is built.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

from disagg.errors import InvalidArgument, TransferError
from disagg.transfer.connector import (ClosedReservation, Completion, KVConnector, KVPoll, KVReceiver, KVSender,
                                       RecvDest)
from disagg.transfer.doorbell import DoorbellTable, DoorbellTicket
from disagg.transfer.heap import SymmetricHeap
from disagg.transfer.lease import Lease, LeaseBook, tickets_of
from disagg.transfer.verify import DigestTable, ReceiverDigests, SenderDigests

if TYPE_CHECKING:
    import torch

    from disagg.plan import ForwardPlan
    from disagg.transfer.heads import HeadLayout
    from disagg.transfer.pusher import KVPusher

logger = logging.getLogger(__name__)


class HeapSender(KVSender):
    """`KVSender` over a `KVPusher`: the destination's ticket is its doorbell.

    Args:
        heap: this PE's heap.
        kv: ``[num_layers, num_pages, 2, H_kv, P, D]`` from ``heap.alloc``.
        force_segment_puts, append_on_caller_stream, allocation: `KVPusher`'s.
        digests: `transfer.verify`: this PE's digest rows; None: no digests.
    """

    def __init__(self, heap: SymmetricHeap, kv: torch.Tensor, *, force_segment_puts: bool = False,
                 append_on_caller_stream: bool = False, digests: DigestTable | None = None,
                 allocation: torch.Tensor | None = None) -> None:
        super().__init__()
        from disagg.transfer.pusher import KVPusher

        self.heap = heap
        self.pusher: KVPusher = KVPusher(heap, kv, force_segment_puts=force_segment_puts,
                                         append_on_caller_stream=append_on_caller_stream, allocation=allocation)
        if digests is not None:
            self.pusher.digests = SenderDigests(digests, kv)
        # Per layer on the hot path: bound once.
        self._push_layer = self.pusher.push_layer_async
        self._wait_layer = self.pusher.wait_layer

    def attach(self, seq_id: int, dest: RecvDest) -> None:
        if dest.routes is not None:  # the two sides' tensor parallelism differs: heads by route
            self.pusher.attach_routes(seq_id, dest.routes)
            if self.pusher.digests is not None:
                self.pusher.digests.track_routes(seq_id, dest.pe, dest.routes, dest.cmap)
            return
        self.pusher.attach_doorbell(seq_id, dest.ticket)
        if self.pusher.digests is not None:
            self.pusher.digests.track(dest.ticket, dest.cmap)

    def detach(self, seq_id: int) -> None:
        ticket = self.pusher.detach_doorbell(seq_id)
        if self.pusher.digests is not None:
            self.pusher.digests.forget(ticket)
            self.pusher.digests.forget_routes(seq_id)

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
        self.num_corrupt = 0  # rung reservations whose digest did not match (`transfer.verify`)
        self.wait_s = 0.0
        self.digests: ReceiverDigests | None = None  # `transfer.verify`: set by `HeapConnector.alloc_kv`
        # Sender ranks that write each reservation (`HeadLayout.num_senders`): one doorbell word each.
        self.num_senders = 1

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
        ticket = self._arm(request_id)
        self.leases.open(request_id, ticket)
        if self.digests is not None:
            self.digests.track(request_id, cmap)
        return RecvDest(request_id, [int(x) for x in cmap], self.pe, ticket, num_cached_tokens=num_cached_tokens)

    def _arm(self, request_id: Hashable) -> DoorbellTicket | tuple[DoorbellTicket, ...]:
        """One doorbell word, or one per sender rank (all or none: HeapError leaves none armed)."""
        if self.num_senders == 1:
            return self.doorbells.arm(request_id)
        tickets = []
        try:
            for _ in range(self.num_senders):
                tickets.append(self.doorbells.arm(request_id))
        except BaseException:
            for ticket in tickets:
                self.doorbells.release(ticket)
            raise
        return tuple(tickets)

    def state(self, request_id: Hashable) -> KVPoll:
        lease = self.leases.get(request_id)
        if lease is None:
            raise KeyError(f"request {request_id!r} has no open reservation on PE {self.pe}")
        if all(self.doorbells.is_rung(ticket) for ticket in tickets_of(lease.ticket)):
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
            corrupt = self._check_digest(lease)
            if corrupt is not None:  # never admitted: failed as a push that did not land
                self.num_corrupt += 1
                closed.append(ClosedReservation(lease.request_id, KVPoll.EXPIRED, waited, None, str(corrupt)))
                continue
            self.num_landed += 1
            self.wait_s += waited
            closed.append(ClosedReservation(lease.request_id, KVPoll.LANDED, waited, lease.handle))
        for lease in expired:
            if self.digests is not None:
                self.digests.forget(lease.request_id)
            words = ", ".join(str(t.index) for t in tickets_of(lease.ticket))
            reason = (f"lease expired: the KV of request {lease.request_id!r} did not land within "
                      f"{self.lease_s} s (doorbell word {words} on PE {self.pe})")
            closed.append(ClosedReservation(lease.request_id, KVPoll.EXPIRED, self._waited(lease, now),
                                            lease.handle, reason))
        return closed

    def _check_digest(self, lease: Lease) -> TransferError | None:
        """`transfer.verify`: the `TransferError` of a rung reservation whose pages differ from
        what its sender digested (`ReceiverDigests.check`), else None (also without verify, and
        for a quarantined one: nobody reads its pages)."""
        if self.digests is None:
            return None
        if lease.quarantined:
            self.digests.forget(lease.request_id)
            return None
        return self.digests.check(lease.request_id, lease.ticket)

    def _waited(self, lease: Lease, now: float) -> float:
        return max(0.0, now - (lease.deadline - self.lease_s))

    def cancel(self, dest: RecvDest) -> Any:
        lease = self.leases.get(dest.request_id)
        if lease is None:
            raise InvalidArgument(f"dest: request {dest.request_id!r} has no open reservation on PE {self.pe}",
                                  argument="dest")
        if lease.ticket != dest.ticket:
            ticket, mine = tickets_of(dest.ticket)[0] if dest.ticket else dest.ticket, tickets_of(lease.ticket)[0]
            raise InvalidArgument(f"dest.ticket: request {dest.request_id!r}'s open reservation waits on doorbell "
                                  f"word {mine.index} epoch {mine.epoch}, got word "
                                  f"{getattr(ticket, 'index', ticket)} epoch {getattr(ticket, 'epoch', '?')} "
                                  f"(an earlier reservation under the same id)", argument="dest.ticket")
        self.leases.cancel(dest.request_id)
        if self.digests is not None:
            self.digests.forget(dest.request_id)
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
        verify: `transfer.verify`: digest every push and check it before admission (one more
            collective allocation in `alloc_kv`: every PE must agree); with a split layout, one
            digest per (sender, receiver) route, of its heads (`verify.py`).
        layout: the fleet's head split (`disagg.transfer.heads.HeadLayout`); None: both sides at
            this instance's tensor parallelism.
    """

    def __init__(self, heap: SymmetricHeap, *, lease_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, force_segment_puts: bool = False,
                 verify: bool = False, layout: HeadLayout | None = None) -> None:
        self.heap = heap
        self.backend = heap.backend
        self.pe = heap.rank
        self.force_segment_puts = force_segment_puts
        self.verify = verify
        self.layout = layout
        self._digests: DigestTable | None = None
        self._receiver = HeapReceiver(heap, lease_s, clock)
        self._receiver.num_senders = layout.num_senders if layout is not None else 1
        self._kv: torch.Tensor | None = None
        self._allocation: torch.Tensor | None = None  # the symmetric allocation kv views (split layouts)
        self._sender: HeapSender | None = None

    def alloc_kv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self._kv is not None:
            raise RuntimeError(f"alloc_kv: PE {self.pe} already allocated its KV tensor "
                               f"(shape {tuple(self._kv.shape)}); one per connector")
        self._kv = self._alloc_kv(shape, dtype)
        if self.verify:
            self._digests = DigestTable(self.heap, int(shape[0]))
            self._receiver.digests = ReceiverDigests(self._digests, self._kv, self._sender_heads())
            logger.warning("transfer.verify is on (PE %d): every push is digested and checked before "
                           "admission, a debug mode that costs a read of the pushed KV on both sides", self.pe)
        return self._kv

    def _sender_heads(self) -> tuple[tuple[int, int], ...] | None:
        """`transfer.verify` with a split layout: per sender rank of this receiver, the heads of
        its pages that sender writes (`heads.received_heads`); None: one sender, every head."""
        layout = self.layout
        if layout is None or not layout.is_split:
            return None
        from disagg.transfer.heads import received_heads

        return received_heads(layout.num_kv_heads, layout.peer_ranks, layout.num_ranks, layout.rank)

    def _alloc_kv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``shape`` from the heap. When the two sides differ in tensor parallelism, every PE
        allocates the bytes of ``layout.num_pages`` pages of the side with more heads per rank,
        flat (the heap's allocations are symmetric), and views its own pages at their start: a
        rank of the narrower side as more pages (`HeadLayout.num_pages_of`), so neither side
        leaves allocated bytes unused; peers' pages are written at the same start (`KVPusher`'s
        ``allocation``)."""
        layout = self.layout
        if layout is None or not layout.is_split:
            return self.heap.alloc(shape, dtype)
        import math

        widest = list(shape)
        widest[1] = int(shape[1]) if layout.num_pages is None else layout.num_pages
        widest[3] = layout.max_local_heads
        if math.prod(shape) > math.prod(widest):
            raise ValueError(f"shape: {tuple(shape)} is more than a PE's allocation of {widest[1]} pages of "
                             f"{layout.max_local_heads} KV heads (the widest rank of the fleet: "
                             f"{layout.num_kv_heads} heads over {layout.num_ranks} or {layout.peer_ranks} ranks)")
        self._allocation = self.heap.alloc((math.prod(widest),), dtype)
        return self._allocation[:math.prod(shape)].view(tuple(shape))

    def check_dest(self, request_id: Hashable, dest: RecvDest) -> None:
        """Each receiver a PE of the heap other than this one, its ticket's; each head route's
        receiver pages within the symmetric allocation (`heads.route_pages`; once `alloc_kv` made
        it): a rank whose layout disagrees with the allocation it made is refused at add, before
        the request has pages, not at the step that attaches it."""
        if dest.routes is None:
            self._check_receiver(dest.pe, getattr(dest.ticket, "pe", None))
            return
        for route in dest.routes:
            self._check_receiver(route.pe, getattr(route.ticket, "pe", None))
            if self._kv is None:
                continue
            from disagg.transfer.heads import route_pages

            base = self._kv if self._allocation is None else self._allocation
            named, room = route_pages(route, tuple(self._kv.shape), base.numel())
            if named > room:
                raise InvalidArgument(f"dest.routes: request {request_id!r}: the route into PE {route.pe} names "
                                      f"{named} receiver pages of {route.dst_num_kv_heads} KV heads per layer; "
                                      f"expected at most {room}, what this PE's allocation of {base.numel()} "
                                      f"elements holds (the two sides' page counts disagree: "
                                      f"HeadLayout.num_pages)", argument="dest.routes")

    def _check_receiver(self, pe: int, ticket_pe: int | None) -> None:
        heap = self.heap
        if not 0 <= pe < heap.world_size or pe == heap.rank or ticket_pe != pe:
            raise InvalidArgument(f"dest.pe: expected a receiver PE in [0, {heap.world_size}) other than "
                                  f"this one ({heap.rank}) and equal to its ticket's, got {pe} "
                                  f"(ticket PE {ticket_pe})", argument="dest.pe")

    @property
    def sender(self) -> HeapSender:
        """Built on the first pushed prompt: a receive-only instance never needs one."""
        if self._sender is None:
            if self._kv is None:
                raise RuntimeError(f"sender: PE {self.pe} has no KV tensor yet; call alloc_kv first")
            self._sender = HeapSender(self.heap, self._kv, force_segment_puts=self.force_segment_puts,
                                      digests=self._digests, allocation=self._allocation)
        return self._sender

    @property
    def receiver(self) -> HeapReceiver:
        return self._receiver
