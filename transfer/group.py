"""The KV connector of one rank of a tensor-parallel instance: every poll agreed by all ranks.

Each rank of a tensor-parallel instance runs a replica of the same engine (the same calls in the
same order: `disagg.cluster.launch.step_loop`), so its scheduler, page tables and requests match
every other rank's, and each rank moves only its own heads' KV through its own connector (its own
PE of the heap). What a rank's connector observes is its own, though: its doorbell may ring before
another rank's, its pushes may complete earlier, its leases expire by its own clock. If each
replica acted on its own observations the replicas would part (one admits a request, another
waits), so `GroupConnector` wraps a rank's connector and turns each observation into one the
ranks share, over the instance's control group:

    alloc_kv             every rank asks for one KV shape (one page count: the replicas' page
                         ids index every rank's pages), or every rank refuses
    receiver.reserve     every rank reserves (the same slots); the ranks' (pe, ticket) are gathered
                         into one `RecvDest` (``peers``): the prefill side sends rank i's heads to
                         rank i, or, when its tensor parallelism differs, each rank's heads to
                         the ranks that hold them (a rank written by n sender ranks armed n
                         doorbell words: `disagg.transfer.heads`)
    receiver.poll        a reservation closes once every rank saw it close: LANDED when all
                         landed, EXPIRED when any expired (its KV is not whole); until then it stays
                         open on every rank (``in``, ``len``), so the replicas' decisions match
    receiver.cancel      cancelled on every rank, or refused on every rank
    sender.abort         IN_FLIGHT while a push of it may land on any rank
    sender.poll_aborted, an abort or a retired request is done once it is done on every rank
    sender.poll_retired

A poll gathers only while something is open (a replicated fact), so an idle instance exchanges
nothing; each gather is one small object per rank (`TPGroup.all_gather_object`). Every rank must
make the same calls in the same order: a gather is a collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Protocol, Sequence

from disagg.errors import InvalidArgument
from disagg.transfer.connector import (ClosedReservation, Completion, KVConnector, KVPoll, KVReceiver, KVSender,
                                       PushState, RecvDest)

if TYPE_CHECKING:
    import torch

    from disagg.plan import ForwardPlan


class ControlGroup(Protocol):
    """What the connector needs of the instance's process group (`disagg.parallel.TPGroup`)."""

    rank: int
    size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...


def _agreed(group: ControlGroup, local: dict) -> tuple[list, list[dict]]:
    """The keys of ``local`` that every rank holds, in rank 0's order, and every rank's dict."""
    every = group.all_gather_object(local)
    keys = [key for key in every[0] if all(key in other for other in every[1:])]
    return keys, every


class GroupConnector(KVConnector):
    """``inner`` (this rank's connector) with every observation agreed across ``group``'s ranks.

    Args:
        inner: the connector of this rank's transport (`disagg.transfer.registry.open_connector`).
        group: the instance's control group (``rank``, ``size``, ``all_gather_object``).
    """

    def __init__(self, inner: KVConnector, group: ControlGroup) -> None:
        self.inner = inner
        self.group = group
        self.backend = inner.backend
        self.pe = inner.pe
        self.rank, self.num_ranks = group.rank, group.size
        self.layout = inner.layout
        self._receiver = GroupReceiver(inner.receiver, group)
        self._sender: GroupSender | None = None

    def alloc_kv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """This rank's KV tensor, once every rank asks for one of the same shape: the replicas'
        page ids index every rank's pages alike (one position map for all), so ranks whose pages
        differ in count or layout are refused on every rank, before the heap allocates.

        Raises:
            ValueError: the ranks' shapes or dtypes differ (naming each rank's).
        """
        every = self.group.all_gather_object((tuple(int(n) for n in shape), str(dtype)))
        if any(other != every[0] for other in every[1:]):
            ranks = ", ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(every))
            raise ValueError(f"alloc_kv: the {self.num_ranks} ranks of a tensor-parallel instance must allocate "
                             f"one KV shape ([num_layers, num_pages, 2, kv_heads, page_size, head_dim]) and "
                             f"dtype, got {ranks}")
        return self.inner.alloc_kv(shape, dtype)

    def check_dest(self, request_id: Hashable, dest: RecvDest) -> None:
        """``dest``: this rank's part (`local_dest`), checked by this rank's connector."""
        self.inner.check_dest(request_id, dest)

    @property
    def sender(self) -> GroupSender:
        if self._sender is None:
            self._sender = GroupSender(self.inner.sender, self.group)
        return self._sender

    @property
    def receiver(self) -> GroupReceiver:
        return self._receiver


class GroupSender(KVSender):
    """`KVSender` of one rank: forwards go to this rank's sender; request ends are agreed.

    Aborts and retired requests are keyed by a number every replica assigns alike (the order of
    the calls), since each rank holds its own request objects.
    """

    def __init__(self, inner: KVSender, group: ControlGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group
        self._aborting: set[Hashable] = set()  # IN_FLIGHT somewhere; done here: in _aborted_here
        self._aborted_here: set[Hashable] = set()
        self._retired: dict[int, Any] = {}  # key -> the engine's handle (this replica's)
        self._retired_here: set[int] = set()
        self._next_key = 0

    def attach(self, seq_id: int, dest: RecvDest) -> None:
        self.inner.attach(seq_id, dest)

    def detach(self, seq_id: int) -> None:
        self.inner.detach(seq_id)

    def fence(self) -> Completion | None:
        return self.inner.fence()

    def abort(self, request_id: Hashable, seq_id: int, *, pushed: bool) -> PushState:
        here = self.inner.abort(request_id, seq_id, pushed=pushed)
        if not any(self.group.all_gather_object(here is PushState.IN_FLIGHT)):
            return PushState.QUIESCED
        self._aborting.add(request_id)
        if here is PushState.QUIESCED:
            self._aborted_here.add(request_id)
        return PushState.IN_FLIGHT

    def is_quiescing(self, request_id: Hashable) -> bool:
        return request_id in self._aborting

    @property
    def num_quiescing(self) -> int:
        return len(self._aborting)

    def poll_aborted(self) -> list[Hashable]:
        if not self._aborting:
            return []
        self._aborted_here.update(self.inner.poll_aborted())
        done, _ = _agreed(self.group, dict.fromkeys(sorted(self._aborted_here, key=repr)))
        for request_id in done:
            self._aborting.discard(request_id)
            self._aborted_here.discard(request_id)
        return done

    def retire(self, handle: Any, done: Completion | None) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self._retired[key] = handle
        self.inner.retire(key, done)

    @property
    def num_retiring(self) -> int:
        return len(self._retired)

    def poll_retired(self) -> list[Any]:
        if not self._retired:
            return []
        self._retired_here.update(self.inner.poll_retired())
        done, _ = _agreed(self.group, dict.fromkeys(sorted(self._retired_here)))
        handles = []
        for key in sorted(done):  # oldest first
            self._retired_here.discard(key)
            handles.append(self._retired.pop(key))
        return handles

    def begin_forward(self, plan: ForwardPlan) -> None:
        self.inner.begin_forward(plan)

    def save_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                   k_scale: Any = None, v_scale: Any = None) -> None:
        self.inner.save_layer(layer, k, v, k_scale=k_scale, v_scale=v_scale)

    def end_forward(self) -> Completion | None:
        return self.inner.end_forward()

    def can_save_written(self, plan: ForwardPlan) -> bool:
        return self.inner.can_save_written(plan)

    def save_written(self, plan: ForwardPlan) -> Completion | None:
        return self.inner.save_written(plan)


class GroupReceiver(KVReceiver):
    """`KVReceiver` of one rank: a reservation is open until every rank saw it close.

    Attributes:
        inner: this rank's receiver (its doorbells and leases).
    """

    def __init__(self, inner: KVReceiver, group: ControlGroup) -> None:
        self.inner, self.group = inner, group
        self.pe = inner.pe
        self._open: dict[Hashable, Any] = {}  # request id -> its quarantine handle (None: not quarantined)
        self._closed_here: dict[Hashable, ClosedReservation] = {}  # closed on this rank, not on all
        self.num_landed = 0
        self.num_cancelled = 0
        self.wait_s = 0.0

    @property
    def lease_s(self) -> float:
        return self.inner.lease_s

    @property
    def clock(self) -> Callable[[], float]:
        return self.inner.clock

    def reserve(self, request_id: Hashable, cmap: Sequence[int], *, num_cached_tokens: int = 0) -> RecvDest:
        try:
            mine: RecvDest | None = self.inner.reserve(request_id, cmap, num_cached_tokens=num_cached_tokens)
            failure = None
        except Exception as err:  # every rank learns it: all reserve, or none does
            mine, failure = None, err
        every = self.group.all_gather_object(None if mine is None else (mine.pe, mine.ticket))
        if failure is not None or any(got is None for got in every):
            if mine is not None:
                self.inner.cancel(mine)
            if failure is not None:
                raise failure
            ranks = [rank for rank, got in enumerate(every) if got is None]
            raise RuntimeError(f"reserve: request {request_id!r}: rank(s) {ranks} of this instance could not "
                               "reserve; nothing is reserved on any rank")
        (pe, ticket), peers = every[0], tuple(every[1:])
        self._open[request_id] = None
        return RecvDest(request_id, list(mine.cmap), pe, ticket, num_cached_tokens=num_cached_tokens, peers=peers)

    def state(self, request_id: Hashable) -> KVPoll:
        """Where this rank's reservation stands (its own view: the ranks agree only in `poll`)."""
        if request_id not in self._open:
            raise KeyError(f"request {request_id!r} has no open reservation on PE {self.pe}")
        closed = self._closed_here.get(request_id)
        return closed.state if closed is not None else self.inner.state(request_id)

    def poll(self) -> list[ClosedReservation]:
        if not self._open:
            return []
        for closed in self.inner.poll():
            self._closed_here[closed.request_id] = closed
        states = {rid: (closed.state, closed.reason) for rid, closed in self._closed_here.items()}
        done, every = _agreed(self.group, states)
        out = []
        for request_id in done:
            mine = self._closed_here.pop(request_id)
            handle = self._open.pop(request_id)
            expired = [(rank, seen[request_id][1]) for rank, seen in enumerate(every)
                       if seen[request_id][0] is KVPoll.EXPIRED]
            if not expired:
                self.num_landed += 1
                self.wait_s += mine.waited_s
                out.append(ClosedReservation(request_id, KVPoll.LANDED, mine.waited_s, handle))
                continue
            rank, why = expired[0]  # the first rank's reason, the same text on every rank
            reason = f"{why} (rank {rank} of this instance)" if why else (
                f"the KV of request {request_id!r} did not land on rank {rank} of this instance within {self.lease_s} s")
            out.append(ClosedReservation(request_id, KVPoll.EXPIRED, mine.waited_s, handle, reason))
        return out

    def cancel(self, dest: RecvDest) -> Any:
        request_id = dest.request_id
        mine = dest.for_rank(self.group.rank) if len(dest.pes) == self.group.size else None
        problem = None
        if mine is None:
            problem = (f"dest.pes: expected {self.group.size} receiver PEs (one per rank of this instance), got "
                       f"{len(dest.pes)}")
        elif request_id not in self._open:
            problem = f"dest: request {request_id!r} has no open reservation on this instance"
        elif request_id in self._closed_here:
            problem = f"dest: the doorbell of request {request_id!r} has rung on PE {self.pe}"
        every = self.group.all_gather_object(problem)
        refused = [(rank, why) for rank, why in enumerate(every) if why is not None]
        if refused:
            rank, why = refused[0]
            raise InvalidArgument(f"{why} (rank {rank}); nothing was cancelled on any rank", argument="dest")
        self.inner.cancel(mine)
        self.num_cancelled += 1
        return self._open.pop(request_id)

    def quarantine(self, request_id: Hashable, handle: Any) -> None:
        if request_id not in self._open:
            raise KeyError(f"request {request_id!r} has no open reservation on PE {self.pe}")
        self._open[request_id] = handle
        if request_id not in self._closed_here:
            self.inner.quarantine(request_id, handle)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def reserved_ids(self) -> set[Hashable]:
        return set(self._open)

    @property
    def num_quarantined(self) -> int:
        return sum(handle is not None for handle in self._open.values())
