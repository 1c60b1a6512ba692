"""Turn one `ForwardPlan` into the KV pusher's work, after checking it against the heap.

Called by `KVPusher.begin_forward` on the host, before anything is launched, so a bad plan
raises and leaves every cache untouched. Splits the plan's transfers by path:

    receiver load/store reachable   -> fused append+push per layer (dst_index/dst_slots), and
                                       copy_slots for KV that existed at mark_send
    receiver not reachable / forced -> coalesced segment puts from the local pages, per layer,
                                       and for the existing KV, every layer
    head routes (the two sides'     -> per route as above: the fused append+push storing the
    tensor parallelism differs)        route's head range at its head offset into the receiver's
                                       pages (reachable), else segment puts of that head range;
                                       the existing KV by segment puts (`build_routed_work`)

Pure numpy (the pusher moves the arrays to the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from disagg.errors import TransferError
from disagg.kernels.checks import check_disjoint_copy_host
from disagg.plan import ForwardPlan
from disagg.transfer.doorbell import DoorbellTicket
from disagg.transfer.heads import PushRoute
from disagg.transfer.segments import KVGeometry, LayerSegments, coalesce, coalesce_heads


@dataclass(frozen=True)
class PushWork:
    """One forward's transfers, split by path.

    Attributes:
        append_slots: int32 ``[T]`` local slot of each new token (-1: not stored).
        peer_pes: receivers written by the fused kernel; ``dst_index`` indexes this tuple.
        dst_index: int32 ``[T]`` position in ``peer_pes`` of each token's receiver, -1 if none;
            with ``peer_routes``, ``[routes, T]``: up to that many receivers per token.
        peer_routes: head routes only: the route of each ``peer_pes`` entry (the head range it
            takes and its pages' shape); empty: every receiver takes every head.
        dst_slots: int32 ``[T]`` receiver slot for the fused kernel, -1 if none.
        segment_pushes: receiver PE -> runs from local to remote pages of this forward's tokens.
        peer_copies: receiver PE -> (local slots, remote slots) int32 of existing KV.
        segment_copies: receiver PE -> runs of existing KV (every layer).
        rings: doorbells to ring after this forward's last write.
    """

    append_slots: np.ndarray
    peer_pes: tuple[int, ...] = ()
    dst_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    dst_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    peer_routes: tuple[PushRoute, ...] = ()
    segment_pushes: dict[int, LayerSegments] = field(default_factory=dict)
    peer_copies: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    segment_copies: dict[int, LayerSegments] = field(default_factory=dict)
    rings: tuple[DoorbellTicket, ...] = ()

    @property
    def has_transfers(self) -> bool:
        return bool(self.peer_pes or self.segment_pushes or self.peer_copies
                    or self.segment_copies or self.rings)


def request_of_token(plan: ForwardPlan, token: int) -> int:
    """The sequence id that appends token row ``token`` of the batch."""
    return plan.seq_ids[int(np.searchsorted(plan.qo_indptr, token, side="right")) - 1]


def _request_to(plan: ForwardPlan, pe: int) -> int | None:
    sends = [int(s) for s, p in zip(plan.send_seq_ids, plan.send_pes) if int(p) == pe]
    return sends[0] if len(sends) == 1 else None


def _fail(message: str, request: int | None, rank: int, pe: int) -> TransferError:
    return TransferError(message, request_id=request, src_pe=rank, dst_pe=pe)


def check_plan(plan: ForwardPlan, geo: KVGeometry, rank: int, world_size: int,
               doorbells: Mapping[int, DoorbellTicket], routed: Mapping[int, tuple] | None = None) -> None:
    """Raise TransferError/ValueError when ``plan`` cannot run on this heap and KV tensor.

    Checks lengths, slot ranges against the KV geometry (both sides share it; the receivers of
    head routes have their routes' page count), that the fork copies can run as one parallel
    batch (distinct destinations, none also a source), PE range, push map vs tokens (slot and PE
    both set or both -1, each token's PE is its sequence's receiver), and that every completed
    send has a doorbell ticket for its receiver (a sequence in ``routed`` has one per route
    instead: `build_routed_work`).
    """
    num_tokens = plan.num_tokens
    for name in ("append_slots", "push_slots", "push_pes"):
        if len(getattr(plan, name)) != num_tokens:
            raise ValueError(f"plan.{name}: expected {num_tokens} entries (qo_indptr[-1]), got {len(getattr(plan, name))}")
    for group in (("copy_local_slots", "copy_remote_slots", "copy_pes"),
                  ("fork_src_slots", "fork_dst_slots"), ("send_seq_ids", "send_pes", "send_complete")):
        lengths = {name: len(getattr(plan, name)) for name in group}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"plan: {', '.join(group)} must have one length, got {lengths}")
    for name in ("append_slots", "fork_src_slots", "fork_dst_slots"):
        slots = getattr(plan, name)
        if len(slots) and (slots.min() < -1 or slots.max() >= geo.num_slots):
            raise ValueError(f"plan.{name} must be in [-1, {geo.num_slots}) for a KV tensor of "
                             f"{geo.num_pages} pages x {geo.page_size}, got [{slots.min()}, {slots.max()}]: "
                             "plan and heap come from different geometries")
    fork_src, fork_dst = plan.fork_src_slots, plan.fork_dst_slots
    if len(fork_dst):
        keep = (fork_src >= 0) & (fork_dst >= 0)
        check_disjoint_copy_host(fork_src[keep], fork_dst[keep], "plan.fork_src_slots/fork_dst_slots")
    dst_slots = _receiver_slots(geo, routed or {})
    _check_pushes(plan, geo, rank, world_size, dst_slots)
    _check_copies(plan, geo, rank, world_size, dst_slots)
    _check_sends(plan, rank, world_size, doorbells, routed or {})


def _receiver_slots(geo: KVGeometry, routed: Mapping[int, tuple]) -> int:
    """The receivers' slots: this PE's geometry's, or with head routes their receivers' page count
    (every decode rank of a fleet has one; `disagg.transfer.heads.HeadLayout.num_pages_of`)."""
    pages = {route.dst_num_pages for routes in routed.values() for route in routes}
    pages.discard(None)
    return min(pages) * geo.page_size if pages else geo.num_slots


def _check_pe(pe: int, rank: int, world_size: int, request: int | None) -> None:
    if not 0 <= pe < world_size or pe == rank:
        raise _fail(f"receiver PE must be in [0, {world_size}) and not the sender, got {pe}",
                    request, rank, pe)


def distinct(values: np.ndarray) -> list[int]:
    """Sorted distinct values of an int array (no sort for the usual one-receiver case)."""
    if not len(values):
        return []
    lo, hi = int(values.min()), int(values.max())
    return [lo] if lo == hi else [int(x) for x in np.unique(values)]


def _check_pushes(plan: ForwardPlan, geo: KVGeometry, rank: int, world_size: int, dst_slots: int) -> None:
    slots, pes = plan.push_slots, plan.push_pes
    sent_mask = pes >= 0
    bad = np.flatnonzero((slots >= 0) != sent_mask)
    if len(bad):
        t = int(bad[0])
        raise _fail(f"push map and tokens disagree at token {t}: push_slots={slots[t]}, push_pes={pes[t]} "
                    "(both must be -1 or both set)", request_of_token(plan, t), rank, int(pes[t]))
    sent = np.flatnonzero(sent_mask)
    if not len(sent):
        return
    for pe in distinct(pes[sent]):
        _check_pe(pe, rank, world_size, request_of_token(plan, int(sent[pes[sent] == pe][0])))
    out = sent[slots[sent] >= dst_slots]
    if len(out):
        t = int(out[0])
        raise _fail(f"push slot {slots[t]} of token {t} is outside the receiver's [0, {dst_slots}): "
                    "plan and heap come from different geometries", request_of_token(plan, t), rank, int(pes[t]))
    # Each pushed token goes to its sequence's receiver (vectorized over the batch: decode
    # batches hold hundreds of sequences).
    receiver_of = {int(s): int(p) for s, p in zip(plan.send_seq_ids, plan.send_pes)}
    expected = np.array([receiver_of.get(int(seq), -1) for seq in plan.seq_ids], dtype=np.int64)
    expected = np.repeat(expected, np.diff(plan.qo_indptr))
    wrong = np.flatnonzero(sent_mask & (pes != expected))
    if len(wrong):
        t = int(wrong[0])
        seq = request_of_token(plan, t)
        b = plan.seq_ids.index(seq)
        rows = pes[plan.qo_indptr[b]:plan.qo_indptr[b + 1]]
        raise _fail(f"tokens of sequence {seq} are pushed to PE(s) {sorted(set(rows[rows >= 0].tolist()))} but "
                    f"its send record names {receiver_of.get(seq)}", seq, rank, int(pes[t]))


def _check_copies(plan: ForwardPlan, geo: KVGeometry, rank: int, world_size: int, dst_slots: int) -> None:
    for pe in distinct(plan.copy_pes):
        _check_pe(pe, rank, world_size, _request_to(plan, pe))
    for name, limit in (("copy_local_slots", geo.num_slots), ("copy_remote_slots", dst_slots)):
        slots = getattr(plan, name)
        if len(slots) and (slots.min() < 0 or slots.max() >= limit):
            pe = int(plan.copy_pes[int(np.argmax((slots < 0) | (slots >= limit)))])
            raise _fail(f"plan.{name} must be in [0, {limit}), got [{slots.min()}, {slots.max()}]: "
                        "plan and heap come from different geometries", _request_to(plan, pe), rank, pe)


def _check_sends(plan: ForwardPlan, rank: int, world_size: int,
                 doorbells: Mapping[int, DoorbellTicket], routed: Mapping[int, tuple]) -> None:
    for seq, pe, complete in zip(plan.send_seq_ids.tolist(), plan.send_pes.tolist(),
                                 plan.send_complete.tolist()):
        _check_pe(pe, rank, world_size, seq)
        if seq in routed:
            if complete and routed[seq] and routed[seq][0].pe != pe:
                raise _fail(f"the send record names PE {pe}, not the first route's PE {routed[seq][0].pe}",
                            seq, rank, pe)
            continue
        if not complete:
            continue
        ticket = doorbells.get(seq)
        if ticket is None:
            raise _fail("this forward completes the request's KV but no doorbell ticket is attached "
                        "(KVPusher.attach_doorbell)", seq, rank, pe)
        if ticket.pe != pe:
            raise _fail(f"the doorbell ticket belongs to PE {ticket.pe}, not the receiver", seq, rank, pe)


def build_push_work(plan: ForwardPlan, geo: KVGeometry, rank: int,
                    reachable: Callable[[int], bool],
                    doorbells: Mapping[int, DoorbellTicket]) -> PushWork:
    """Split a checked plan's transfers by path (see the module docstring).

    Args:
        plan: a plan that passed `check_plan`.
        geo: the KV tensor's geometry.
        rank: this PE.
        reachable: whether a PE takes the fused store path (else segment puts).
        doorbells: attached tickets by sequence id.

    Raises:
        TransferError: a token sent through segment puts has no local slot to read from.
    """
    pes = plan.push_pes
    receivers = distinct(pes[pes >= 0])
    peer_pes = tuple(pe for pe in receivers if reachable(pe))
    if len(peer_pes) == 1:
        dst_index = np.where(pes == peer_pes[0], 0, -1).astype(np.int32)
    else:
        dst_index = np.full(plan.num_tokens, -1, dtype=np.int32)
        for i, pe in enumerate(peer_pes):
            dst_index[pes == pe] = i
    dst_slots = np.where(dst_index >= 0, plan.push_slots, -1).astype(np.int32)
    segment_pushes = {}
    for pe in (pe for pe in receivers if pe not in peer_pes):
        mine = np.flatnonzero(pes == pe)
        unstored = mine[plan.append_slots[mine] < 0]
        if len(unstored):
            raise _fail(f"token {int(unstored[0])} has no local slot, so a segment put cannot read it",
                        request_of_token(plan, int(unstored[0])), rank, pe)
        segment_pushes[pe] = coalesce(plan.append_slots[mine], plan.push_slots[mine], geo)
    peer_copies, segment_copies = {}, {}
    for pe in distinct(plan.copy_pes):
        mine = plan.copy_pes == pe
        local, remote = plan.copy_local_slots[mine], plan.copy_remote_slots[mine]
        if reachable(pe):
            peer_copies[pe] = (local.astype(np.int32), remote.astype(np.int32))
        else:
            segment_copies[pe] = coalesce(local, remote, geo)
    rings = tuple(doorbells[int(seq)] for seq, complete in zip(plan.send_seq_ids, plan.send_complete)
                  if complete)
    return PushWork(append_slots=plan.append_slots.astype(np.int32), peer_pes=peer_pes,
                    dst_index=dst_index, dst_slots=dst_slots, segment_pushes=segment_pushes,
                    peer_copies=peer_copies, segment_copies=segment_copies, rings=rings)


def build_routed_work(plan: ForwardPlan, geo: KVGeometry, rank: int,
                      routed: Mapping[int, tuple[PushRoute, ...]],
                      reachable: Callable[[PushRoute], bool] | None = None) -> PushWork:
    """The transfers of a checked plan whose sequences all go by head routes (the two sides'
    tensor parallelism differs: `disagg.transfer.heads`). A route whose receiver is ``reachable``
    takes the new tokens' head range in the fused append+push (``peer_routes``; a token goes to
    each of its sequence's reachable routes: ``dst_index`` has a row per route); any other takes
    segment runs of its head range from the local pages (`segments.coalesce_heads`) per layer. The
    KV present at mark_send goes by segment runs every layer, whatever the route; each completed
    sequence rings every route's ticket.

    The plan names one PE per sequence (its first route's; `KVConnector.local_dest`); all the
    sequences sent to one PE share their routes' heads and PEs (they go to one decode instance),
    so the copies of existing KV, which the plan keys by PE, take any such sequence's routes.

    Raises:
        TransferError: a pushed sequence has no routes attached, or a token pushed by segment
            puts has no local slot to read from.
    """
    by_pe: dict[int, tuple[PushRoute, ...]] = {}
    for seq, pe in zip(plan.send_seq_ids.tolist(), plan.send_pes.tolist()):
        if seq not in routed:
            raise _fail("the sequence is pushed but has no head routes attached (KVPusher.attach_routes): a "
                        "pusher sends either every sequence by routes or none", seq, rank, pe)
        by_pe.setdefault(pe, routed[seq])
    pes = plan.push_pes
    segment_pushes: dict[int, list] = {}
    peer_routes: list[PushRoute] = []
    index_of: dict[int, int] = {}  # receiver PE -> its position in peer_routes
    rows: list[np.ndarray] = []  # per route position of a sequence: each token's receiver
    for pe in distinct(pes[pes >= 0]):
        mine = np.flatnonzero(pes == pe)
        unstored = mine[plan.append_slots[mine] < 0]  # segment puts read the local pages
        position = 0
        for route in by_pe.get(pe, ()):
            if reachable is not None and reachable(route):
                if route.pe not in index_of:
                    index_of[route.pe] = len(peer_routes)
                    peer_routes.append(route)
                if position == len(rows):
                    rows.append(np.full(plan.num_tokens, -1, dtype=np.int32))
                rows[position][mine] = index_of[route.pe]
                position += 1
                continue
            if len(unstored):
                raise _fail(f"token {int(unstored[0])} has no local slot, so a segment put cannot read it",
                            request_of_token(plan, int(unstored[0])), rank, route.pe)
            segment_pushes.setdefault(route.pe, []).append(_route_runs(
                plan.append_slots[mine], plan.push_slots[mine], geo, route))
    fused = {}
    if peer_routes:
        dst_index = np.stack(rows)
        fused = dict(peer_pes=tuple(r.pe for r in peer_routes), peer_routes=tuple(peer_routes), dst_index=dst_index,
                     dst_slots=np.where((dst_index >= 0).any(axis=0), plan.push_slots, -1).astype(np.int32))
    segment_copies: dict[int, list] = {}
    for pe in distinct(plan.copy_pes):
        mine = plan.copy_pes == pe
        for route in by_pe.get(pe, ()):
            segment_copies.setdefault(route.pe, []).append(_route_runs(
                plan.copy_local_slots[mine], plan.copy_remote_slots[mine], geo, route))
    rings = tuple(route.ticket for seq, complete in zip(plan.send_seq_ids.tolist(), plan.send_complete.tolist())
                  if complete for route in routed[seq])
    return PushWork(append_slots=plan.append_slots.astype(np.int32), **fused,
                    segment_pushes={pe: _joined(runs) for pe, runs in segment_pushes.items()},
                    segment_copies={pe: _joined(runs) for pe, runs in segment_copies.items()}, rings=rings)


def _route_runs(src: np.ndarray, dst: np.ndarray, geo: KVGeometry, route: PushRoute) -> LayerSegments:
    return coalesce_heads(src, dst, geo, route.dst_num_kv_heads, route.src_head, route.dst_head, route.num_heads,
                          route.dst_num_pages)


def _joined(runs: list[LayerSegments]) -> LayerSegments:
    """One receiver's runs of several routes (a sender writes one head range per receiver: one)."""
    if len(runs) == 1:
        return runs[0]
    return LayerSegments(np.concatenate([r.runs for r in runs]), runs[0].src_layer_bytes, runs[0].dst_layer_bytes)
