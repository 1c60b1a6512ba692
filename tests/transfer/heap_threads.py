"""In-process PEs: one thread per PE, for collective heap calls in single-process tests."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from disagg.transfer import SymmetricHeap, new_unique_id, open_heap


def collective(fns: list[Callable[[], object]], timeout_s: float = 30.0) -> list[object]:
    """Run one callable per PE concurrently (collective heap calls); return results in order."""
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=timeout_s) for f in futures]


def open_shm_heaps(world_size: int, size_bytes: int = 1 << 20, timeout_s: float = 60.0,
                   num_signals: int = 64) -> list[SymmetricHeap]:
    uid = new_unique_id("shm")
    return collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=world_size,
                                             size_bytes=size_bytes, timeout_s=timeout_s,
                                             num_signals=num_signals)
                       for r in range(world_size)])


class Shared:
    """One gather's state for the ranks of a `ThreadGroup`."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)  # a bound on a hang; a loaded CI machine is slow
        self.slots: list = [None] * size


class ThreadGroup:
    """Rank ``rank`` of ``size`` threads: `all_gather_object` as `disagg.parallel.TPGroup`'s (the
    control group of a tensor-parallel instance's ranks, here threads of one process)."""

    def __init__(self, shared: Shared, rank: int, size: int) -> None:
        self.shared, self.rank, self.size = shared, rank, size

    def all_gather_object(self, obj):
        self.shared.slots[self.rank] = obj
        self.shared.barrier.wait()
        out = list(self.shared.slots)
        self.shared.barrier.wait()  # everyone read before the next gather writes
        return out

