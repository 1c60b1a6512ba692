"""Fixtures of the transfer tests: in-process shm heaps (one thread per PE) and /dev/shm hygiene.

The folder is put on sys.path so that spawned workers and Ray actors can import
`transfer_scenarios` by name (spawn copies the parent's sys.path).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from heap_threads import open_shm_heaps  # noqa: E402

from disagg.transfer.shm_heap import remove_shm_leftovers, shm_leftovers  # noqa: E402


@pytest.fixture
def heap_pair():
    """Two PEs of one shm heap in this process; closed afterwards, with nothing left in /dev/shm."""
    heaps = open_shm_heaps(2)
    yield heaps
    for heap in heaps:
        heap.close()
    assert shm_leftovers(heaps[0].uid) == []


SETTLE_S = 2.0


@pytest.fixture(autouse=True)
def no_shm_litter():
    """Every test leaves /dev/shm as it found it, heap files of other jobs aside: one that a
    process outside this one's tree maps (a fleet of a test running beside this one, under
    another pytest worker) is theirs, and neither counted nor removed. A file no process maps
    is judged again for up to `SETTLE_S`: another worker's heap between its file's creation and
    its mapping (or its unmapping and unlinking) is mapped or gone by then; a leak stays."""
    before = set(shm_leftovers())
    yield
    new = set(shm_leftovers()) - before
    left = sorted(path for path in new if not _mapped_by_others(path))
    deadline = time.monotonic() + SETTLE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [path for path in left if os.path.exists(path) and not _mapped_by_others(path)]
    for path in left:
        uid = bytes.fromhex(Path(path).name.split("-")[2])
        remove_shm_leftovers(uid)
    assert not left, f"test left heap files in /dev/shm: {left}"


def _mapped_by_others(path: str) -> bool:
    """Whether a live process that is neither this one nor a descendant of it maps ``path``."""
    parents: dict[int, int] = {}
    mappers: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if path in (entry / "maps").read_text():
                mappers.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    me = os.getpid()

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == me:
                return True
            pid = parents.get(pid, 0)
        return False

    return any(not ours(pid) for pid in mappers)
