"""Verified landing (`transfer.verify`, a debug mode): each request's pushed KV carries a digest.

The sender (`SenderDigests`, driven by `KVPusher` in the prefill worker) computes, when a request's
last write is issued, a digest of the KV it pushed -- from its own pages, at the local slots it
pushed from -- and writes it into the receiver's digest row beside the doorbell word, before the
ring (same stream, so the ring orders it). The receiver (`ReceiverDigests`, in `HeapReceiver.poll`
of the decode worker) recomputes the digest over its reserved slots once the doorbell has rung and
fails the request with a `TransferError` naming both PEs when they differ: the request is never
admitted to decode on corrupt pages.

Prefill and decode at different tensor parallelism (`disagg.transfer.heads`): a decode rank is
written by one or more sender ranks, each by a route with its own doorbell word. The digest is
then one per (sender, receiver) route and covers exactly that route's bytes: the sender digests
its head range ``[src_head, +num_heads)`` of the pushed slots, the receiver the same heads at
their offset in its own pages (``[dst_head, +num_heads)``, `heads.received_heads`), each sender's
row at its own word; a mismatch names that sender's PE.

The digest (`kv_digest`): per layer, a position-weighted sum of the 16-bit words of every pushed
token's K and V (of the route's heads), in the order of the reservation's positions (a page
written to the wrong place or a flipped word changes it). A row of the symmetric table
`DigestTable` per doorbell word:

    rows[0, word] = [epoch, src_pe, digest_0, ..., digest_{L-1}]   written by the sender, read here
    rows[1, word]                                                  the sender's staging row (puts)

The table is one more collective allocation, made by every PE right after its KV tensor. Torch
ops only (gathers, integer sums, copies), the same on CUDA as on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import numpy as np

from disagg.errors import TransferError
from disagg.posmap import decompress
from disagg.transfer.lease import tickets_of

if TYPE_CHECKING:
    import torch

    from disagg.plan import ForwardPlan
    from disagg.transfer.doorbell import DoorbellTicket
    from disagg.transfer.heap import SymmetricHeap

DIGEST_MISMATCH = "KV digest mismatch"  # starts the reason of a failed check (the router types it)
WEIGHT_MODULUS = 65521  # position weights run 1..65521: a word's weight is never 0
HEADER_WORDS = 2  # epoch, src_pe


def kv_digest(kv: torch.Tensor, slots: torch.Tensor, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """Per layer, a position-weighted sum of the 16-bit words of the K/V at ``slots``.

    Args:
        kv: ``[num_layers, num_pages, 2, H_kv, page_size, head_dim]``, any dtype of even itemsize
            (fp8: its bytes).
        slots: int64 ``[n]`` slots (``page * page_size + offset``), in position order, on
            ``kv``'s device.
        heads: ``(first, count)``: only those KV heads of each page (a head route's); None: all.

    Returns:
        int64 ``[num_layers]`` on ``kv``'s device. Word w of position order i counts w x
        (i mod `WEIGHT_MODULUS` + 1): the sum stays below 2**63 for 2**27 words a layer.

    Raises:
        ValueError: ``heads`` is not a non-empty range inside ``kv``'s heads.
    """
    import torch

    first, count = (0, kv.shape[3]) if heads is None else heads
    if count < 1 or first < 0 or first + count > kv.shape[3]:
        raise ValueError(f"heads: expected (first, count) with count >= 1 inside the {kv.shape[3]} KV heads of "
                         f"kv (shape {tuple(kv.shape)}), got {heads}")
    page_size = kv.shape[4]
    pages, offsets = slots // page_size, slots % page_size
    out = torch.empty(kv.shape[0], dtype=torch.int64, device=kv.device)
    word_dtype = torch.int16 if kv.element_size() % 2 == 0 else torch.uint8
    weights = None
    for layer in range(kv.shape[0]):
        # [n, 2, count, head_dim]: the two advanced indices (pages, offsets) go first
        tokens = kv[layer, pages, :, first:first + count, offsets, :].contiguous()
        words = tokens.view(word_dtype).reshape(-1).to(torch.int64) & 0xFFFF
        if weights is None:
            weights = torch.arange(words.numel(), dtype=torch.int64, device=kv.device) % WEIGHT_MODULUS + 1
        out[layer] = (words * weights).sum()
    return out


class DigestTable:
    """The symmetric digest rows of one PE (module docstring); collective to build.

    Args:
        heap: this PE's heap; one row per signal word.
        num_layers: the KV tensor's layers.
    """

    def __init__(self, heap: SymmetricHeap, num_layers: int) -> None:
        import torch

        self.heap = heap
        self.rows = heap.alloc((2, heap.num_signals, HEADER_WORDS + num_layers), torch.int64)
        self._peer_rows: dict[int, torch.Tensor | None] = {}
        self._row_bytes = self.rows.shape[2] * self.rows.element_size()

    def write_async(self, ticket: DoorbellTicket, row: torch.Tensor, stream: object | None) -> None:
        """Write ``row`` (int64 ``[2 + num_layers]``) into ``ticket``'s receiver row, ordered on
        ``stream`` (inline on the CPU): a store through the peer view, or a put from the staging
        row where the receiver is not load/store reachable."""
        pe = ticket.pe
        if pe not in self._peer_rows:
            self._peer_rows[pe] = self.heap.peer(self.rows, pe)
        peer = self._peer_rows[pe]
        if peer is not None:
            peer[0, ticket.index].copy_(row, non_blocking=True)
            return
        self.rows[1, ticket.index].copy_(row, non_blocking=True)
        staged = (self.rows.shape[1] + ticket.index) * self._row_bytes
        landed = ticket.index * self._row_bytes
        self.heap.put_segments_async(self.rows, pe, np.array([[staged, landed, self._row_bytes]], dtype=np.int64),
                                     stream)

    def landed(self, index: int) -> torch.Tensor:
        """The row senders wrote for doorbell word ``index`` of this PE."""
        return self.rows[0, index]


@dataclass
class _Push:
    """One request's push into one receiver as its sender tracks it.

    Attributes:
        plan_pe: the PE the forward plans' pushes name (the receiver's; with head routes, the
            first route's, for every route of the request: one position map serves them all).
        remote_slots: the receiver's slots, in position order.
        heads: ``(first, count)`` of this PE's heads that go (a route's); None: every head.
        seq_id: the sequence of a routed push (None: one receiver).
    """

    plan_pe: int
    remote_slots: np.ndarray
    heads: tuple[int, int] | None = None
    seq_id: int | None = None


class SenderDigests:
    """The sender's side: which local slot each receiver slot was pushed from, and the digests.

    Args:
        table: this PE's `DigestTable`.
        kv: this PE's KV tensor (the pusher's).
    """

    def __init__(self, table: DigestTable, kv: torch.Tensor) -> None:
        self.table, self.kv = table, kv
        self.num_slots = kv.shape[1] * kv.shape[4]
        self.page_size = kv.shape[4]
        self._pushes: dict[tuple[int, int, int], _Push] = {}  # by ticket (pe, index, epoch)
        # plan PE -> its slot (a receiver's: its pages may outnumber ours) -> local slot (-1)
        self._local_of: dict[int, np.ndarray] = {}
        self._routed: dict[int, set[tuple[int, int, int]]] = {}  # seq -> its routes' pending tickets

    def track(self, ticket: DoorbellTicket, cmap: Sequence[int]) -> None:
        """A request to push into the slots of ``cmap`` (its `RecvDest`'s), rung by ``ticket``."""
        self._track(ticket, _Push(ticket.pe, _slots(cmap)))

    def track_routes(self, seq_id: int, plan_pe: int, routes: Sequence[Any], cmap: Sequence[int]) -> None:
        """A request pushed by head routes (`disagg.transfer.heads.PushRoute` each): one digest per
        route, of its heads, rung by its ticket; the plans name ``plan_pe`` for all of them."""
        slots = _slots(cmap)
        for route in routes:
            num_slots = self.num_slots if route.dst_num_pages is None else route.dst_num_pages * self.page_size
            self._track(route.ticket, _Push(plan_pe, slots, (route.src_head, route.num_heads), seq_id), num_slots)
            self._routed.setdefault(seq_id, set()).add(_key(route.ticket))

    def _track(self, ticket: DoorbellTicket, push: _Push, num_slots: int | None = None) -> None:
        self._pushes[_key(ticket)] = push
        num_slots = self.num_slots if num_slots is None else num_slots
        known = self._local_of.get(push.plan_pe)
        if known is None or len(known) < num_slots:
            grown = np.full(num_slots, -1, dtype=np.int64)
            if known is not None:
                grown[:len(known)] = known
            self._local_of[push.plan_pe] = grown

    def forget(self, ticket: DoorbellTicket | None) -> None:
        """The request was detached (aborted) or rung: nothing more to digest for it."""
        if ticket is not None:
            self._pushes.pop(_key(ticket), None)

    def forget_routes(self, seq_id: int) -> None:
        """The routed request ``seq_id`` was detached (aborted): none of its routes is digested."""
        for key in self._routed.pop(seq_id, ()):
            self._pushes.pop(key, None)

    def note_plan(self, plan: ForwardPlan) -> None:
        """Record where ``plan`` pushes from: its new tokens' and its existing KV's local slots."""
        for pe, local_of in self._local_of.items():
            new = plan.push_pes == pe
            local_of[plan.push_slots[new]] = plan.append_slots[new]
            old = plan.copy_pes == pe
            local_of[plan.copy_remote_slots[old]] = plan.copy_local_slots[old]

    def write_async(self, ticket: DoorbellTicket, stream: object | None) -> None:
        """Before ``ticket``'s ring: digest the request's pushed KV (a route's: its heads) from the
        local pages and write it into the receiver's row (on ``stream``, after the forward's writes).

        Raises:
            TransferError: a pushed slot has no local slot recorded (a bug of the plan's pushes).
        """
        import torch

        push = self._pushes.pop(_key(ticket), None)
        if push is None:
            raise TransferError("transfer.verify: no push was tracked for this doorbell", request_id=ticket.request_id,
                                src_pe=self.table.heap.rank, dst_pe=ticket.pe)
        if push.seq_id is not None:
            pending = self._routed.get(push.seq_id, set())
            pending.discard(_key(ticket))
            if not pending:
                self._routed.pop(push.seq_id, None)
        local = self._local_of[push.plan_pe][push.remote_slots]
        if (local < 0).any():
            raise TransferError(f"transfer.verify: {int((local < 0).sum())} pushed slots have no local slot "
                                "to digest", request_id=ticket.request_id, src_pe=self.table.heap.rank,
                                dst_pe=ticket.pe)
        digest = kv_digest(self.kv, torch.from_numpy(local).to(self.kv.device, non_blocking=True), push.heads)
        header = torch.tensor([ticket.epoch, self.table.heap.rank], dtype=torch.int64).to(self.kv.device)
        self.table.write_async(ticket, torch.cat([header, digest]), stream)


class ReceiverDigests:
    """The receiver's side: each reservation's slots, checked against the senders' rows at its ring.

    Args:
        table: this PE's `DigestTable`.
        kv: this PE's KV tensor.
        sender_heads: per sender rank of a reservation (its tickets' order), the ``(first, count)``
            of this PE's heads it writes (`disagg.transfer.heads.received_heads`); None: one
            sender, every head.
    """

    def __init__(self, table: DigestTable, kv: torch.Tensor,
                 sender_heads: tuple[tuple[int, int], ...] | None = None) -> None:
        self.table, self.kv = table, kv
        self.sender_heads = sender_heads
        self._slots: dict[Hashable, np.ndarray] = {}

    def track(self, request_id: Hashable, cmap: Sequence[int]) -> None:
        self._slots[request_id] = _slots(cmap)

    def forget(self, request_id: Hashable) -> None:
        self._slots.pop(request_id, None)

    def check(self, request_id: Hashable, ticket: DoorbellTicket | tuple[DoorbellTicket, ...]) -> TransferError | None:
        """Whether ``request_id``'s rung pages hold what its senders digested: None when they do,
        else the `TransferError` to fail it with (its text starts with `DIGEST_MISMATCH`), of the
        first sender whose route differs (its PE as source).

        Args:
            ticket: the reservation's doorbell: one ticket, or one per sender rank.
        """
        import torch

        slots = self._slots.pop(request_id)
        tickets = tickets_of(ticket)
        ranges = self.sender_heads or (None,)
        assert len(tickets) == len(ranges), \
            f"a reservation has one doorbell word per sender rank ({len(ranges)}), got {len(tickets)}"
        device_slots = torch.from_numpy(slots).to(self.kv.device)
        for one, heads in zip(tickets, ranges):
            error = self._check_route(request_id, one, heads, device_slots, len(slots))
            if error is not None:
                return error
        return None

    def _check_route(self, request_id: Hashable, ticket: DoorbellTicket, heads: tuple[int, int] | None,
                     slots: torch.Tensor, num_slots: int) -> TransferError | None:
        """One sender's row against the digest of its heads here."""
        import torch

        row = self.table.landed(ticket.index).cpu()
        epoch, src_pe = int(row[0]), int(row[1])
        if epoch != ticket.epoch:
            return TransferError(f"{DIGEST_MISMATCH}: no digest came with the ring (row epoch {epoch}, "
                                 f"expected {ticket.epoch}; is transfer.verify on for every instance?)",
                                 request_id=request_id, src_pe=-1, dst_pe=ticket.pe)
        mine = kv_digest(self.kv, slots, heads).cpu()
        bad = torch.nonzero(mine != row[HEADER_WORDS:]).flatten().tolist()
        if not bad:
            return None
        what = "" if heads is None else f" (heads {heads[0]}..{heads[0] + heads[1] - 1} of this PE)"
        return TransferError(f"{DIGEST_MISMATCH}: the {num_slots} landed slots{what} differ from what was pushed "
                             f"in layers {bad} (first: {int(mine[bad[0]])} != {int(row[HEADER_WORDS + bad[0]])})",
                             request_id=request_id, src_pe=src_pe, dst_pe=ticket.pe)


def _slots(cmap: Sequence[int]) -> np.ndarray:
    """The reserved slots of ``cmap``, in position order, the skipped ones (-1) left out."""
    slots = decompress(cmap).astype(np.int64)
    return slots[slots >= 0]


def _key(ticket: DoorbellTicket) -> tuple[int, int, int]:
    return ticket.pe, ticket.index, ticket.epoch
