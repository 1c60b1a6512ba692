"""Which KV heads each rank holds, and which heads each prefill rank writes into which decode rank.

A tensor-parallel instance of k ranks over a model of H KV heads gives rank r the heads

    [r*H/k, (r+1)*H/k)            k <= H (k divides H)
    {r*H//k}                      k > H (H divides k): each head replicated on k/H ranks

and every rank's pages hold only its own heads, head-major (``[L, N, 2, H_local, P, D]``). When
the prefill side (a ranks) and the decode side (b ranks) differ, prefill rank i writes, into each
decode rank j, the heads that both hold -- and of a replicated head only its lowest holder writes
it (`writer_of`), so each head of each decode rank is written exactly once:

    H = 4, a = 1, b = 2    prefill 0 [0 1 2 3] -> decode 0 [0 1] (src heads 0..2 -> dst 0..2)
                                              -> decode 1 [2 3] (src heads 2..4 -> dst 0..2)
    H = 4, a = 2, b = 1    prefill 0 [0 1] -> decode 0 [0 1 2 3] at dst head 0
                           prefill 1 [2 3] -> decode 0 [0 1 2 3] at dst head 2

A head range of one page is contiguous for K and for V, so a pair's push is one run per page per
layer per K/V. `PushRoute` is one (sender, receiver) pair of one request; `received_heads` the
same pairs seen from the receiver (which heads of its pages each sender writes: what
`transfer.verify` checks per pair); `HeadLayout` the fleet's facts a connector needs (the model's
heads, the other side's tensor parallelism). Pure Python: run by the connectors of both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def kv_heads_of(num_kv_heads: int, num_ranks: int, rank: int) -> range:
    """The model's KV heads that ``rank`` of ``num_ranks`` holds (see the module docstring).

    Raises:
        ValueError: the heads do not shard over ``num_ranks`` or ``rank`` is outside them.
    """
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank: expected one of [0, {num_ranks}), got {rank}")
    if num_ranks <= num_kv_heads:
        if num_kv_heads % num_ranks:
            raise ValueError(f"num_kv_heads {num_kv_heads} does not divide by tensor_parallel {num_ranks}")
        per = num_kv_heads // num_ranks
        return range(rank * per, (rank + 1) * per)
    if num_ranks % num_kv_heads:
        raise ValueError(f"tensor_parallel {num_ranks} is above num_kv_heads {num_kv_heads} and not a multiple of it")
    head = rank * num_kv_heads // num_ranks
    return range(head, head + 1)


def writer_of(head: int, num_kv_heads: int, num_ranks: int) -> int:
    """The one rank of ``num_ranks`` that sends ``head``: the lowest that holds it."""
    if num_ranks <= num_kv_heads:
        return head // (num_kv_heads // num_ranks)
    return head * (num_ranks // num_kv_heads)


def senders_of(num_kv_heads: int, src_ranks: int, dst_ranks: int, dst_rank: int) -> tuple[int, ...]:
    """The sender ranks (of ``src_ranks``) that write into ``dst_rank`` (of ``dst_ranks``), lowest first."""
    heads = kv_heads_of(num_kv_heads, dst_ranks, dst_rank)
    return tuple(sorted({writer_of(h, num_kv_heads, src_ranks) for h in heads}))


def received_heads(num_kv_heads: int, src_ranks: int, dst_ranks: int, dst_rank: int) -> tuple[tuple[int, int], ...]:
    """Per sender of ``dst_rank`` (`senders_of` order), the heads it writes there, as ``(first,
    count)`` in ``dst_rank``'s pages: the receiver's side of each sender's `PushRoute`
    (``dst_head``, ``num_heads``), which the receiver computes without asking the senders."""
    theirs = kv_heads_of(num_kv_heads, dst_ranks, dst_rank)
    ranges = []
    for sender in senders_of(num_kv_heads, src_ranks, dst_ranks, dst_rank):
        heads = [h for h in theirs if writer_of(h, num_kv_heads, src_ranks) == sender]
        ranges.append((heads[0] - theirs.start, len(heads)))
    return tuple(ranges)


@dataclass(frozen=True)
class PushRoute:
    """One receiver rank a sender rank writes a request's heads into.

    Attributes:
        pe: the receiver rank's PE.
        ticket: the doorbell word this sender rings there (one per sender of that receiver).
        src_head: the first head written, in the sender's pages (its local head index).
        dst_head: where it goes in the receiver's pages (the receiver's local head index).
        num_heads: heads written (a contiguous range on both sides).
        dst_num_kv_heads: the receiver's local KV heads (its page layout).
        dst_num_pages: the receiver's pages (`HeadLayout.num_pages_of`; its layers are that many
            of its pages apart); None: as many as the sender's.
    """

    pe: int
    ticket: Any
    src_head: int
    dst_head: int
    num_heads: int
    dst_num_kv_heads: int
    dst_num_pages: int | None = None



def route_pages(route: PushRoute, shape: tuple[int, ...], allocation_elements: int) -> tuple[int, int]:
    """``(named, room)``: the receiver pages ``route`` names (``dst_num_pages``, or the sender's
    own where None) and the most that an allocation of ``allocation_elements`` holds in the
    receiver's page shape, for a sender whose pages are ``shape`` (``[L, N, 2, H, P, D]``). Every
    PE's symmetric allocation is alike, so a route with ``named > room`` would write past the
    receiver's (its layers are ``named`` pages apart): refused at add (`HeapConnector.check_dest`)
    and at attach (`KVPusher.attach_routes`)."""
    num_layers, own_pages, two, _, page_size, head_dim = (int(n) for n in shape)
    named = own_pages if route.dst_num_pages is None else int(route.dst_num_pages)
    return named, allocation_elements // (num_layers * two * route.dst_num_kv_heads * page_size * head_dim)

def routes_of(num_kv_heads: int, src_ranks: int, src_rank: int, dst_pes: tuple[int, ...],
              dst_tickets: tuple[Any, ...], dst_num_pages: int | None = None) -> tuple[PushRoute, ...]:
    """The routes of sender ``src_rank`` (of ``src_ranks``) into every decode rank of a destination.

    Args:
        num_kv_heads: the model's KV heads.
        src_ranks, src_rank: the sending instance's tensor parallelism and this rank.
        dst_pes: the receiver PEs, decode rank 0 first (``len`` is the decode tensor parallelism).
        dst_tickets: per decode rank, its doorbell: one ticket (one sender) or a tuple with one per
            sender, in `senders_of` order.
        dst_num_pages: each decode rank's pages (`HeadLayout.num_pages_of`); None: the sender's.

    Returns:
        One route per decode rank this rank writes into (none when other ranks write all its heads).
    """
    dst_ranks = len(dst_pes)
    mine = kv_heads_of(num_kv_heads, src_ranks, src_rank)
    routes = []
    for rank, (pe, ticket) in enumerate(zip(dst_pes, dst_tickets)):
        theirs = kv_heads_of(num_kv_heads, dst_ranks, rank)
        heads = [h for h in mine if h in theirs and writer_of(h, num_kv_heads, src_ranks) == src_rank]
        if not heads:
            continue
        senders = senders_of(num_kv_heads, src_ranks, dst_ranks, rank)
        mine_ticket = ticket[senders.index(src_rank)] if isinstance(ticket, tuple) else ticket
        routes.append(PushRoute(pe, mine_ticket, heads[0] - mine.start, heads[0] - theirs.start, len(heads),
                                len(theirs), dst_num_pages))
    return tuple(routes)


@dataclass(frozen=True)
class HeadLayout:
    """What a connector knows of the fleet's head split (built by the engine from its options).

    Attributes:
        num_kv_heads: the model's KV heads (the checkpoint's, not a rank's share).
        num_ranks: this instance's tensor parallelism; rank: this engine's rank in it.
        peer_ranks: the tensor parallelism of the other side of this engine's transfers (the
            decode instances' for a prefill engine, the prefill instances' for a decode engine).
        num_pages: the fleet's page count, in pages of the side with the most heads per rank:
            every PE's KV allocation holds that many of those pages, and a rank of the other side
            views the same bytes as more, narrower pages (`num_pages_of`). None only where the
            sides do not differ (each side views its pages as its own).

    Raises:
        ValueError: the sides differ and ``num_pages`` is None: each side would view the
            allocation as pages of its own heads, so a sender would address a receiver's layers
            at its own page count, not the receiver's (the wrong bytes, or past its allocation).
    """

    num_kv_heads: int
    num_ranks: int
    rank: int
    peer_ranks: int
    num_pages: int | None = None

    def __post_init__(self) -> None:
        if self.is_split and self.num_pages is None:
            raise ValueError(f"HeadLayout.num_pages: expected the fleet's page count where the sides differ "
                             f"(TP {self.num_ranks} here, {self.peer_ranks} on the other side), got None")

    @property
    def is_split(self) -> bool:
        """The two sides differ: pushes go by head routes (else rank i sends to rank i)."""
        return self.num_ranks != self.peer_ranks

    @property
    def num_senders(self) -> int:
        """Sender ranks that write into this rank when it receives (1 unless the sides differ)."""
        if not self.is_split:
            return 1
        return len(senders_of(self.num_kv_heads, self.peer_ranks, self.num_ranks, self.rank))

    @property
    def max_local_heads(self) -> int:
        """The most KV heads one rank holds on either side: every PE's KV allocation is this big
        (the symmetric heap allocates the same bytes on every PE; each views its own share)."""
        return max(len(kv_heads_of(self.num_kv_heads, k, 0)) for k in (self.num_ranks, self.peer_ranks))

    def num_pages_of(self, num_ranks: int) -> int | None:
        """The pages of a rank of the side at ``num_ranks`` ranks in its KV allocation: the
        allocation's ``num_pages`` widest pages, viewed as pages of that rank's heads, e.g. 8 KV
        heads, prefill TP1 and decode TP4, 1000 pages of 8 heads: a decode rank views 4000 pages of
        2 heads (the same bytes; each rank's layers are its own page count apart). Both sides
        compute it alike, so a sender addresses a receiver's layers without asking it."""
        if self.num_pages is None:
            return None
        return self.num_pages * self.max_local_heads // len(kv_heads_of(self.num_kv_heads, num_ranks, 0))

    @property
    def local_num_pages(self) -> int | None:
        """This rank's pages (`num_pages_of` its own side)."""
        return self.num_pages_of(self.num_ranks)

    @property
    def peer_num_pages(self) -> int | None:
        """A rank's pages on the other side (`num_pages_of` the peers' side)."""
        return self.num_pages_of(self.peer_ranks)


def layout_for(model: Any, peer_ranks: int | None, num_pages: int | None = None) -> HeadLayout | None:
    """The head split of an engine over ``model`` (a `disagg.model` Model: its ``full_config`` and
    tensor-parallel group ``tp``) whose transfers' other side runs at ``peer_ranks`` ranks, in a
    fleet of ``num_pages`` pages of its widest side (`HeadLayout.num_pages`).

    Returns:
        None when ``peer_ranks`` is None or this instance's own tensor parallelism (rank i sends
        to rank i: no layout needed).
    """
    tp = getattr(model, "tp", None)
    rank, num_ranks = (tp.rank, tp.size) if tp is not None else (0, 1)
    if peer_ranks is None or peer_ranks == num_ranks:
        return None
    full = getattr(model, "full_config", None) or model.config
    return HeadLayout(int(full.num_kv_heads), num_ranks, rank, int(peer_ranks), num_pages)
