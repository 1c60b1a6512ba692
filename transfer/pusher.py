"""The KV pusher: a worker's writer of new K/V, locally and into receivers' pages, layer by layer.

The symmetric heaps' KV sender (`heap_connector.HeapSender`) is this pusher plus the abort
fence; the prefill worker's model runner drives it once per forward (its own process, its own GPU):

    pusher.attach_doorbell(seq_id, ticket)      # once per request, after cache.disagg_mark_send
    plan = cache.begin_forward(seq_ids, lengths)
    pusher.begin_forward(plan)                  # checks; fork copies; existing KV page to page
    for layer in range(num_layers):
        k, v = ...                              # this layer's new K/V, on the current stream
        pusher.push_layer_async(layer, k, v)    # ONE fused append+push launch (transfer stream)
        pusher.wait_layer(layer)                # before attention reads the local pages
                                                # (the two: `HeapSender.save_layer`, the model's hook)
        ...
    pusher.end_forward()                        # rings the doorbells of completed requests
    cache.end_forward()

On CUDA the pushes run on transfer streams that wait (CUDA events) for each layer's K/V, so the
caller's next kernels queue without a host sync; `k`/`v` are recorded on those streams so the
allocator does not reuse them early. Layers alternate between two transfer streams: when layers
queue faster than NVLink drains them (a prompt whose K/V is all ready, a chunk of many layers),
layer l+1's programs start while layer l's last ones finish instead of after them (each launch's
tail would otherwise idle the link for a few microseconds per layer). Everything that must follow
all layers (the doorbells) waits on both. Receivers that `SymmetricHeap.peer` cannot reach (another
node), or every receiver when ``force_segment_puts``, take coalesced segment puts from the local
pages instead: one put per contiguous run per layer. On CPU (shm heap) everything runs inline.
A sequence attached with head routes (`attach_routes`: prefill and decode at different tensor
parallelism, `disagg.transfer.heads`) goes, per route, by the same fused launch storing the
route's head range at its head offset into the receiver's pages (a view of ``allocation``, the
symmetric allocation every PE's pages start at, in the receiver's page shape), or by segment
puts of that head range where the receiver is not load/store reachable
(`push_plan.build_routed_work`), and is rung on every route's ticket.

Where the local pages are written: by default the fused launch on the transfer stream writes
them along with the receivers' pages (each K/V tile loaded once), so a caller that reads this
layer's pages (paged attention over a cached prefix or earlier chunks) waits in `wait_layer`
until the launch, NVLink stores included, is done. A caller that does this every layer can pass
``append_on_caller_stream=True``: the local append then runs on the caller's stream (ordered
before its attention, no wait at all) and a second launch on the transfer stream stores to the
receivers only, reading k/v a second time (a local read of a few percent of the layer's bytes).
A prompt with no cached prefix attends over its new K/V directly and never waits: keep the
default. The benchmark measures both (`benchmarks/bench_transfer.py`, overlap rows).

Host time per layer is what bounds a layer-wise push (a layer's 32 MiB cross NVLink in ~100 us):
`begin_forward` does everything that is per forward (plan checks, index arrays to the device in one
copy, the fused kernel's receiver table and compiled kernel: `disagg.kernels.append.
prepare_append_push`), so `push_layer_async` only records two reused events, makes the transfer
stream wait, and launches the prepared kernel on that stream (no stream context switch, no
allocation, no host sync).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass

import numpy as np
import torch

from disagg.errors import ForwardStateError, TransferError
from disagg.kernels import copy_slots
from disagg.kernels.append import PreparedAppend, prepare_append_push
from disagg.plan import ForwardPlan
from disagg.transfer.doorbell import DoorbellTicket, ring_async
from disagg.transfer.heap import SymmetricHeap
from disagg.transfer.heads import PushRoute, route_pages
from disagg.transfer.push_plan import PushWork, build_push_work, build_routed_work, check_plan, request_of_token
from disagg.transfer.segments import KVGeometry, LayerSegments
from disagg.transfer.verify import SenderDigests

logger = logging.getLogger(__name__)

# Index arrays copied to the device together start a multiple of this many entries apart (`_to_device`).
ALIGN_INDICES = 4


@dataclass
class _Forward:
    """State of the open forward.

    Attributes:
        append: the per-layer launcher on the transfer stream, checked and resolved once: the
            fused append+push, or (``append_on_caller_stream``) the receivers' stores alone;
            None when there is nothing to launch there.
        local: ``append_on_caller_stream`` only: the local append on the caller's stream.
        segment_pushes: (receiver PE, runs) for receivers reached by segment puts.
        pushed: per layer, whether it was pushed in this forward.
        events: per layer, its "written" event (CUDA with transfers), else None.
    """

    plan: ForwardPlan
    work: PushWork
    append: PreparedAppend | None
    local: PreparedAppend | None
    segment_pushes: list[tuple[int, LayerSegments]]
    pushed: list[bool]
    events: list[torch.cuda.Event | None]


class KVPusher:
    """Writes one worker's KV cache and pushes it to receivers; see the module docstring.

    Args:
        heap: this PE's symmetric heap.
        kv: ``[num_layers, num_pages, 2, H_kv, P, D]`` from ``heap.alloc``, contiguous.
        force_segment_puts: send to every receiver with segment puts even when it is load/store
            reachable (the path of peers on other nodes, testable on one node).
        append_on_caller_stream: write the local pages with a separate append on the caller's
            stream (see the module docstring); default: one fused launch on the transfer stream.
        allocation: the flat symmetric allocation ``kv`` views from its start, when receivers'
            pages are laid out wider than this PE's (head routes); None: ``kv`` itself.
    """

    def __init__(self, heap: SymmetricHeap, kv: torch.Tensor, *, force_segment_puts: bool = False,
                 append_on_caller_stream: bool = False, allocation: torch.Tensor | None = None) -> None:
        if kv.dim() != 6 or kv.shape[2] != 2 or not kv.is_contiguous():
            raise ValueError(f"kv: expected a contiguous [num_layers, num_pages, 2, H, P, D] tensor, "
                             f"got shape {tuple(kv.shape)} strides {kv.stride()}")
        if allocation is not None and (allocation.data_ptr() != kv.data_ptr() or allocation.dim() != 1
                                       or allocation.numel() < kv.numel()):
            raise ValueError(f"allocation: expected the 1-D symmetric allocation kv views from its start, got shape "
                             f"{tuple(allocation.shape)} at another address or smaller than kv {tuple(kv.shape)}")
        heap.peer(kv, heap.rank)  # raises unless kv is this heap's memory
        self.heap = heap
        self.kv = kv
        # What segment puts address (the receivers' pages may be laid out wider than this PE's).
        self._segment_base = kv if allocation is None else allocation
        self.geometry = KVGeometry.of(tuple(kv.shape), kv.element_size())
        self.force_segment_puts = force_segment_puts
        self.append_on_caller_stream = append_on_caller_stream
        # Two transfer streams, alternated by layer (see the module docstring); [0] also carries
        # the copies of existing KV and the doorbells.
        self._streams = [torch.cuda.Stream(kv.device) for _ in range(2)] if kv.is_cuda else []
        self._stream = self._streams[0] if kv.is_cuda else None
        self._device_index = kv.device.index if kv.is_cuda else None
        # Reused every forward (fewer host calls per layer): "K/V ready" on the caller's stream,
        # "layer written" on the transfer stream.
        num_events = self.geometry.num_layers + 1 if kv.is_cuda else 0
        self._ready_events = [torch.cuda.Event() for _ in range(num_events)]
        self._done_events = [torch.cuda.Event() for _ in range(num_events)]
        self._peer_kv: dict[int, torch.Tensor | None] = {}
        self._appends: dict[tuple, PreparedAppend] = {}  # by receiver PEs (and head routes)
        # Head routes' receivers: their pages seen from here, by `_route_key` (None: segment puts).
        self._route_views: dict[tuple, torch.Tensor | None] = {}
        self._doorbells: dict[int, DoorbellTicket] = {}
        self._routes: dict[int, tuple[PushRoute, ...]] = {}  # sequences sent by head routes
        self._forward: _Forward | None = None
        # `transfer.verify`: digests each request's pushed KV before its ring (`disagg.transfer.verify`)
        self.digests: SenderDigests | None = None

    # ------------------------------------------------------------------ requests
    def attach_doorbell(self, seq_id: int, ticket: DoorbellTicket) -> None:
        """Ring ``ticket`` after the forward that writes the last token of ``seq_id``'s remote map."""
        if not 0 <= ticket.pe < self.heap.world_size or ticket.pe == self.heap.rank:
            raise TransferError(f"doorbell ticket names PE {ticket.pe}, expected a receiver in "
                                f"[0, {self.heap.world_size}) other than the sender",
                                request_id=seq_id, src_pe=self.heap.rank, dst_pe=ticket.pe)
        self._doorbells[seq_id] = ticket
        logger.debug("request %s: PE %d -> PE %d, doorbell word %d epoch %d",
                     seq_id, self.heap.rank, ticket.pe, ticket.index, ticket.epoch)

    def attach_routes(self, seq_id: int, routes: tuple[PushRoute, ...]) -> None:
        """Send ``seq_id``'s heads by ``routes`` (the two sides' tensor parallelism differs:
        `disagg.transfer.heads`) and ring every route's ticket after the forward that writes its
        last token. No routes: other ranks write every head of it; only the local pages are.

        Raises:
            TransferError: a route names a PE that is not a receiver, or more receiver pages than
                this PE's symmetric allocation holds (the two sides' page counts disagree: every
                layer past the first would land at the wrong offset). Nothing is attached.
        """
        for route in routes:
            if not 0 <= route.pe < self.heap.world_size or route.pe == self.heap.rank or route.ticket.pe != route.pe:
                raise TransferError(f"route names PE {route.pe} (ticket PE {route.ticket.pe}), expected a receiver in "
                                    f"[0, {self.heap.world_size}) other than the sender",
                                    request_id=seq_id, src_pe=self.heap.rank, dst_pe=route.pe)
            self._check_route_pages(seq_id, route)
        self._routes[seq_id] = tuple(routes)
        logger.debug("request %s: PE %d -> %s", seq_id, self.heap.rank,
                     ", ".join(f"PE {r.pe} heads {r.src_head}+{r.num_heads} at {r.dst_head}" for r in routes))

    def detach_doorbell(self, seq_id: int) -> DoorbellTicket | None:
        """Forget ``seq_id``'s ticket or routes (an aborted request); return its ticket, or None
        if none (or it went by routes)."""
        self._routes.pop(seq_id, None)
        return self._doorbells.pop(seq_id, None)

    # ------------------------------------------------------------------ forward
    def begin_forward(self, plan: ForwardPlan) -> None:
        """Check ``plan``, apply its fork copies, and start its page-to-page copies.

        Raises:
            ForwardStateError: a forward is already open.
            TransferError, ValueError: the plan does not fit this heap and KV tensor, or the heap
                is closed (nothing was written).
        """
        self._check_plan(plan, "begin_forward")
        work = self._build_work(plan)
        if self.digests is not None:
            self.digests.note_plan(plan)
        append, local = self._prepare_appends(work)
        num_layers = self.geometry.num_layers
        fwd = _Forward(plan=plan, work=work, append=append, local=local,
                       segment_pushes=list(work.segment_pushes.items()),
                       pushed=[False] * num_layers, events=[None] * num_layers)
        if len(plan.fork_src_slots):
            fork_src, fork_dst = self._to_device(plan.fork_src_slots, plan.fork_dst_slots)
            copy_slots(self.kv, fork_src, self.kv, fork_dst, check_indices=False)
        if work.peer_copies or work.segment_copies:
            with self._on_transfer_stream(num_layers):
                self._copy_existing(work)
        self._forward = fwd

    def push_layer_async(self, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                         k_scale: float | torch.Tensor | None = None,
                         v_scale: float | torch.Tensor | None = None) -> torch.cuda.Event | None:
        """Write ``layer``'s new K/V locally and to every receiver of the open forward.

        Args:
            layer: ``0 <= layer < num_layers``, each once per forward.
            k: ``[T, H_kv, D]`` new keys (T = plan.num_tokens), the cache's dtype (or any
                float dtype with an fp8 cache and scales), on the KV tensor's device.
            v: ``[T, H_kv, D]`` new values, like ``k``.
            k_scale, v_scale: fp8 caches only (see `disagg.kernels.append_kv`).

        Returns:
            On CUDA with transfers: the event after which the layer's writes are done, local and
            remote (with ``append_on_caller_stream``, the local ones are ordered on the caller's
            stream instead); it is recorded again when the same layer is pushed in a later
            forward. None otherwise (CPU work is finished on return; without transfers the
            append ran on the current stream).
        """
        fwd, layer = self._check_layer(layer)
        if fwd.local is not None:  # checks k/v; a refused call has written nothing anywhere
            fwd.local(layer, k, v, k_scale=k_scale, v_scale=v_scale)
        if self._stream is None or not fwd.work.has_transfers:  # CPU (inline), or a local append only
            if fwd.append is not None:
                fwd.append(layer, k, v, k_scale=k_scale, v_scale=v_scale)
            for pe, runs in fwd.segment_pushes:
                self.heap.put_segments_async(self._segment_base, pe, runs.for_layer(layer), None)
            fwd.pushed[layer] = True
            return None
        stream = self._streams[layer % 2]
        ready = self._ready_events[layer]
        ready.record(torch.cuda.current_stream(self._device_index))
        stream.wait_event(ready)
        if fwd.append is not None:
            fwd.append(layer, k, v, k_scale=k_scale, v_scale=v_scale, stream=stream)
        for pe, runs in fwd.segment_pushes:
            self.heap.put_segments_async(self._segment_base, pe, runs.for_layer(layer), stream)
        k.record_stream(stream)
        v.record_stream(stream)
        event = self._done_events[layer]
        event.record(stream)
        fwd.pushed[layer] = True
        fwd.events[layer] = event
        return event

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until ``layer``'s local pages are written (no host sync).

        With the fused launch that is its whole launch, receivers' stores included; with
        ``append_on_caller_stream`` the local append is already ordered on the caller's stream
        and nothing is waited for.
        """
        if self._forward is None:
            raise ForwardStateError("KVPusher.wait_layer: no forward is open")
        layer = self._layer_index(layer)
        if not self.append_on_caller_stream:
            self._wait_event(self._forward.events[layer])

    def _wait_event(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self._device_index).wait_event(event)

    def end_forward(self) -> torch.cuda.Event | None:
        """Ring the doorbells of requests this forward completed; close the forward.

        Returns:
            On CUDA with transfers: an event after the rings (all of this forward's transfer
            work); the current stream already waits for the local writes. None otherwise.

        Raises:
            ForwardStateError: no forward is open, or a layer was not pushed.
        """
        fwd = self._forward
        if fwd is None:
            raise ForwardStateError("KVPusher.end_forward: no forward is open")
        missing = [layer for layer, pushed in enumerate(fwd.pushed) if not pushed]
        if missing:
            raise ForwardStateError(f"KVPusher.end_forward: layers {missing} were not pushed in this forward")
        event = None
        if fwd.work.has_transfers:
            # The caller's stream waits for each transfer stream's last layer: after
            # end_forward, nothing this forward launched is still reading its index tensors
            # (freed to the caller stream's allocator) or writing.
            last = self.geometry.num_layers - 1
            for layer in range(max(0, last - 1), last + 1):
                self._wait_event(fwd.events[layer])
            with self._on_transfer_stream(self.geometry.num_layers) as stream:
                for ticket in fwd.work.rings:
                    self._ring_async(ticket, stream)
                if stream is not None:
                    event = self._done_events[self.geometry.num_layers]
                    event.record(stream)
        self._forget_rung(fwd.plan)
        self._forward = None
        return event

    def can_push_written(self, plan: ForwardPlan) -> bool:
        """Whether `push_written` can push ``plan``: every token it pushes has a local slot (the
        copy reads it there once the forward has written it)."""
        pushed = plan.push_pes >= 0
        return not pushed.any() or bool((plan.append_slots[pushed] >= 0).all())

    def push_written(self, plan: ForwardPlan) -> torch.cuda.Event | None:
        """Push ``plan``'s new K/V after a forward that wrote it to the local pages without this
        pusher (a whole-forward CUDA graph: `ModelRunner._pushes_after`), every layer at once, then
        its copies of existing KV, and ring the doorbells it completes: `begin_forward`, every
        `push_layer_async` and `end_forward` in one call, on the transfer stream after the
        caller's work so far (no host sync). The caller applied the plan's fork copies.

        Returns:
            As `end_forward`: on CUDA with transfers, an event after them and the rings.

        Raises:
            ForwardStateError: a forward is open.
            TransferError, ValueError: as `begin_forward` (nothing was written), or a pushed token
                has no local slot (`can_push_written`).
        """
        self._check_plan(plan, "push_written")
        rank = self.heap.rank
        if not self.can_push_written(plan):
            token = int(np.flatnonzero((plan.push_pes >= 0) & (plan.append_slots < 0))[0])
            raise TransferError(f"token {token} is pushed but has no local slot to copy from after the forward "
                                "(push it layer by layer: begin_forward)", request_id=request_of_token(plan, token),
                                src_pe=rank, dst_pe=int(plan.push_pes[token]))
        work = self._build_work(plan, fused=False)
        if self.digests is not None:
            self.digests.note_plan(plan)
        num_layers = self.geometry.num_layers
        event = None
        if work.has_transfers:
            with self._on_transfer_stream(num_layers) as stream:
                self._copy_existing(work)
                for i, pe in enumerate(work.peer_pes):  # the new tokens: page to page, every layer
                    mine = work.dst_index == i
                    local, remote = self._to_device(work.append_slots[mine], work.dst_slots[mine])
                    copy_slots(self.kv, local, self._peer_kv[pe], remote, check_indices=False)
                for pe, runs in work.segment_pushes.items():
                    self.heap.put_segments_async(self._segment_base, pe, runs.for_layers(num_layers), stream)
                for ticket in work.rings:
                    self._ring_async(ticket, stream)
                if stream is not None:
                    event = self._done_events[num_layers]
                    event.record(stream)
        self._forget_rung(plan)
        return event

    def synchronize(self) -> None:
        """Block the host until every transfer issued so far is done (tests, shutdown)."""
        for stream in self._streams:
            stream.synchronize()

    # ------------------------------------------------------------------ internals
    def _build_work(self, plan: ForwardPlan, fused: bool = True) -> PushWork:
        """``plan``'s transfers; not ``fused``: no head route takes the fused launch (what
        `push_written` sends page to page from the local pages)."""
        if self._routes and plan.has_transfers:
            return build_routed_work(plan, self.geometry, self.heap.rank, self._routes,
                                     self._route_reachable if fused else None)
        return build_push_work(plan, self.geometry, self.heap.rank, self._reachable, self._doorbells)

    def _ring_async(self, ticket: DoorbellTicket, stream: torch.cuda.Stream | None) -> None:
        """Ring ``ticket`` on ``stream``; with `transfer.verify`, its digest goes first."""
        if self.digests is not None:
            self.digests.write_async(ticket, stream)
        ring_async(self.heap, ticket, stream)

    def _check_plan(self, plan: ForwardPlan, entry: str) -> None:
        """What `begin_forward` and `push_written` (``entry``) refuse before writing anything: an
        open forward, a closed heap, a plan that does not fit this heap (`check_plan`)."""
        if self._forward is not None:
            raise ForwardStateError(f"KVPusher.{entry}: a forward is open (the last begin_forward was not ended)")
        if self.heap.closed and plan.has_transfers:
            raise TransferError("the heap is closed", request_id=int(plan.send_seq_ids[0]),
                                src_pe=self.heap.rank, dst_pe=int(plan.send_pes[0]))
        check_plan(plan, self.geometry, self.heap.rank, self.heap.world_size, self._doorbells, self._routes)

    def _forget_rung(self, plan: ForwardPlan) -> None:
        """Drop the tickets of the requests ``plan`` completed: their doorbells are rung."""
        for seq, complete in zip(plan.send_seq_ids.tolist(), plan.send_complete.tolist()):
            if complete and seq in self._routes:
                del self._routes[seq]
            elif complete:
                ticket = self._doorbells.pop(seq)
                logger.debug("request %s: PE %d -> PE %d rang doorbell word %d epoch %d",
                             seq, self.heap.rank, ticket.pe, ticket.index, ticket.epoch)

    def _prepare_appends(self, work: PushWork) -> tuple[PreparedAppend | None, PreparedAppend | None]:
        """(launcher on the transfer stream, local append on the caller's stream) of a forward.

        check_plan has range-checked every slot against this geometry: not again here.
        """
        peers, routes = work.peer_pes, work.peer_routes
        if not self.append_on_caller_stream:
            return self._prepared(peers, work.append_slots, work.dst_slots, work.dst_index, routes), None
        local = self._prepared((), work.append_slots, None, None)
        if not peers:
            return None, local
        no_local = np.full_like(work.append_slots, -1)
        return self._prepared(peers, no_local, work.dst_slots, work.dst_index, routes), local

    def _prepared(self, peer_pes: tuple[int, ...], slots: np.ndarray, dst_slots: np.ndarray | None,
                  dst_index: np.ndarray | None, routes: tuple[PushRoute, ...] = ()) -> PreparedAppend:
        """A PreparedAppend for this forward's indices. What it shares across forwards depends on
        the receivers alone (and their head routes), so the first one built for a receiver set is
        kept and later forwards rebind it (shared geometry checks, offset table, compiled kernels)."""
        if not peer_pes:
            dst_slots = dst_index = None
        heads = tuple((r.src_head, r.num_heads, r.dst_head) for r in routes) or None
        key = (peer_pes, heads)
        base = self._appends.get(key)
        if base is not None:
            return base.rebind(slots, dst_slots, dst_index, check_indices=False)
        dst_kv = [self._route_views[self._route_key(r)] for r in routes] if routes else \
            [self._peer_kv[pe] for pe in peer_pes]
        base = prepare_append_push(self.kv, slots, dst_kv, dst_slots, dst_index, heads=heads, check_indices=False)
        self._appends[key] = base
        return base

    def _route_key(self, route: PushRoute) -> tuple[int, tuple[int, ...]]:
        """A route's receiver and the shape of its pages: ``[L, pages, 2, its heads, P, D]``."""
        g = self.geometry
        pages = g.num_pages if route.dst_num_pages is None else route.dst_num_pages
        return route.pe, (g.num_layers, pages, 2, route.dst_num_kv_heads, g.page_size, g.head_dim)

    def _check_route_pages(self, seq_id: int, route: PushRoute) -> None:
        """Refuse a route whose receiver's pages (`_route_key`) the symmetric allocation cannot
        hold: every PE's allocation is alike, so neither can the receiver's."""
        pe, shape = self._route_key(route)
        num_layers = shape[0]
        num_pages, room = route_pages(route, self.kv.shape, self._segment_base.numel())
        if num_pages > room:
            raise TransferError(f"the route into PE {pe} names {num_pages} receiver pages of {shape[3]} KV heads "
                                f"per layer, expected at most {room}: this PE's allocation of "
                                f"{self._segment_base.numel()} elements holds {room} such pages for each of "
                                f"{num_layers} layers (the two sides' page counts disagree: "
                                "HeadLayout.num_pages)", request_id=seq_id, src_pe=self.heap.rank, dst_pe=pe)

    def _route_reachable(self, route: PushRoute) -> bool:
        """Whether the fused launch writes ``route``'s receiver (a load/store peer view of its pages;
        `attach_routes` checked that the allocation holds them)."""
        key = self._route_key(route)
        if key not in self._route_views:
            pe, shape = key
            view = self._segment_base.reshape(-1)[:math.prod(shape)].view(shape)
            self._route_views[key] = None if self.force_segment_puts else self.heap.peer(view, pe)
        return self._route_views[key] is not None

    def _reachable(self, pe: int) -> bool:
        if pe not in self._peer_kv:
            self._peer_kv[pe] = None if self.force_segment_puts else self.heap.peer(self.kv, pe)
        return self._peer_kv[pe] is not None

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Index arrays -> int64 tensors on the KV device (CUDA: one pinned H2D copy for all).

        Triton compiles `copy_slots` anew for each dtype and 16-byte alignment of its index
        pointers: every array starts 16-byte aligned (padded to ALIGN_INDICES entries) and is
        int64, as the fork copies that the engine's warm-up runs are (`ModelRunner._warm_fork_copy`),
        so no push compiles it mid-run. Two H200s, decode-heavy, packed int32 end to end: a 0.37-s
        step at the first push after a graph, a 0.30-s one at the first odd-length one."""
        lengths = [len(a) for a in arrays]
        padded = [-(-n // ALIGN_INDICES) * ALIGN_INDICES for n in lengths]
        packed = np.full(sum(padded), -1, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(int)
        for a, start, n in zip(arrays, starts, lengths):
            packed[start:start + n] = a
        if self.kv.is_cuda:
            host = torch.from_numpy(packed).pin_memory()
            packed_dev = host.to(self.kv.device, non_blocking=True)
        else:
            packed_dev = torch.from_numpy(packed)
        return [packed_dev[start:start + n] for start, n in zip(starts, lengths)]

    def _copy_existing(self, work: PushWork) -> None:
        """KV present at mark_send: page to page, every layer (transfer stream or inline)."""
        for pe, (local, remote) in work.peer_copies.items():
            local_dev, remote_dev = self._to_device(local, remote)
            copy_slots(self.kv, local_dev, self._peer_kv[pe], remote_dev, check_indices=False)
        for pe, runs in work.segment_copies.items():
            self.heap.put_segments_async(self._segment_base, pe, runs.for_layers(self.geometry.num_layers),
                                         self._stream)

    def _check_layer(self, layer: int) -> tuple[_Forward, int]:
        fwd = self._forward
        if fwd is None:
            raise ForwardStateError("KVPusher.push_layer_async: no forward is open (begin_forward)")
        layer = self._layer_index(layer)
        if fwd.pushed[layer]:
            raise ForwardStateError(f"KVPusher.push_layer_async: layer {layer} was already pushed in this forward")
        if self.heap.closed and fwd.work.has_transfers:
            plan = fwd.plan
            raise TransferError("the heap was closed during the forward", request_id=int(plan.send_seq_ids[0]),
                                src_pe=self.heap.rank, dst_pe=int(plan.send_pes[0]))
        return fwd, layer

    def _layer_index(self, layer: int) -> int:
        if type(layer) is int and 0 <= layer < self.geometry.num_layers:
            return layer
        try:
            index = operator.index(layer)
        except TypeError:
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}") from None
        if not 0 <= index < self.geometry.num_layers:
            raise ValueError(f"layer must be in [0, {self.geometry.num_layers}), got {index}")
        return index

    def _on_transfer_stream(self, slot: int) -> _TransferStream:
        """Context for transfer work; ``slot`` picks the reusable "ready" event (layer, or L)."""
        ready = self._ready_events[slot] if self._stream is not None else None
        return _TransferStream(self._stream, self.kv.device, ready)


class _TransferStream:
    """Context: on CUDA, run on the transfer stream after the current stream's work so far."""

    def __init__(self, stream: torch.cuda.Stream | None, device: torch.device,
                 ready: torch.cuda.Event | None) -> None:
        self._stream = stream
        self._device = device
        self._ready = ready
        self._ctx = None

    def __enter__(self) -> torch.cuda.Stream | None:
        if self._stream is None:
            return None
        self._ready.record(torch.cuda.current_stream(self._device))
        self._stream.wait_event(self._ready)
        self._ctx = torch.cuda.stream(self._stream)
        self._ctx.__enter__()
        return self._stream

    def __exit__(self, *exc_info: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc_info)
