"""Doorbell tickets: words handed out round-robin, epochs that make reuse safe, clear misuse errors."""

from __future__ import annotations

import pytest

from disagg.errors import HeapError, SignalTimeout, TransferError
from disagg.transfer import DoorbellTable, ring_async


def test_a_reused_word_waits_for_a_new_epoch(heap_pair):
    sender, receiver = heap_pair
    table = DoorbellTable(receiver)
    first = table.arm("r1")
    ring_async(sender, first)
    assert table.is_rung(first) and table.poll() == [first]
    table.release(first)
    tickets = [table.arm(f"r{i}") for i in range(2, 2 + receiver.num_signals)]
    reused = tickets[-1]  # round-robin: the released word comes back last
    assert (reused.index, reused.epoch) == (first.index, first.epoch + 1)
    assert not table.is_rung(reused) and table.poll() == []
    ring_async(sender, first)  # a late ring of the earlier request does not count
    assert not table.is_rung(reused)
    with pytest.raises(SignalTimeout, match=r"request r65, PE 0 -> PE 1"):
        table.wait(reused, timeout_s=0.05, src_pe=0)
    ring_async(sender, reused)
    table.wait(reused, timeout_s=1.0)


def test_exhausted_table_and_foreign_tickets_are_refused(heap_pair):
    _, receiver = heap_pair
    table = DoorbellTable(receiver)
    tickets = [table.arm(i) for i in range(receiver.num_signals)]
    with pytest.raises(HeapError, match="no free doorbell on PE 1 for request 99"):
        table.arm(99)
    table.release(tickets[0])
    with pytest.raises(TransferError, match="not armed in this table"):
        table.release(tickets[0])
    with pytest.raises(TransferError, match="not armed in this table"):
        DoorbellTable(heap_pair[0]).is_rung(tickets[1])
