"""disagg.transfer: the KV connector (sender and receiver sides), its backends, the symmetric heap.

    open_connector(transport, lease_s=, clock=, force_segment_puts=) -> KVConnector
        .alloc_kv(shape, dtype)   the engine's KV tensor, where senders reach it (collective)
        .sender -> KVSender       attach(seq_id, dest), begin_forward(plan), save_layer(layer, k, v),
                                  end_forward(), save_written(plan), abort(...) -> PushState
        .receiver -> KVReceiver   reserve(request_id, cmap) -> RecvDest, poll() -> closed
                                  reservations (KVPoll.LANDED | EXPIRED), cancel(dest), quarantine
    new_unique_id(backend) -> bytes                         rank 0, once per job
    open_heap(backend, uid=, rank=, world_size=, size_bytes=, device=None) -> SymmetricHeap
    DoorbellTable(heap).arm(request_id) -> DoorbellTicket   receiver: a completion word per request
    KVPusher(heap, kv)                                      sender: fused append+push per layer

Modules: `connector` (the interface), `registry` (backends by name: ``nvshmem``, ``shm``),
`heap_connector` (the connector of the symmetric heaps: `KVPusher` + doorbells + leases), `heap`
(the heap interface, entry points), `shm_heap` and `nvshmem_heap` (the backends; nvshmem is imported
only by the latter, only when opened), `segments` (slot lists -> byte runs for host-initiated
puts), `doorbell`, `lease` (reservations awaiting their doorbell), `push_plan` (a ForwardPlan
checked and split by path), `pusher`. `KVPusher` is imported on first use because it pulls in
torch and the Triton kernels.
"""

from disagg.transfer.connector import (ClosedReservation, KVConnector, KVPoll, KVReceiver, KVSender, PushState,
                                       RecvDest)
from disagg.transfer.doorbell import DoorbellTable, DoorbellTicket, ring_async
from disagg.transfer.heap import SymmetricHeap, new_unique_id, open_heap
from disagg.transfer.registry import backend_names, get_backend, open_connector

__all__ = ["ClosedReservation", "DoorbellTable", "DoorbellTicket", "KVConnector", "KVPoll", "KVPusher",
           "KVReceiver", "KVSender", "PushState", "RecvDest", "SymmetricHeap", "backend_names", "get_backend",
           "new_unique_id", "open_connector", "open_heap", "ring_async"]


def __getattr__(name: str):
    if name == "KVPusher":
        from disagg.transfer.pusher import KVPusher
        return KVPusher
    raise AttributeError(f"module 'disagg.transfer' has no attribute {name!r}")
