"""The KV connector interface (`disagg.transfer.connector`) and its registry, on two shm PEs.

The registry refuses what it does not know and takes a new backend with one line; a receiver's
reservations move WAITING -> LANDED / EXPIRED and a quarantined or cancelled one hands its
handle back exactly once; a sender's abort answers QUIESCED or IN_FLIGHT until its fence is done;
a push through both sides lands bit-exact in the receiver's reserved slots.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from heap_threads import collective

from disagg.cache import PagedKVCache
from disagg.errors import InvalidArgument
from disagg.transfer import (KVConnector, KVPoll, KVReceiver, KVSender, PushState, RecvDest, backend_names,
                             get_backend, open_connector, open_heap, ring_async)
from disagg.transfer import registry
from disagg.transfer.heap_connector import HeapConnector

LAYERS, PAGES, HEADS, PAGE, DIM = 2, 8, 2, 4, 8
SHAPE = (LAYERS, PAGES, 2, HEADS, PAGE, DIM)
LEASE_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeFence:
    """A completion that is done once the test says so (a GPU's transfer streams)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def connectors(heap_pair):
    """(sender connector on PE 0, receiver connector on PE 1, the receiver's clock), KV allocated."""
    clock = FakeClock()
    c0, c1 = (open_connector(heap, lease_s=LEASE_S, clock=clock) for heap in heap_pair)
    collective([lambda: c0.alloc_kv(SHAPE, torch.float32), lambda: c1.alloc_kv(SHAPE, torch.float32)])
    return c0, c1, clock


# ---------------------------------------------------------------------------------------- registry
def test_registry_names_the_two_backends_and_builds_the_heap_connector(heap_pair):
    assert backend_names() == ("nvshmem", "shm")
    for name in backend_names():  # importing the nvshmem module needs no GPU (nvshmem4py loads on open)
        backend = get_backend(name)
        assert backend.name == name and backend.connector is HeapConnector
    connector = open_connector(heap_pair[0])
    assert isinstance(connector, KVConnector) and (connector.backend, connector.pe) == ("shm", 0)
    assert isinstance(connector.receiver, KVReceiver)


@pytest.mark.parametrize("name", ["rdma", "", None, "SHM"])
def test_registry_refuses_an_unknown_backend_naming_the_known_ones(name):
    with pytest.raises(ValueError, match=r"must be one of \('nvshmem', 'shm'\), got") as err:
        get_backend(name)
    assert "disagg.transfer.registry.BACKENDS" in str(err.value)


def test_open_heap_and_open_connector_refuse_an_unknown_backend():
    with pytest.raises(ValueError, match=r"one of \('nvshmem', 'shm'\), got 'gloo'"):
        open_heap("gloo", uid=b"x", rank=0, world_size=1, size_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"one of \('nvshmem', 'shm'\), got None"):
        open_connector(object())  # a transport without a backend name


def test_a_new_backend_is_one_module_and_one_registry_line(monkeypatch):
    module = types.ModuleType("fake_rdma_backend")
    module.BACKEND = registry.TransferBackend(name="rdma", new_unique_id=lambda size_bytes=None: b"rdma-uid",
                                              open=lambda uid, **kw: None, connector=lambda transport, **kw: kw)
    monkeypatch.setitem(sys.modules, "fake_rdma_backend", module)
    monkeypatch.setitem(registry.BACKENDS, "rdma", "fake_rdma_backend")
    assert "rdma" in backend_names() and get_backend("rdma") is module.BACKEND
    from disagg.transfer import new_unique_id

    assert new_unique_id("rdma") == b"rdma-uid"
    options = open_connector(types.SimpleNamespace(backend="rdma"), lease_s=5.0)
    assert options["lease_s"] == 5.0 and options["force_segment_puts"] is False
    monkeypatch.setitem(registry.BACKENDS, "ib", "fake_rdma_backend")  # a module registered under another name
    with pytest.raises(RuntimeError, match="named 'rdma', expected 'ib'"):
        get_backend("ib")


# ---------------------------------------------------------------------------------------- receiver
def ring(sender_heap, dest: RecvDest) -> None:
    """What a sender's end_forward does for a completed destination."""
    ring_async(sender_heap, dest.ticket)


def test_receiver_poll_states_waiting_landed_expired(heap_pair, connectors):
    _, c1, clock = connectors
    receiver = c1.receiver
    landed = receiver.reserve("a", [1, 4, 3], num_cached_tokens=2)
    expired = receiver.reserve("b", [1, 12, 2])
    assert (landed.pe, landed.pes, landed.cmap, landed.num_cached_tokens) == (1, (1,), [1, 4, 3], 2)
    assert receiver.state("a") is KVPoll.WAITING and receiver.state("b") is KVPoll.WAITING
    assert receiver.poll() == [] and len(receiver) == 2 and receiver.reserved_ids() == {"a", "b"}
    ring(heap_pair[0], landed)
    clock.now += 1.5
    assert receiver.state("a") is KVPoll.LANDED and len(receiver) == 2  # state never closes
    [closed] = receiver.poll()
    assert (closed.request_id, closed.state, closed.handle, closed.waited_s) == ("a", KVPoll.LANDED, None, 1.5)
    assert "a" not in receiver and (receiver.num_landed, receiver.wait_s) == (1, 1.5)
    clock.now += LEASE_S
    assert receiver.state("b") is KVPoll.EXPIRED
    [closed] = receiver.poll()
    assert (closed.request_id, closed.state) == ("b", KVPoll.EXPIRED)
    assert "lease expired" in closed.reason and "'b'" in closed.reason and f"{LEASE_S} s" in closed.reason
    assert len(receiver) == 0 and receiver.num_armed == 0 and receiver.poll() == []
    with pytest.raises(KeyError, match="no open reservation"):
        receiver.state("a")


def test_quarantine_keeps_the_reservation_until_the_ring_or_the_lease(heap_pair, connectors):
    _, c1, clock = connectors
    receiver = c1.receiver
    rung = receiver.reserve("r", [1, 0, 4])
    lapsed = receiver.reserve("l", [1, 4, 4])
    receiver.quarantine("r", "pages of r")
    receiver.quarantine("l", "pages of l")
    for _ in range(3):  # aborted, yet the sender may still write: nothing closes
        clock.now += LEASE_S / 4
        assert receiver.poll() == [] and receiver.num_quarantined == 2 and {"r", "l"} <= receiver.reserved_ids()
    ring(heap_pair[0], rung)
    [closed] = receiver.poll()
    assert (closed.request_id, closed.state, closed.handle) == ("r", KVPoll.LANDED, "pages of r")
    assert receiver.num_quarantined == 1 and "l" in receiver
    clock.now += LEASE_S / 4
    [closed] = receiver.poll()
    assert (closed.request_id, closed.state, closed.handle) == ("l", KVPoll.EXPIRED, "pages of l")
    assert receiver.num_quarantined == 0 and len(receiver) == 0 and receiver.num_armed == 0


def test_cancel_hands_back_the_quarantine_handle_and_refuses_another_reservation(connectors):
    _, c1, _ = connectors
    receiver = c1.receiver
    old = receiver.reserve("x", [1, 0, 2])
    assert receiver.cancel(old) is None and "x" not in receiver and receiver.num_cancelled == 1
    new = receiver.reserve("x", [1, 0, 2])  # the same id again: another doorbell epoch
    with pytest.raises(InvalidArgument, match="earlier reservation under the same id") as err:
        receiver.cancel(old)
    assert err.value.argument == "dest.ticket" and receiver.state("x") is KVPoll.WAITING
    receiver.quarantine("x", "pages of x")
    assert receiver.cancel(new) == "pages of x" and len(receiver) == 0 and receiver.num_cancelled == 2
    with pytest.raises(InvalidArgument, match="no open reservation"):
        receiver.cancel(new)


# ---------------------------------------------------------------------------------------- sender
def test_sender_abort_is_in_flight_until_its_fence_and_reported_once(connectors, monkeypatch):
    c0, _, _ = connectors
    sender = c0.sender
    assert isinstance(sender, KVSender) and c0.sender is sender  # built once
    assert sender.abort("cpu", 3, pushed=True) is PushState.QUIESCED  # shm pushes ran inline
    fence = FakeFence()
    monkeypatch.setattr(sender, "fence", lambda: fence)
    assert sender.abort("none-pushed", 4, pushed=False) is PushState.QUIESCED  # no fence asked
    assert sender.abort("gpu", 5, pushed=True) is PushState.IN_FLIGHT
    assert sender.is_quiescing("gpu") and sender.num_quiescing == 1 and sender.poll_aborted() == []
    fence.done = True
    assert sender.poll_aborted() == ["gpu"] and sender.poll_aborted() == [] and not sender.is_quiescing("gpu")


def test_sender_retire_hands_each_handle_back_once_its_pushes_landed(connectors):
    sender = connectors[0].sender
    slow, fast = FakeFence(), FakeFence()
    sender.retire("inline", None)
    sender.retire("slow", slow)
    sender.retire("fast", fast)
    fast.done = True
    assert sender.poll_retired() == ["inline", "fast"] and sender.num_retiring == 1
    slow.done = True
    assert sender.poll_retired() == ["slow"] and sender.poll_retired() == [] and sender.num_retiring == 0


def test_dest_checks_name_the_receiver_pe(connectors):
    c0, c1, _ = connectors
    dest = c1.receiver.reserve("d", [1, 0, 3])
    c0.check_dest("d", dest)  # PE 1, its own ticket: fine
    for bad in (RecvDest("d", dest.cmap, 0, dest.ticket), RecvDest("d", dest.cmap, 7, dest.ticket),
                RecvDest("d", dest.cmap, 1, None)):
        with pytest.raises(InvalidArgument, match="dest.pe: expected a receiver PE in") as err:
            c0.check_dest("d", bad)
        assert err.value.argument == "dest.pe"


# ---------------------------------------------------------------------------------------- both sides
def test_push_through_both_sides_lands_and_is_polled_landed(connectors):
    """reserve -> attach -> begin_forward, save_layer per layer, end_forward -> LANDED."""
    c0, c1, _ = connectors
    n = 6
    recv_cache, send_cache = PagedKVCache(PAGES, PAGE), PagedKVCache(PAGES, PAGE)
    recv_cache.add_sequence(0)
    cmap = recv_cache.disagg_prepare_recv(0, n)
    recv_cache.end_forward()
    dest = c1.receiver.reserve("p", cmap)
    send_cache.add_sequence(9)
    send_cache.add_sequence(10)  # another sequence first, so the two caches' slots differ
    send_cache.begin_forward([10], [3])
    send_cache.end_forward()
    send_cache.disagg_mark_send(9, 0, dest.cmap, dest.pe)
    c0.sender.attach(9, dest)
    plan = send_cache.begin_forward([9], [n])
    gen = torch.Generator().manual_seed(0)
    kvs = [torch.randn(2, n, HEADS, DIM, generator=gen) for _ in range(LAYERS)]
    c0.sender.begin_forward(plan)
    for layer, (k, v) in enumerate(kvs):
        assert c1.receiver.state("p") is KVPoll.WAITING
        c0.sender.save_layer(layer, k, v)
    assert c0.sender.end_forward() is None  # CPU: done inline
    send_cache.end_forward()
    assert c1.receiver.state("p") is KVPoll.LANDED
    assert [(c.request_id, c.state) for c in c1.receiver.poll()] == [("p", KVPoll.LANDED)]
    local = torch.from_numpy(send_cache.slots(9).astype(np.int64))
    remote = torch.from_numpy(recv_cache.slots(0).astype(np.int64))
    assert not torch.equal(local, remote)
    for kv, slots in ((c0._kv, local), (c1._kv, remote)):
        for layer, (k, v) in enumerate(kvs):
            assert torch.equal(kv[layer, slots // PAGE, 0, :, slots % PAGE], k)
            assert torch.equal(kv[layer, slots // PAGE, 1, :, slots % PAGE], v)
