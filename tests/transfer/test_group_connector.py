"""`GroupConnector`: the ranks of one tensor-parallel instance agree on every poll.

Four PEs of one shm heap in this process: PEs 0 and 1 are a prefill instance's two ranks, PEs 2
and 3 a decode instance's. Each rank's calls run on its own thread, as each rank's replica would
make them (collectives: `collective`); the ranks' control group is `ThreadGroup`, a barrier over
the threads with `TPGroup`'s `all_gather_object` (the real one is gloo: tests/cluster/test_cluster_tp.py).
"""

from __future__ import annotations

import pytest
import torch
from heap_threads import Shared, ThreadGroup, collective, open_shm_heaps

from disagg.errors import InvalidArgument
from disagg.transfer import KVPoll, PushState, RecvDest, open_connector, ring_async
from disagg.transfer.group import GroupConnector
from disagg.transfer.shm_heap import shm_leftovers

SHAPE = (2, 8, 2, 1, 4, 8)  # one KV head per rank
LEASE_S = 10.0




class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Fence:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def fleet():
    """(heaps, prefill ranks' connectors, decode ranks' connectors, the decode ranks' clocks)."""
    heaps = open_shm_heaps(4)
    clocks = [Clock(), Clock()]
    prefill_group, decode_group = Shared(2), Shared(2)
    prefill = [GroupConnector(open_connector(heaps[r]), ThreadGroup(prefill_group, r, 2)) for r in range(2)]
    decode = [GroupConnector(open_connector(heaps[2 + r], lease_s=LEASE_S, clock=clocks[r]),
                             ThreadGroup(decode_group, r, 2)) for r in range(2)]
    collective([lambda c=c: c.alloc_kv(SHAPE, torch.float32) for c in prefill + decode])
    yield heaps, prefill, decode, clocks
    for heap in heaps:
        heap.close()
    assert shm_leftovers(heaps[0].uid) == []


def both(fn, ranks):
    """``fn(rank_object)`` on every rank at once (each on its own thread)."""
    return collective([lambda r=r: fn(r) for r in ranks])


def test_a_reservation_is_one_dest_naming_every_rank_and_each_rank_sends_to_its_own(fleet):
    heaps, prefill, decode, _ = fleet
    d0, d1 = both(lambda c: c.receiver.reserve("a", [1, 4, 3], num_cached_tokens=2), decode)
    assert d0 == d1 and d0.pes == (2, 3) and d0.cmap == [1, 4, 3] and d0.num_cached_tokens == 2
    assert [prefill[r].local_dest(d0).pe for r in range(2)] == [2, 3]
    assert [prefill[r].local_dest(d0).ticket.pe for r in range(2)] == [2, 3]
    for connector in prefill:
        connector.check_dest("a", connector.local_dest(d0))
    alone = open_connector(heaps[0])  # a one-rank sender cannot send rank 1's heads anywhere
    with pytest.raises(InvalidArgument, match=r"1 tensor-parallel rank\(s\).* expected 1 receiver PE\(s\), got 2"):
        alone.local_dest(d0)


def test_it_lands_only_once_every_rank_s_doorbell_rang(fleet):
    heaps, prefill, decode, _ = fleet
    dest = both(lambda c: c.receiver.reserve("a", [1, 0, 3]), decode)[0]
    ring_async(heaps[0], dest.for_rank(0).ticket)  # rank 0's KV landed, rank 1's not yet
    assert both(lambda c: c.receiver.poll(), decode) == [[], []]
    assert all("a" in c.receiver and len(c.receiver) == 1 for c in decode)  # open on both ranks
    assert decode[0].receiver.state("a") is KVPoll.LANDED and decode[1].receiver.state("a") is KVPoll.WAITING
    ring_async(heaps[1], dest.for_rank(1).ticket)
    closed = both(lambda c: c.receiver.poll(), decode)
    assert [[(c.request_id, c.state) for c in got] for got in closed] == [[("a", KVPoll.LANDED)]] * 2
    assert all("a" not in c.receiver and c.receiver.num_landed == 1 for c in decode)


def test_a_lease_expired_on_one_rank_fails_it_on_every_rank(fleet):
    heaps, _, decode, clocks = fleet
    dest = both(lambda c: c.receiver.reserve("b", [1, 0, 3]), decode)[0]
    ring_async(heaps[0], dest.for_rank(0).ticket)
    clocks[1].now += LEASE_S  # rank 1's lease ran out; rank 0 landed
    closed = both(lambda c: c.receiver.poll(), decode)
    assert [[c.state for c in got] for got in closed] == [[KVPoll.EXPIRED]] * 2
    assert all(got[0].reason for got in closed) and len(decode[0].receiver) == len(decode[1].receiver) == 0


def test_a_quarantined_reservation_hands_each_rank_its_own_handle(fleet):
    heaps, _, decode, _ = fleet
    dest = both(lambda c: c.receiver.reserve("q", [1, 0, 3]), decode)[0]
    ring_async(heaps[1], dest.for_rank(1).ticket)
    both(lambda c: c.receiver.poll(), decode)  # rank 1 closed it here; not agreed yet
    decode[0].receiver.quarantine("q", "rank 0's request")
    decode[1].receiver.quarantine("q", "rank 1's request")
    assert [c.receiver.num_quarantined for c in decode] == [1, 1]
    ring_async(heaps[0], dest.for_rank(0).ticket)
    closed = both(lambda c: c.receiver.poll(), decode)
    assert [got[0].handle for got in closed] == ["rank 0's request", "rank 1's request"]


def test_cancel_is_refused_on_every_rank_when_one_rank_s_doorbell_rang(fleet):
    heaps, _, decode, _ = fleet
    dest = both(lambda c: c.receiver.reserve("c", [1, 0, 3]), decode)[0]
    ring_async(heaps[1], dest.for_rank(1).ticket)
    both(lambda c: c.receiver.poll(), decode)
    errors = both(lambda c: _raises(lambda: c.receiver.cancel(dest)), decode)
    assert all("has rung on PE 3 (rank 1); nothing was cancelled on any rank" in e for e in errors), errors
    assert all("c" in c.receiver for c in decode)
    other = both(lambda c: c.receiver.reserve("d", [1, 4, 3]), decode)[0]
    assert both(lambda c: c.receiver.cancel(other), decode) == [None, None]
    assert all("d" not in c.receiver and c.receiver.num_cancelled == 1 for c in decode)


def test_an_abort_is_in_flight_while_a_push_of_it_may_land_on_any_rank(fleet, monkeypatch):
    _, prefill, _, _ = fleet
    senders = [c.sender for c in prefill]
    fence = Fence()
    monkeypatch.setattr(senders[1].inner, "fence", lambda: fence)  # rank 1's pushes still on their way
    assert both(lambda s: s.abort("x", 5, pushed=True), senders) == [PushState.IN_FLIGHT] * 2
    assert all(s.is_quiescing("x") and s.num_quiescing == 1 for s in senders)
    assert both(lambda s: s.poll_aborted(), senders) == [[], []]
    fence.done = True
    assert both(lambda s: s.poll_aborted(), senders) == [["x"], ["x"]]
    assert both(lambda s: s.poll_aborted(), senders) == [[], []]
    assert both(lambda s: s.abort("y", 6, pushed=True), senders) == [PushState.QUIESCED] * 2


def test_a_retired_request_is_handed_back_once_its_pushes_landed_on_every_rank(fleet):
    _, prefill, _, _ = fleet
    senders = [c.sender for c in prefill]
    fences = [Fence(), Fence()]
    both(lambda s: s.retire(f"req on rank {senders.index(s)}", fences[senders.index(s)]), senders)
    fences[0].done = True
    assert both(lambda s: s.poll_retired(), senders) == [[], []]
    assert [s.num_retiring for s in senders] == [1, 1]
    fences[1].done = True
    assert both(lambda s: s.poll_retired(), senders) == [["req on rank 0"], ["req on rank 1"]]


def test_a_dest_names_its_ranks_and_refuses_another(fleet):
    dest = RecvDest("r", [1, 0, 3], 2, "t0", peers=((3, "t1"), (5, "t2")))
    assert dest.pes == (2, 3, 5) and dest.for_rank(2) == RecvDest("r", [1, 0, 3], 5, "t2")
    with pytest.raises(InvalidArgument, match=r"names 3 receiver rank\(s\); expected a rank in \[0, 3\), got 3"):
        dest.for_rank(3)


def _raises(fn, error: type[Exception] = InvalidArgument) -> str:
    try:
        fn()
    except error as err:
        return str(err)
    return "no error"


def test_ranks_whose_pages_differ_in_count_are_refused_on_every_rank_before_the_heap_allocates():
    heaps = open_shm_heaps(2)
    group = Shared(2)
    ranks = [GroupConnector(open_connector(heaps[r]), ThreadGroup(group, r, 2)) for r in range(2)]
    shapes = [SHAPE, (SHAPE[0], SHAPE[1] + 1) + tuple(SHAPE[2:])]
    errors = collective([lambda c=c, s=s: _raises(lambda: c.alloc_kv(s, torch.float32), ValueError)
                         for c, s in zip(ranks, shapes)])
    assert errors[0] == errors[1] and f"rank 1: {list(shapes[1])}" in errors[0], errors
    # nothing was allocated: the same ranks still allocate one shape
    collective([lambda c=c: c.alloc_kv(SHAPE, torch.float32) for c in ranks])
    for heap in heaps:
        heap.close()
