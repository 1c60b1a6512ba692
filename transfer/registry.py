"""The transfer backends by name (``transfer.backend`` in the config): one line each.

    BACKENDS["shm"] = "disagg.transfer.shm_heap"     the module; its `BACKEND` says the rest

A backend module defines ``BACKEND = TransferBackend(...)``: how rank 0 makes the bootstrap id,
how every rank opens its transport, and the `KVConnector` an engine builds over it. The module is
imported when its backend is first asked for, so the ``nvshmem`` one (and nvshmem4py) loads only
in the processes that open it. A new backend (an RDMA one, say) is one module with its
`BACKEND` and one line here. Used by `open_heap`/`new_unique_id` (`heap.py`) and by the engines
(`open_connector`), in every worker process.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from disagg.transfer.connector import KVConnector

BACKENDS: dict[str, str] = {
    "nvshmem": "disagg.transfer.nvshmem_heap",
    "shm": "disagg.transfer.shm_heap",
}


@dataclass(frozen=True)
class TransferBackend:
    """One backend's entry points.

    Attributes:
        name: its registry name.
        new_unique_id: ``(size_bytes: int | None) -> bytes``: rank 0's bootstrap id.
        open: ``(uid, *, rank, world_size, size_bytes, device, num_signals, timeout_s)`` -> this
            rank's transport (a `SymmetricHeap` for the heap backends); collective.
        connector: ``(transport, *, lease_s, clock, force_segment_puts[, verify][, layout]) -> KVConnector``.
    """

    name: str
    new_unique_id: Callable[[int | None], bytes]
    open: Callable[..., Any]
    connector: Callable[..., KVConnector]


def backend_names() -> tuple[str, ...]:
    """The registered backends, sorted."""
    return tuple(sorted(BACKENDS))


def get_backend(name: str) -> TransferBackend:
    """The backend registered as ``name`` (its module imported on first use).

    Raises:
        ValueError: ``name`` is not registered (the message names the known ones).
    """
    module = BACKENDS.get(name) if isinstance(name, str) else None
    if module is None:
        raise ValueError(f"transfer backend must be one of {backend_names()}, got {name!r}; a new one "
                         "is registered in disagg.transfer.registry.BACKENDS")
    backend = importlib.import_module(module).BACKEND
    if backend.name != name:
        raise RuntimeError(f"{module}.BACKEND is named {backend.name!r}, expected {name!r} (its registry key)")
    return backend


def open_connector(transport: Any, *, lease_s: float = 60.0, clock: Callable[[], float] | None = None,
                   force_segment_puts: bool = False, verify: bool = False, group: Any = None,
                   layout: Any = None) -> KVConnector:
    """The `KVConnector` of an engine over ``transport`` (what `open_heap` returned), chosen by
    its ``backend`` name.

    Args:
        transport: this rank's transport; its ``backend`` attribute names the registry entry.
        lease_s: seconds a reservation waits for its KV (receiving side).
        clock: monotonic clock of the leases (None: `time.monotonic`).
        force_segment_puts: send with the host-initiated path even to load/store-reachable peers.
        verify: digest every push and check it before a reservation closes as landed
            (``transfer.verify``).
        group: the engine's tensor-parallel group (`disagg.parallel.TPGroup`); with more than one
            rank the connector is wrapped so that the ranks agree on every poll
            (`disagg.transfer.group.GroupConnector`).
        layout: the fleet's head split (`disagg.transfer.heads.HeadLayout`) when the prefill and
            decode sides differ in tensor parallelism; None: both sides at this instance's.

    Raises:
        ValueError: the transport's backend is not registered, or a bad ``lease_s``.
    """
    import time

    backend = get_backend(getattr(transport, "backend", None))
    options = {"verify": True} if verify else {}  # (a backend without digests needs no such keyword)
    if layout is not None:
        options["layout"] = layout
    connector = backend.connector(transport, lease_s=lease_s, clock=clock or time.monotonic,
                                  force_segment_puts=force_segment_puts, **options)
    if group is None or group.size == 1:
        return connector
    from disagg.transfer.group import GroupConnector

    return GroupConnector(connector, group)
