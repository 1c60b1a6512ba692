"""Doorbells: per-request completion words in the receiver's symmetric signal array.

The receiver (decode worker) arms a ticket when it reserves pages for a request and sends it to
the sender along with the compressed position map; the sender's KV pusher rings it after the last
write of that request's KV (`SymmetricHeap.set_signal_async`: after the data, system-scope
ordered). The receiver learns that the KV has landed by reading its own memory (`is_rung`, `poll`,
`wait`) -- no message from the sender, no host round trip.

Epochs make reuse safe: a word only grows, each ticket on it waits for a larger value than any
earlier ticket on that word, and words are handed out round-robin, so a ring for an earlier
ticket never satisfies a later one.

Runs in the receiver (`DoorbellTable`) and the sender (`ring_async`) processes.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import numpy as np

from disagg.errors import HeapError, TransferError
from disagg.transfer.heap import SymmetricHeap

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DoorbellTicket:
    """Where and what to ring when a request's KV has landed (picklable; travels with the map).

    Attributes:
        request_id: the request, for messages.
        pe: the receiver PE, owner of the word.
        index: the signal word on ``pe``.
        epoch: the value the sender writes; the receiver waits for ``word >= epoch``.
    """

    request_id: int | str
    pe: int
    index: int
    epoch: int


class DoorbellTable:
    """The receiver's doorbells: hands signal words to requests and watches them.

    Args:
        heap: this PE's heap; every one of its signal words is a doorbell.
    """

    def __init__(self, heap: SymmetricHeap) -> None:
        self._heap = heap
        self._free = collections.deque(range(heap.num_signals))
        self._last_epoch = np.zeros(heap.num_signals, dtype=np.int64)
        self._armed: dict[int, DoorbellTicket] = {}

    @property
    def num_armed(self) -> int:
        return len(self._armed)

    def arm(self, request_id: int | str) -> DoorbellTicket:
        """Reserve a word for ``request_id`` and return its ticket (send it to the sender).

        Raises:
            HeapError: every word is armed (release finished requests).
        """
        if not self._free:
            raise HeapError(f"no free doorbell on PE {self._heap.rank} for request {request_id}: "
                            f"all {self._heap.num_signals} are armed (raise num_signals or release)")
        index = self._free.popleft()
        epoch = int(max(self._last_epoch[index], self._heap.read_signal(index))) + 1
        self._last_epoch[index] = epoch
        ticket = DoorbellTicket(request_id=request_id, pe=self._heap.rank, index=index, epoch=epoch)
        self._armed[index] = ticket
        return ticket

    def is_rung(self, ticket: DoorbellTicket) -> bool:
        """True once the sender's ring for ``ticket`` is visible (KV may be read)."""
        self._check_mine(ticket)
        return self._heap.read_signal(ticket.index) >= ticket.epoch

    def poll(self) -> list[DoorbellTicket]:
        """Armed tickets that have been rung, from one snapshot of the signal words."""
        words = self._heap.read_signals()
        return [t for t in self._armed.values() if words[t.index] >= t.epoch]

    def wait(self, ticket: DoorbellTicket, timeout_s: float, *, src_pe: int = -1) -> None:
        """Block until ``ticket`` is rung.

        Args:
            ticket: an armed ticket of this table.
            timeout_s: seconds to wait.
            src_pe: the sender, for the message (-1 when not known).

        Raises:
            SignalTimeout: not rung within ``timeout_s`` (names request, sender and receiver).
        """
        self._check_mine(ticket)
        self._heap.wait_signal(ticket.index, ticket.epoch, timeout_s,
                               request_id=ticket.request_id, src_pe=src_pe)

    def release(self, ticket: DoorbellTicket) -> None:
        """Return the word of a finished or aborted request."""
        self._check_mine(ticket)
        del self._armed[ticket.index]
        self._free.append(ticket.index)

    def _check_mine(self, ticket: DoorbellTicket) -> None:
        if ticket.pe != self._heap.rank or self._armed.get(ticket.index) != ticket:
            raise TransferError(f"doorbell ticket (word {ticket.index}, epoch {ticket.epoch}) is not "
                                f"armed in this table", request_id=ticket.request_id,
                                src_pe=-1, dst_pe=self._heap.rank)


def ring_async(heap: SymmetricHeap, ticket: DoorbellTicket, stream: object | None = None) -> None:
    """Sender side: ring ``ticket`` after every earlier write on ``stream`` (see the heap)."""
    heap.set_signal_async(ticket.index, ticket.epoch, ticket.pe, stream)
