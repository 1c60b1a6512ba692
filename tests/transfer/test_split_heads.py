"""Prefill at tensor parallelism a pushing into decode at b != a: each decode rank gets exactly its heads.

One shm heap of a + b PEs in this process (PEs 0..a-1 the prefill instance's ranks, a..a+b-1 the
decode instance's), each rank's collective calls on its own thread (`ThreadGroup`, as in
test_group_connector.py). A prompt goes in chunks, with KV on the sender before it is attached (the
page-to-page copies) and a prefix the decode side holds already (`num_cached_tokens`); every
segment put is recorded, and each decode rank's bytes must be written exactly once -- its heads,
at its slots, every layer -- and hold the full model's K/V of those heads. The new tokens go by
the fused append+push into the receivers' peer views (each route's head range at its head
offset), or, forced, by segment puts; the KV on the sender before the attach by segment puts.
Either way every byte of a decode rank outside its request's slots keeps its poison. Replicated heads (more
ranks than KV heads) are written by one sender only. With `transfer.verify`, each (sender,
receiver) route carries its own digest of its heads: a clean push lands, and a byte flipped in
one route's puts fails the request on every decode rank, naming that route's two PEs. Every PE
allocates PAGES pages of the side with more heads per rank and a rank of the other side views
them as more pages, as a launch does; the requests land in the decode ranks' last pages (past
PAGES where the decode side is narrower).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from heap_threads import Shared, ThreadGroup, collective, open_shm_heaps

from disagg.cache import PagedKVCache
from disagg.transfer import KVPoll, PushState, open_connector
from disagg.transfer.heads import HeadLayout, kv_heads_of, received_heads, routes_of, senders_of
from disagg.transfer.shm_heap import shm_leftovers
from disagg.transfer.verify import DIGEST_MISMATCH

LAYERS, PAGES, PAGE, DIM = 2, 8, 4, 8
LEASE_S = 10.0
# (model KV heads, prefill tensor parallelism, decode tensor parallelism)
PAIRS = [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (2, 1, 2), (2, 2, 1), (2, 2, 4), (2, 4, 2), (2, 4, 1),
         (3, 1, 3), (3, 3, 1), (6, 2, 3), (6, 3, 2)]




def each(fn, ranks):
    """``fn(rank_object)`` on every rank at once (each on its own thread: the collectives)."""
    return collective([lambda r=r: fn(r) for r in ranks])


class Fleet:
    """The a + b connectors, their KV tensors, and a record of every segment put."""

    def __init__(self, num_kv_heads: int, a: int, b: int, verify: bool = False,
                 force_segment_puts: bool = True) -> None:
        self.num_kv_heads, self.a, self.b = num_kv_heads, a, b
        self.heaps = open_shm_heaps(a + b, num_signals=64)
        groups = Shared(a), Shared(b)

        # As a launch sizes it: PAGES pages of the widest side on every PE, which a rank of the
        # narrower side views as more pages (`HeadLayout.num_pages_of`).
        layout = HeadLayout(num_kv_heads, a, 0, b, PAGES)
        self.prefill_pages, self.decode_pages = layout.num_pages_of(a), layout.num_pages_of(b)

        def connector(pe: int):
            side, rank, size, peer = (0, pe, a, b) if pe < a else (1, pe - a, b, a)
            group = ThreadGroup(groups[side], rank, size) if size > 1 else None
            return open_connector(self.heaps[pe], lease_s=LEASE_S, group=group, verify=verify,
                                  force_segment_puts=force_segment_puts,
                                  layout=HeadLayout(num_kv_heads, size, rank, peer, PAGES))

        self.connectors = [connector(pe) for pe in range(a + b)]
        self.prefill, self.decode = self.connectors[:a], self.connectors[a:]
        shapes = [self.shape(kv_heads_of(num_kv_heads, a, i), self.prefill_pages) for i in range(a)] + \
                 [self.shape(kv_heads_of(num_kv_heads, b, j), self.decode_pages) for j in range(b)]
        self.kv = collective([lambda c=c, s=s: c.alloc_kv(s, torch.float32) for c, s in zip(self.connectors, shapes)])
        for kv in self.kv[a:]:
            kv.fill_(float("nan"))  # the poison: what no push writes keeps it
        self.puts: list[tuple[int, int, np.ndarray]] = []  # (src PE, dst PE, runs)
        self.corrupt_route: tuple[int, int] | None = None  # (src PE, dst PE): flip a byte its puts land
        for heap in self.heaps[:a]:
            put = heap.put_segments_async

            def record(tensor, pe, segments, stream=None, put=put, src=heap.rank):
                self.puts.append((src, pe, segments.copy()))
                put(tensor, pe, segments, stream)
                if (src, pe) == self.corrupt_route and tensor is not self.digest_rows(src):
                    landed = self.kv[pe].reshape(-1).view(torch.uint8)
                    landed[int(segments[-1, 1]) + 1] ^= 0x40  # the last run's first value: in flight

            heap.put_segments_async = record

    def digest_rows(self, pe: int):
        """PE ``pe``'s digest rows (`transfer.verify`), or None."""
        table = getattr(self.connectors[pe], "inner", self.connectors[pe])._digests
        return None if table is None else table.rows

    @staticmethod
    def shape(heads: range, num_pages: int) -> tuple[int, ...]:
        return (LAYERS, num_pages, 2, len(heads), PAGE, DIM)

    def reserve(self, request_id: str, cmap: list[int], cached: int):
        return each(lambda c: c.receiver.reserve(request_id, cmap, num_cached_tokens=cached), self.decode)[0]

    def poll(self):
        return each(lambda c: c.receiver.poll(), self.decode)

    def close(self) -> None:
        for heap in self.heaps:
            heap.close()
        assert shm_leftovers(self.heaps[0].uid) == []


@pytest.fixture
def make_fleet():
    made = []

    def make(num_kv_heads: int, a: int, b: int, verify: bool = False, force_segment_puts: bool = True) -> Fleet:
        made.append(Fleet(num_kv_heads, a, b, verify, force_segment_puts))
        return made[-1]

    yield make
    for fleet in made:
        fleet.close()


def forward(fleet: Fleet, caches, seq: int, n: int, full_k, full_v, start: int) -> None:
    """Every prefill rank computes tokens [start, start + n) of ``seq`` (its heads), pushing them."""
    for i, (connector, cache) in enumerate(zip(fleet.prefill, caches)):
        heads = list(kv_heads_of(fleet.num_kv_heads, fleet.a, i))
        plan = cache.begin_forward([seq], [n])
        sender = connector.sender
        sender.begin_forward(plan)
        for layer in range(LAYERS):
            sender.save_layer(layer, full_k[layer, start:start + n][:, heads], full_v[layer, start:start + n][:, heads])
        assert sender.end_forward() is None
        cache.end_forward()


def written(fleet: Fleet) -> dict[int, np.ndarray]:
    """Per decode PE: how many times each of its KV bytes was written by a segment put."""
    counts = {}
    for pe, kv in zip(range(fleet.a, fleet.a + fleet.b), fleet.kv[fleet.a:]):
        counts[pe] = np.zeros(fleet.heaps[pe].size_bytes, dtype=np.int64)
    for _, pe, runs in fleet.puts:
        for _, dst, size in runs.tolist():
            counts[pe][dst:dst + size] += 1
    return counts


def expected_marks(kv: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    """A mask of ``kv``'s elements at ``slots``: every layer, K and V, head."""
    marks = torch.zeros(kv.shape, dtype=torch.bool)
    slots = torch.from_numpy(slots.astype(np.int64))
    marks[:, slots // PAGE, :, :, slots % PAGE, :] = True
    return marks


def expected_bytes(kv: torch.Tensor, slots: np.ndarray) -> np.ndarray:
    """`expected_marks` as a mask of ``kv``'s bytes (from its first byte)."""
    return np.repeat(expected_marks(kv, slots).reshape(-1).numpy(), kv.element_size())


@pytest.mark.parametrize("segment_puts", [True, False], ids=["segment-puts", "fused"])
@pytest.mark.parametrize("num_kv_heads, a, b", PAIRS)
def test_each_decode_rank_gets_exactly_its_heads_once(make_fleet, num_kv_heads: int, a: int, b: int,
                                                      segment_puts: bool):
    fleet = make_fleet(num_kv_heads, a, b, force_segment_puts=segment_puts)
    n, cached, before = 19, 4, 6  # prompt tokens; decode-side prefix (a page); computed before the attach
    recv_cache = PagedKVCache(fleet.decode_pages, PAGE)
    recv_cache.add_sequence(1)  # the decode side's low pages taken: the request lands in its last ones
    recv_cache.begin_forward([1], [(fleet.decode_pages - 5) * PAGE])
    recv_cache.end_forward()
    recv_cache.add_sequence(0)
    cmap = recv_cache.disagg_prepare_recv(0, n - cached)
    recv_cache.end_forward()
    dest = fleet.reserve("r", cmap, cached)
    assert dest.pes == tuple(range(a, a + b))
    caches = [PagedKVCache(fleet.prefill_pages, PAGE) for _ in range(a)]
    for cache in caches:  # another sequence first, so the two sides' slots differ
        cache.add_sequence(7)
        cache.begin_forward([7], [3])
        cache.end_forward()
        cache.add_sequence(9)
    gen = torch.Generator().manual_seed(a * 10 + b)
    full_k = torch.randn(LAYERS, n, num_kv_heads, DIM, generator=gen)
    full_v = torch.randn(LAYERS, n, num_kv_heads, DIM, generator=gen)
    forward(fleet, caches, 9, before, full_k, full_v, 0)  # KV already on the sender at the attach
    for i, (connector, cache) in enumerate(zip(fleet.prefill, caches)):
        mine = connector.local_dest(dest)
        connector.check_dest("r", mine)
        cache.disagg_mark_send(9, cached, mine.cmap, mine.pe)
        connector.sender.attach(9, mine)
    forward(fleet, caches, 9, 10, full_k, full_v, before)  # chunked: two more forwards (whole pages, parts)
    assert [[c.state for c in got] for got in fleet.poll()] == [[]] * b
    forward(fleet, caches, 9, n - before - 10, full_k, full_v, before + 10)
    closed = fleet.poll()
    assert [[(c.request_id, c.state) for c in got] for got in closed] == [[("r", KVPoll.LANDED)]] * b
    slots = recv_cache.slots(0)
    counts = written(fleet)
    for j, kv in enumerate(fleet.kv[a:]):
        heads = list(kv_heads_of(num_kv_heads, b, j))
        assert kv[~expected_marks(kv, slots)].isnan().all(), f"decode rank {j}: wrote outside the request's slots"
        t = torch.from_numpy(slots.astype(np.int64))
        for layer in range(LAYERS):
            torch.testing.assert_close(kv[layer, t // PAGE, 0, :, t % PAGE], full_k[layer, cached:][:, heads],
                                       rtol=0, atol=0)
            torch.testing.assert_close(kv[layer, t // PAGE, 1, :, t % PAGE], full_v[layer, cached:][:, heads],
                                       rtol=0, atol=0)
        if not segment_puts:  # only the KV of the attach went by (recorded) puts, the new tokens by fused stores
            put = sum(int(runs[:, 2].sum()) for _, pe, runs in fleet.puts if pe == a + j)
            assert put == (before - cached) * LAYERS * 2 * len(heads) * DIM * 4, f"decode rank {j}: {put} bytes put"
            continue
        want = expected_bytes(kv, slots)
        got = counts[a + j][:len(want)]
        assert got[want].min() == 1 and got[want].max() == 1, f"decode rank {j}: a head range missing or twice"
        assert got[~want].max() == 0 and counts[a + j][len(want):].max() == 0, f"decode rank {j}: wrote elsewhere"
    if not segment_puts:
        return
    # Bytes per (sender, receiver) pair: each decode head's bytes come from exactly one sender.
    sent = {}
    for src, pe, runs in fleet.puts:
        sent[(src, pe)] = sent.get((src, pe), 0) + int(runs[:, 2].sum())
    head_bytes = len(slots) * LAYERS * 2 * DIM * 4
    for j in range(b):
        senders = senders_of(num_kv_heads, a, b, j)
        assert {src for src, pe in sent if pe == a + j} == set(senders)
        received = sum(v for (src, pe), v in sent.items() if pe == a + j)
        assert received == head_bytes * len(kv_heads_of(num_kv_heads, b, j))


def test_the_routes_cover_every_decode_head_once_and_only_from_a_holder():
    for num_kv_heads, a, b in PAIRS:
        tickets = tuple(tuple(f"t{j}.{s}" for s in senders_of(num_kv_heads, a, b, j)) for j in range(b))
        cover = {}
        for i in range(a):
            held = kv_heads_of(num_kv_heads, a, i)
            for route in routes_of(num_kv_heads, a, i, tuple(range(b)), tickets):
                j = route.pe
                theirs = kv_heads_of(num_kv_heads, b, j)
                for h in range(route.num_heads):
                    head = held[route.src_head + h]
                    assert theirs[route.dst_head + h] == head
                    assert (j, head) not in cover, f"{num_kv_heads, a, b}: head {head} of rank {j} written twice"
                    cover[(j, head)] = i
                assert route.ticket == f"t{j}.{i}"  # this sender's word of that receiver
                assert route.dst_num_kv_heads == len(theirs)
        assert set(cover) == {(j, h) for j in range(b) for h in kv_heads_of(num_kv_heads, b, j)}
        for j in range(b):  # the receiver's own account of each sender's heads (`transfer.verify`)
            routed = [(r.dst_head, r.num_heads) for i in senders_of(num_kv_heads, a, b, j)
                      for r in routes_of(num_kv_heads, a, i, tuple(range(b)), tickets) if r.pe == j]
            assert received_heads(num_kv_heads, a, b, j) == tuple(routed)


def test_a_split_layout_without_the_fleets_page_count_is_refused():
    # Each side would view the allocation as pages of its own heads: TP1 -> TP2 would address the
    # receiver's layers 1000 pages apart where they lie 2000 apart.
    with pytest.raises(ValueError, match=r"HeadLayout.num_pages: .*TP 1 here, 2 on the other side.*got None"):
        HeadLayout(4, 1, 0, 2)
    with pytest.raises(ValueError, match=r"TP 2 here, 1 on the other side"):
        HeadLayout(4, 2, 1, 1, None)
    assert HeadLayout(4, 2, 0, 2).local_num_pages is None  # the sides agree: no fleet count needed
    assert HeadLayout(4, 1, 0, 2, 1000).peer_num_pages == 2000


def test_a_decode_rank_written_by_two_senders_lands_only_once_both_rang(make_fleet):
    fleet = make_fleet(4, 2, 1)  # both prefill ranks write the one decode rank's page
    recv_cache = PagedKVCache(fleet.decode_pages, PAGE)
    recv_cache.add_sequence(0)
    dest = fleet.reserve("two", recv_cache.disagg_prepare_recv(0, 3), 0)
    assert isinstance(dest.ticket, tuple) and len(dest.ticket) == 2
    from disagg.transfer import ring_async

    ring_async(fleet.heaps[0], fleet.prefill[0].local_dest(dest).ticket)
    assert fleet.poll() == [[]] and fleet.decode[0].receiver.state("two") is KVPoll.WAITING
    ring_async(fleet.heaps[1], fleet.prefill[1].local_dest(dest).ticket)
    assert [[c.state for c in got] for got in fleet.poll()] == [[KVPoll.LANDED]]
    assert fleet.decode[0].receiver.num_armed == 0  # both words released


def test_an_aborted_split_push_never_rings_and_its_reservation_cancels_on_every_rank(make_fleet):
    fleet = make_fleet(4, 1, 2)
    cache, recv_cache = PagedKVCache(fleet.prefill_pages, PAGE), PagedKVCache(fleet.decode_pages, PAGE)
    recv_cache.add_sequence(0)
    dest = fleet.reserve("x", recv_cache.disagg_prepare_recv(0, 6), 0)
    cache.add_sequence(3)
    [prefill] = fleet.prefill
    mine = prefill.local_dest(dest)
    assert [r.pe for r in mine.routes] == [1, 2] and [(r.src_head, r.dst_head, r.num_heads) for r in mine.routes] \
        == [(0, 0, 2), (2, 0, 2)]
    cache.disagg_mark_send(3, 0, mine.cmap, mine.pe)
    prefill.sender.attach(3, mine)
    full = torch.randn(LAYERS, 6, 4, DIM)
    forward(fleet, [cache], 3, 4, full, full, 0)  # the first chunk lands in both decode ranks' pages
    assert prefill.sender.abort("x", 3, pushed=True) is PushState.QUIESCED  # CPU: the puts ran inline
    assert fleet.poll() == [[], []]
    assert each(lambda c: c.receiver.cancel(dest), fleet.decode) == [None, None]
    assert all(getattr(c, "inner", c).receiver.num_armed == 0 and len(c.receiver) == 0 for c in fleet.decode)


def push_verified(fleet: Fleet, n: int = 7, before: int = 3):
    """With `transfer.verify` on: reserve ``n`` tokens on every decode rank, push them from every
    prefill rank (a whole page and part of one; the first ``before`` computed before the attach, so
    they go page to page), and poll; the decode ranks' closed reservations and the reserved slots."""
    recv_cache = PagedKVCache(fleet.decode_pages, PAGE)
    recv_cache.add_sequence(1)  # the decode side's low pages taken: the request lands in its last ones
    recv_cache.begin_forward([1], [(fleet.decode_pages - 3) * PAGE])
    recv_cache.end_forward()
    recv_cache.add_sequence(0)
    dest = fleet.reserve("v", recv_cache.disagg_prepare_recv(0, n), 0)
    recv_cache.end_forward()
    caches = [PagedKVCache(fleet.prefill_pages, PAGE) for _ in range(fleet.a)]
    for connector, cache in zip(fleet.prefill, caches):
        cache.add_sequence(7)  # another sequence first, so the two sides' slots differ
        cache.begin_forward([7], [2])
        cache.end_forward()
        cache.add_sequence(9)
    gen = torch.Generator().manual_seed(fleet.a * 10 + fleet.b)
    full_k, full_v = torch.randn(2, LAYERS, n, fleet.num_kv_heads, DIM, generator=gen)
    forward(fleet, caches, 9, before, full_k, full_v, 0)
    for connector, cache in zip(fleet.prefill, caches):
        mine = connector.local_dest(dest)
        cache.disagg_mark_send(9, 0, mine.cmap, mine.pe)
        connector.sender.attach(9, mine)
    forward(fleet, caches, 9, n - before, full_k, full_v, before)
    return fleet.poll(), recv_cache.slots(0).astype(np.int64)


@pytest.mark.parametrize("segment_puts", [True, False], ids=["segment-puts", "fused"])
@pytest.mark.parametrize("a, b", [(1, 2), (2, 1)])
def test_verify_digests_each_route_and_a_clean_split_push_lands(make_fleet, a: int, b: int, segment_puts: bool):
    from disagg.transfer.verify import kv_digest

    fleet = make_fleet(4, a, b, verify=True, force_segment_puts=segment_puts)
    closed, slots = push_verified(fleet)
    assert [[(c.request_id, c.state, c.reason) for c in got] for got in closed] == [[("v", KVPoll.LANDED, "")]] * b
    for j, connector in enumerate(fleet.decode):
        receiver = getattr(connector, "inner", connector).receiver
        assert (receiver.num_landed, receiver.num_corrupt) == (1, 0)
        # One row per sender route, at that sender's doorbell word: its PE, the digest of its heads here.
        senders = senders_of(4, a, b, j)
        rows = fleet.digest_rows(a + j)[0]
        written_by = {int(row[1]): row[2:] for row in rows if row[0] > 0}
        assert set(written_by) == set(senders)  # the prefill PEs are the sender ranks
        for sender, heads in zip(senders, received_heads(4, a, b, j)):
            assert heads != (0, 4) and torch.equal(written_by[sender], kv_digest(fleet.kv[a + j],
                                                                                 torch.from_numpy(slots), heads))


@pytest.mark.parametrize("a, b, route", [(1, 2, (0, 2)), (2, 1, (1, 2)), (2, 1, (0, 2))],
                         ids=["1to2-into-rank1", "2to1-from-rank1", "2to1-from-rank0"])
def test_verify_catches_a_page_corrupted_in_one_route_naming_its_pes(make_fleet, a: int, b: int, route):
    fleet = make_fleet(4, a, b, verify=True)
    fleet.corrupt_route = route
    closed, _ = push_verified(fleet)
    src, dst = route
    for got in closed:  # every decode rank closes it failed, with the corrupted rank's reason
        [one] = got
        assert (one.request_id, one.state) == ("v", KVPoll.EXPIRED)
        assert one.reason.startswith(DIGEST_MISMATCH), one.reason
        assert f"(request v, PE {src} -> PE {dst})" in one.reason, one.reason
        if b > 1:
            assert one.reason.endswith(f"(rank {dst - a} of this instance)"), one.reason
    corrupt = [getattr(c, "inner", c).receiver.num_corrupt for c in fleet.decode]
    assert corrupt == [int(pe == dst) for pe in range(a, a + b)]
    assert all(len(c.receiver) == 0 for c in fleet.decode)
