"""The KV connector: the one interface between an engine and a KV transfer backend.

An engine (`disagg.engine.core.EngineCore`, in its worker process) owns one `KVConnector`, which
the registry builds for the backend its transport was opened with (`disagg.transfer.registry`).
The connector allocates the engine's KV tensor where senders can reach it and has two sides; the
engine knows these names only, never a backend's heap, doorbells, leases or fences:

    KVSender (computes a prompt, pushes its KV)    KVReceiver (reserved the pages, decodes)
                                                   1. reserve(request_id, cmap) -> RecvDest
    2. attach(seq_id, dest)
    3. per forward: begin_forward(plan),
       save_layer(layer, k, v) for every layer
       (the model's hook: `AttentionBatch.kv_writer`),
       end_forward() -> done; the forward that
       writes a dest's last token signals it
    4. retire(handle, done); poll_retired()        5. poll() -> [ClosedReservation]: LANDED (the
       hands the handle back once done                pages hold the KV) or EXPIRED (the lease ran
                                                      out: the sender is presumed gone)
    abort(request_id, seq_id) -> PushState;        cancel(dest): no sender will write its pages;
    poll_aborted() names an IN_FLIGHT abort         quarantine(request_id, handle): an aborted
    once nothing of it can land                     request's pages wait for LANDED or EXPIRED

Page ids stay the engine's (`disagg.cache`): a connector moves the KV of the slots a plan names
and says when pages are safe to hand out again. A destination names its receiver PEs, one per rank
of the decode instance (`RecvDest.pes`); rank i of a tensor-parallel prefill instance sends its
heads to rank i's PE when both sides have the same tensor parallelism, else to every decode rank
whose heads it holds, at their place in that rank's pages (`KVConnector.local_dest`,
`disagg.transfer.heads`); the ranks of one instance agree on every poll
(`disagg.transfer.group.GroupConnector`).
Pure Python; torch is imported by the backends' implementations, not here.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Protocol, Sequence

from disagg.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

    from disagg.plan import ForwardPlan
    from disagg.transfer.heads import HeadLayout


class KVPoll(str, enum.Enum):
    """Where one reservation of a receiver stands (`KVReceiver.state`, `KVReceiver.poll`).

    WAITING: reserved; a sender may be writing its pages (they are the sender's).
    LANDED: the sender signalled after its last write: the pages hold the request's KV.
    EXPIRED: the lease ran out before the signal: the sender is presumed gone and the pages may be
        handed out again (a request that still wanted them fails).
    """

    WAITING = "waiting"
    LANDED = "landed"
    EXPIRED = "expired"


class PushState(str, enum.Enum):
    """Whether an aborted prefill request may still write into its decode pages.

    QUIESCED: no push of it can land anymore (none started, or every one of them completed):
        the decode side may free its reservation now (`DecodeEngine.cancel_reservation`).
    IN_FLIGHT: a forward that pushed it may still be writing (GPU transfers not done yet); the
        prefill engine reports the abort's ``"abort"`` output once they are, and only then is
        the reservation safe to free.
    """

    QUIESCED = "quiesced"
    IN_FLIGHT = "in_flight"


@dataclass(frozen=True)
class RecvDest:
    """Where a prompt's KV goes: the decode side's reserved slots and its completion signal.

    Attributes:
        request_id: the request.
        cmap: compressed position map of the reserved slots, for prompt positions
            ``num_cached_tokens ..`` (`disagg.posmap` format).
        pe: the decode worker's PE.
        ticket: what the sender signals after the last write (the backend's: a
            `disagg.transfer.doorbell.DoorbellTicket` for the symmetric heaps).
        num_cached_tokens: prompt tokens whose KV the decode worker already holds (its prefix
            cache; whole pages): the prefill side pushes only the positions after them.
        peers: a tensor-parallel decode instance's other ranks, ``(pe, ticket)`` each, rank 1
            first (``pe`` and ``ticket`` are rank 0's); empty for one rank. Every rank reserved
            the same slots (the ranks' caches are replicas), so ``cmap`` is every rank's. A
            decode rank written by several sender ranks (the two sides' tensor parallelism
            differs) has a tuple of tickets, one per sender (`disagg.transfer.heads.senders_of`).
        routes: a sender rank's part when the two sides' tensor parallelism differs
            (`KVConnector.local_dest`): the decode ranks it writes, with the heads (`disagg.
            transfer.heads.PushRoute`); ``pe`` and ``ticket`` are then the first route's (or decode
            rank 0's PE and None when the other ranks write all of this rank's heads). None: one
            receiver at ``pe``, every head.
    """

    request_id: Hashable
    cmap: list[int]
    pe: int
    ticket: Any
    num_cached_tokens: int = 0
    peers: tuple[tuple[int, Any], ...] = ()
    routes: tuple[Any, ...] | None = None

    @property
    def pes(self) -> tuple[int, ...]:
        """Every receiver PE of this destination, rank 0 first (one per decode rank)."""
        return (self.pe,) + tuple(pe for pe, _ in self.peers)

    def for_rank(self, rank: int) -> RecvDest:
        """The destination of decode rank ``rank`` alone (its PE and ticket, no peers).

        Raises:
            InvalidArgument: ``rank`` is not one of this destination's ranks.
        """
        if not 0 <= rank < len(self.pes):
            raise InvalidArgument(f"dest: request {self.request_id!r} names {len(self.pes)} receiver rank(s); "
                                  f"expected a rank in [0, {len(self.pes)}), got {rank}", argument="dest")
        if rank == 0:
            return dataclasses.replace(self, peers=()) if self.peers else self
        pe, ticket = self.peers[rank - 1]
        return dataclasses.replace(self, pe=pe, ticket=ticket, peers=())


@dataclass(frozen=True)
class ClosedReservation:
    """A reservation `KVReceiver.poll` closed: its KV landed, or its lease expired.

    Attributes:
        request_id: the request.
        state: `KVPoll.LANDED` or `KVPoll.EXPIRED`.
        waited_s: seconds from `reserve` to the poll that closed it (the receiver's clock).
        handle: what `quarantine` was given (the request was aborted meanwhile, so only its
            pages waited), else None.
        reason: EXPIRED only: what to tell the request's caller.
    """

    request_id: Hashable
    state: KVPoll
    waited_s: float
    handle: Any = None
    reason: str = ""


class Completion(Protocol):
    """Work left on a device (a `torch.cuda.Event`): ``query()`` is True once it is done."""

    def query(self) -> bool: ...


class KVSender(abc.ABC):
    """The sending side: writes each forward's new K/V into the local pages and the receivers'.

    One per engine, in its process; driven by the engine core (requests) and the model runner
    (forwards). The forward methods follow `disagg.transfer.pusher.KVPusher`'s contract: a forward
    is ``begin_forward``, ``save_layer`` once per layer (from the model, through the attention
    batch's ``kv_writer``), ``end_forward``; ``save_written`` does all of it after a forward that
    wrote the local pages itself (a whole-forward CUDA graph).

    The request bookkeeping (which aborts are still in flight, which finished requests wait for
    their pushes) is shared by every backend and implemented here; a backend gives `fence`.
    """

    def __init__(self) -> None:
        self._quiescing: dict[Hashable, Completion] = {}
        self._retiring: list[tuple[Any, Completion | None]] = []

    # ------------------------------------------------------------------ requests
    @abc.abstractmethod
    def attach(self, seq_id: int, dest: RecvDest) -> None:
        """Send ``seq_id``'s tokens to ``dest`` (after `PagedKVCache.disagg_mark_send` named the
        slots) and signal it after the forward that writes its last token.

        Raises:
            TransferError: ``dest`` does not name a receiver this sender can reach.
        """

    @abc.abstractmethod
    def detach(self, seq_id: int) -> None:
        """Forget ``seq_id``'s destination (an aborted request): nothing signals it."""

    @abc.abstractmethod
    def fence(self) -> Completion | None:
        """Work done once every push issued so far has landed; None when they all have."""

    def abort(self, request_id: Hashable, seq_id: int, *, pushed: bool) -> PushState:
        """Stop an attached request: detach it; say whether a push of it may still land.

        Args:
            request_id: the request, as `poll_aborted` will name it.
            seq_id: its sequence (as attached).
            pushed: some forward pushed part of it.

        Returns:
            QUIESCED, or IN_FLIGHT until `poll_aborted` names ``request_id``.
        """
        self.detach(seq_id)
        done = self.fence() if pushed else None
        if done is not None and not done.query():
            self._quiescing[request_id] = done
            return PushState.IN_FLIGHT
        return PushState.QUIESCED

    def is_quiescing(self, request_id: Hashable) -> bool:
        """An IN_FLIGHT abort of ``request_id`` has not been named by `poll_aborted` yet."""
        return request_id in self._quiescing

    @property
    def num_quiescing(self) -> int:
        return len(self._quiescing)

    def poll_aborted(self) -> list[Hashable]:
        """The IN_FLIGHT aborts whose pushes have all landed since the last call (each once)."""
        done = [rid for rid, fence in self._quiescing.items() if fence.query()]
        for rid in done:
            del self._quiescing[rid]
        return done

    def retire(self, handle: Any, done: Completion | None) -> None:
        """A request's pushes are all issued (``done``: the `end_forward` of the last one); hand
        ``handle`` back from `poll_retired` once they have landed (its local pages are then free)."""
        self._retiring.append((handle, done))

    @property
    def num_retiring(self) -> int:
        return len(self._retiring)

    def poll_retired(self) -> list[Any]:
        """The retired handles whose pushes have landed, oldest first (each once)."""
        ready, keep = [], []
        for handle, done in self._retiring:
            (ready if done is None or done.query() else keep).append((handle, done))
        self._retiring = keep
        return [handle for handle, _ in ready]

    # ------------------------------------------------------------------ forwards
    @abc.abstractmethod
    def begin_forward(self, plan: ForwardPlan) -> None:
        """Check ``plan`` against the receivers, apply its fork copies, start copying the KV that
        existed when its requests were attached.

        Raises:
            ForwardStateError: a forward is open. TransferError, ValueError: the plan does not fit
                (nothing was written).
        """

    @abc.abstractmethod
    def save_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                   k_scale: Any = None, v_scale: Any = None) -> None:
        """Write ``layer``'s new K/V ``[T, H_kv, D]`` locally and to every receiver; when it
        returns, the current stream may read the layer's local pages (attention)."""

    @abc.abstractmethod
    def end_forward(self) -> Completion | None:
        """Signal the destinations this forward completed; close the forward.

        Returns:
            Work done once this forward's transfers and signals are (None: done already).
        """

    @abc.abstractmethod
    def can_save_written(self, plan: ForwardPlan) -> bool:
        """Whether `save_written` can send ``plan`` (every pushed token has a local slot)."""

    @abc.abstractmethod
    def save_written(self, plan: ForwardPlan) -> Completion | None:
        """Send ``plan``'s K/V after a forward wrote it to the local pages, every layer at once,
        and signal what it completes (`begin_forward` to `end_forward` in one call)."""


class KVReceiver(abc.ABC):
    """The receiving side: reservations a sender writes into, each under a lease.

    Attributes:
        pe: this receiver's PE (the address a `RecvDest` carries).
        lease_s: seconds a reservation waits for its KV before it expires.
        clock: the monotonic clock of the leases.
        num_landed: reservations closed LANDED so far; wait_s: their summed `waited_s`.
        num_cancelled: reservations closed by `cancel`.
    """

    pe: int
    lease_s: float
    clock: Callable[[], float]
    num_landed: int
    num_cancelled: int
    wait_s: float

    @abc.abstractmethod
    def reserve(self, request_id: Hashable, cmap: Sequence[int], *, num_cached_tokens: int = 0) -> RecvDest:
        """Open a reservation of the slots ``cmap`` names and return the sender's destination.

        Raises:
            HeapError: no completion signal is free (nothing changes).
        """

    @abc.abstractmethod
    def state(self, request_id: Hashable) -> KVPoll:
        """Where ``request_id``'s open reservation stands, without closing it.

        Raises:
            KeyError: no open reservation of ``request_id``.
        """

    @abc.abstractmethod
    def poll(self) -> list[ClosedReservation]:
        """Close the reservations that LANDED or EXPIRED since the last call."""

    @abc.abstractmethod
    def cancel(self, dest: RecvDest) -> Any:
        """Close ``dest``'s reservation now: the caller vouches that no sender will write it.

        Returns:
            The `quarantine` handle of an aborted request, else None.

        Raises:
            InvalidArgument: ``dest`` is not this receiver's open reservation of its request (an
                earlier one under the same id, or none). Nothing changes.
        """

    @abc.abstractmethod
    def quarantine(self, request_id: Hashable, handle: Any) -> None:
        """The request is gone but a sender may still write its pages: keep them until its
        reservation closes; `poll` (or `cancel`) hands ``handle`` back then."""

    @abc.abstractmethod
    def __contains__(self, request_id: Hashable) -> bool:
        """``request_id`` has an open reservation (quarantined or not)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Open reservations."""

    @abc.abstractmethod
    def reserved_ids(self) -> set[Hashable]:
        """The request ids of the open reservations."""

    @property
    @abc.abstractmethod
    def num_quarantined(self) -> int:
        """Open reservations of aborted requests."""


class KVConnector(abc.ABC):
    """One engine's transport: its KV tensor's memory and the two sides over it.

    Attributes:
        backend: the registry name (``transfer.backend``).
        pe: this engine's PE.
        rank, num_ranks: this engine's rank in its tensor-parallel instance, and the instance's
            ranks (0 and 1 for a connector of its own; `disagg.transfer.group.GroupConnector`
            sets them for the ranks of one instance).
        layout: the fleet's head split (`disagg.transfer.heads.HeadLayout`), set by
            `disagg.transfer.registry.open_connector`; None: both sides at this instance's
            tensor parallelism.
    """

    backend: str
    pe: int
    rank: int = 0
    num_ranks: int = 1
    layout: HeadLayout | None = None

    def local_dest(self, dest: RecvDest) -> RecvDest:
        """The part of ``dest`` this rank sends to. The same tensor parallelism on both sides:
        decode rank ``rank``'s PE and ticket (rank i's heads go to rank i). With a `layout` whose
        sides differ: the routes into every decode rank this rank writes (`disagg.transfer.heads`).

        Raises:
            InvalidArgument: ``dest`` names another number of receiver ranks than this instance has
                (same tensor parallelism), or than the layout's decode side.
        """
        layout = self.layout
        if layout is not None and layout.is_split:
            return self._split_dest(dest, layout)
        if len(dest.pes) != self.num_ranks:
            raise InvalidArgument(f"dest.pes: request {dest.request_id!r}: this instance has {self.num_ranks} "
                                  f"tensor-parallel rank(s) and sends rank i's heads to receiver rank i; expected "
                                  f"{self.num_ranks} receiver PE(s), got {len(dest.pes)} {list(dest.pes)}",
                                  argument="dest.pes")
        return dest.for_rank(self.rank)

    def _split_dest(self, dest: RecvDest, layout: HeadLayout) -> RecvDest:
        from disagg.transfer.heads import routes_of

        if len(dest.pes) != layout.peer_ranks:
            raise InvalidArgument(f"dest.pes: request {dest.request_id!r}: the decode side has {layout.peer_ranks} "
                                  f"tensor-parallel rank(s); expected {layout.peer_ranks} receiver PE(s), got "
                                  f"{len(dest.pes)} {list(dest.pes)}", argument="dest.pes")
        tickets = (dest.ticket,) + tuple(ticket for _, ticket in dest.peers)
        routes = routes_of(layout.num_kv_heads, layout.num_ranks, layout.rank, dest.pes, tickets, layout.peer_num_pages)
        first = routes[0] if routes else None
        return dataclasses.replace(dest, pe=first.pe if first else dest.pe, ticket=first.ticket if first else None,
                                   peers=(), routes=routes)

    @abc.abstractmethod
    def alloc_kv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Allocate the engine's KV tensor (collective on the symmetric heaps: every PE, same
        shapes, same order); the sender writes from and into it."""

    @abc.abstractmethod
    def check_dest(self, request_id: Hashable, dest: RecvDest) -> None:
        """Refuse a destination this engine cannot send to.

        Raises:
            InvalidArgument: naming the field (``dest.pe``) and what was expected.
        """

    @property
    @abc.abstractmethod
    def sender(self) -> KVSender:
        """The sending side (built on first use, after `alloc_kv`)."""

    @property
    @abc.abstractmethod
    def receiver(self) -> KVReceiver:
        """The receiving side."""
