"""disagg.transfer: symmetric heaps (NVSHMEM on GPUs, shared memory on CPU) and the KV pusher.

    new_unique_id(backend) -> bytes                         rank 0, once per job
    open_heap(backend, uid=, rank=, world_size=, size_bytes=, device=None) -> SymmetricHeap
    DoorbellTable(heap).arm(request_id) -> DoorbellTicket   receiver: a completion word per request
    KVPusher(heap, kv)                                      sender: fused append+push per layer

Modules: `heap` (interface, entry points), `shm_heap` and `nvshmem_heap` (backends; nvshmem is
imported only by the latter, only when opened), `segments` (slot lists -> byte runs for
host-initiated puts), `doorbell`, `push_plan` (a ForwardPlan checked and split by path), `pusher`.
`KVPusher` is imported on first use because it pulls in torch and the Triton kernels.
"""

from disagg.transfer.doorbell import DoorbellTable, DoorbellTicket, ring_async
from disagg.transfer.heap import SymmetricHeap, new_unique_id, open_heap

__all__ = ["DoorbellTable", "DoorbellTicket", "KVPusher", "SymmetricHeap", "new_unique_id",
           "open_heap", "ring_async"]


def __getattr__(name: str):
    if name == "KVPusher":
        from disagg.transfer.pusher import KVPusher
        return KVPusher
    raise AttributeError(f"module 'disagg.transfer' has no attribute {name!r}")
