"""disagg.transfer: symmetric heaps (NVSHMEM on GPUs, shared memory on CPU) and the KV pusher."""
