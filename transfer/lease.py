"""Leases of a receiver's reservations: pages a remote sender may still be writing.

`KVReceiver.reserve` gives a request's pages to a sender along with a doorbell; until that
doorbell rings, the prefill side may be writing those pages, so they must not be handed to anyone
else, whatever happens to the request (abort, error). A `Lease` records the reservation and its
deadline (``lease_s`` after the reserve). `LeaseBook.poll` reports the leases whose doorbell rang
(the KV has landed: the pages are the request's own again) and the leases that expired (the
sender is presumed gone: the pages can be freed and the request, if still wanted, fails). An
aborted request whose lease is still open is *quarantined*: its pages stay reserved until one of
the two, or until the caller asserts that no sender will write them (`cancel`: the prefill side
refused the request, never got it, or reported its aborted pushes complete).
Pure host bookkeeping, run inside the receiving engine's step (`heap_connector.HeapReceiver`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from disagg.transfer.doorbell import DoorbellTable, DoorbellTicket


@dataclass
class Lease:
    """One reservation whose doorbell has not rung yet.

    Attributes:
        request_id: the request.
        ticket: its doorbell; a tuple of them, one per sender, when several sender ranks write
            its pages (it rang once every one of them rang).
        deadline: clock time after which its pages are released.
        quarantined: the request was aborted; only the pages wait for the ring or the deadline.
        handle: what the quarantine was given (handed back when the lease closes).
    """

    request_id: Hashable
    ticket: DoorbellTicket | tuple[DoorbellTicket, ...]
    deadline: float
    quarantined: bool = False
    handle: Any = None


class LeaseBook:
    """Open leases of one receiver.

    Args:
        doorbells: the receiver's doorbell table (tickets are armed by the receiver, released here).
        lease_s: seconds a reservation may wait for its ring.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, doorbells: DoorbellTable, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(lease_s, (int, float)) and lease_s > 0):
            raise ValueError(f"lease_s: expected seconds > 0, got {lease_s!r}")
        self.doorbells = doorbells
        self.lease_s = float(lease_s)
        self.clock = clock
        self._leases: dict[Hashable, Lease] = {}

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def ids(self) -> set[Hashable]:
        return set(self._leases)

    @property
    def num_quarantined(self) -> int:
        return sum(lease.quarantined for lease in self._leases.values())

    def get(self, request_id: Hashable) -> Lease | None:
        """The open lease of ``request_id``, or None."""
        return self._leases.get(request_id)

    def open(self, request_id: Hashable, ticket: DoorbellTicket | tuple[DoorbellTicket, ...]) -> Lease:
        lease = Lease(request_id, ticket, self.clock() + self.lease_s)
        self._leases[request_id] = lease
        return lease

    def quarantine(self, request_id: Hashable, handle: Any = None) -> None:
        """The request is gone, but its pages wait for the ring or the deadline."""
        lease = self._leases[request_id]
        lease.quarantined, lease.handle = True, handle

    def poll(self) -> tuple[list[Lease], list[Lease]]:
        """Close the leases that rang and those that expired; release their doorbells.

        Returns:
            (rung, expired) leases, each closed and its ticket released.
        """
        if not self._leases:
            return [], []
        rung_tickets = {t.index for t in self.doorbells.poll()}
        now = self.clock()
        rung, expired = [], []
        for lease in list(self._leases.values()):
            if all(t.index in rung_tickets for t in tickets_of(lease.ticket)):
                rung.append(lease)
            elif now >= lease.deadline:
                expired.append(lease)
            else:
                continue
            del self._leases[lease.request_id]
            self._release(lease)
        return rung, expired

    def _release(self, lease: Lease) -> None:
        for ticket in tickets_of(lease.ticket):
            self.doorbells.release(ticket)

    def cancel(self, request_id: Hashable) -> Lease:
        """Close a lease that no sender will ring: its reservation was undone before its ticket
        left this process, or the caller vouches that the sender stopped (see the module)."""
        lease = self._leases.pop(request_id)
        self._release(lease)
        return lease


def tickets_of(ticket: DoorbellTicket | tuple[DoorbellTicket, ...]) -> tuple[DoorbellTicket, ...]:
    """The doorbell words of a reservation: one, or one per sender rank."""
    return ticket if isinstance(ticket, tuple) else (ticket,)
