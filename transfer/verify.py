"""Verified landing (`transfer.verify`, a debug mode): each request's pushed KV carries a digest.

The sender (`SenderDigests`, driven by `KVPusher` in the prefill worker) computes, when a request's
last write is issued, a digest of the KV it pushed -- from its own pages, at the local slots it
pushed from -- and writes it into the receiver's digest row beside the doorbell word, before the
ring (same stream, so the ring orders it). The receiver (`ReceiverDigests`, in `HeapReceiver.poll`
of the decode worker) recomputes the digest over its reserved slots once the doorbell has rung and
fails the request with a `TransferError` naming both PEs when they differ: the request is never
admitted to decode on corrupt pages.

The digest (`kv_digest`): per layer, a position-weighted sum of the 16-bit words of every pushed
token's K and V, in the order of the reservation's positions (a page written to the wrong place
or a flipped word changes it). A row of the symmetric table `DigestTable` per doorbell word:

    rows[0, word] = [epoch, src_pe, digest_0, ..., digest_{L-1}]   written by the sender, read here
    rows[1, word]                                                  the sender's staging row (puts)

The table is one more collective allocation, made by every PE right after its KV tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from disagg.errors import TransferError
from disagg.posmap import decompress

if TYPE_CHECKING:
    import torch

    from disagg.plan import ForwardPlan
    from disagg.transfer.doorbell import DoorbellTicket
    from disagg.transfer.heap import SymmetricHeap

DIGEST_MISMATCH = "KV digest mismatch"  # starts the reason of a failed check (the router types it)
WEIGHT_MODULUS = 65521  # position weights run 1..65521: a word's weight is never 0
HEADER_WORDS = 2  # epoch, src_pe


def kv_digest(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Per layer, a position-weighted sum of the 16-bit words of the K/V at ``slots``.

    Args:
        kv: ``[num_layers, num_pages, 2, H_kv, page_size, head_dim]``, any dtype of even itemsize
            (fp8: its bytes).
        slots: int64 ``[n]`` slots (``page * page_size + offset``), in position order, on
            ``kv``'s device.

    Returns:
        int64 ``[num_layers]`` on ``kv``'s device. Word w of position order i counts w x
        (i mod `WEIGHT_MODULUS` + 1): the sum stays below 2**63 for 2**27 words a layer.
    """
    import torch

    page_size = kv.shape[4]
    pages, offsets = slots // page_size, slots % page_size
    out = torch.empty(kv.shape[0], dtype=torch.int64, device=kv.device)
    word_dtype = torch.int16 if kv.element_size() % 2 == 0 else torch.uint8
    weights = None
    for layer in range(kv.shape[0]):
        tokens = kv[layer, pages, :, :, offsets, :].contiguous()  # [n, 2, H_kv, head_dim]
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
    """One request's push as its sender tracks it: the receiver's slots, in position order."""

    pe: int
    remote_slots: np.ndarray


class SenderDigests:
    """The sender's side: which local slot each receiver slot was pushed from, and the digests.

    Args:
        table: this PE's `DigestTable`.
        kv: this PE's KV tensor (the pusher's).
    """

    def __init__(self, table: DigestTable, kv: torch.Tensor) -> None:
        self.table, self.kv = table, kv
        self.num_slots = kv.shape[1] * kv.shape[4]
        self._pushes: dict[tuple[int, int, int], _Push] = {}  # by ticket (pe, index, epoch)
        self._local_of: dict[int, np.ndarray] = {}  # receiver PE -> its slot -> local slot (-1)

    def track(self, ticket: DoorbellTicket, cmap: Sequence[int]) -> None:
        """A request to push into the slots of ``cmap`` (its `RecvDest`'s), rung by ``ticket``."""
        slots = decompress(cmap).astype(np.int64)
        self._pushes[_key(ticket)] = _Push(ticket.pe, slots[slots >= 0])
        if ticket.pe not in self._local_of:
            self._local_of[ticket.pe] = np.full(self.num_slots, -1, dtype=np.int64)

    def forget(self, ticket: DoorbellTicket | None) -> None:
        """The request was detached (aborted) or rung: nothing more to digest for it."""
        if ticket is not None:
            self._pushes.pop(_key(ticket), None)

    def note_plan(self, plan: ForwardPlan) -> None:
        """Record where ``plan`` pushes from: its new tokens' and its existing KV's local slots."""
        for pe, local_of in self._local_of.items():
            new = plan.push_pes == pe
            local_of[plan.push_slots[new]] = plan.append_slots[new]
            old = plan.copy_pes == pe
            local_of[plan.copy_remote_slots[old]] = plan.copy_local_slots[old]

    def write_async(self, ticket: DoorbellTicket, stream: object | None) -> None:
        """Before ``ticket``'s ring: digest the request's pushed KV from the local pages and write
        it into the receiver's row (on ``stream``, after the forward's writes).

        Raises:
            TransferError: a pushed slot has no local slot recorded (a bug of the plan's pushes).
        """
        import torch

        push = self._pushes.pop(_key(ticket), None)
        if push is None:
            raise TransferError("transfer.verify: no push was tracked for this doorbell", request_id=ticket.request_id,
                                src_pe=self.table.heap.rank, dst_pe=ticket.pe)
        local = self._local_of[push.pe][push.remote_slots]
        if (local < 0).any():
            raise TransferError(f"transfer.verify: {int((local < 0).sum())} pushed slots have no local slot "
                                "to digest", request_id=ticket.request_id, src_pe=self.table.heap.rank,
                                dst_pe=ticket.pe)
        digest = kv_digest(self.kv, torch.from_numpy(local).to(self.kv.device, non_blocking=True))
        header = torch.tensor([ticket.epoch, self.table.heap.rank], dtype=torch.int64).to(self.kv.device)
        self.table.write_async(ticket, torch.cat([header, digest]), stream)


class ReceiverDigests:
    """The receiver's side: each reservation's slots, checked against the sender's row at its ring.

    Args:
        table: this PE's `DigestTable`.
        kv: this PE's KV tensor.
    """

    def __init__(self, table: DigestTable, kv: torch.Tensor) -> None:
        self.table, self.kv = table, kv
        self._slots: dict[Hashable, np.ndarray] = {}

    def track(self, request_id: Hashable, cmap: Sequence[int]) -> None:
        slots = decompress(cmap).astype(np.int64)
        self._slots[request_id] = slots[slots >= 0]

    def forget(self, request_id: Hashable) -> None:
        self._slots.pop(request_id, None)

    def check(self, request_id: Hashable, ticket: DoorbellTicket) -> TransferError | None:
        """Whether ``request_id``'s rung pages hold what its sender digested: None when they do,
        else the `TransferError` to fail it with (its text starts with `DIGEST_MISMATCH`)."""
        import torch

        slots = self._slots.pop(request_id)
        row = self.table.landed(ticket.index).cpu()
        epoch, src_pe = int(row[0]), int(row[1])
        if epoch != ticket.epoch:
            return TransferError(f"{DIGEST_MISMATCH}: no digest came with the ring (row epoch {epoch}, "
                                 f"expected {ticket.epoch}; is transfer.verify on for every instance?)",
                                 request_id=request_id, src_pe=-1, dst_pe=ticket.pe)
        mine = kv_digest(self.kv, torch.from_numpy(slots).to(self.kv.device)).cpu()
        bad = torch.nonzero(mine != row[HEADER_WORDS:]).flatten().tolist()
        if not bad:
            return None
        return TransferError(f"{DIGEST_MISMATCH}: the {len(slots)} landed slots differ from what was pushed "
                             f"in layers {bad} (first: {int(mine[bad[0]])} != {int(row[HEADER_WORDS + bad[0]])})",
                             request_id=request_id, src_pe=src_pe, dst_pe=ticket.pe)


def _key(ticket: DoorbellTicket) -> tuple[int, int, int]:
    return ticket.pe, ticket.index, ticket.epoch
