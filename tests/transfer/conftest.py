"""Fixtures of the transfer tests: in-process shm heaps (one thread per PE) and /dev/shm hygiene.

The folder is put on sys.path so that spawned workers and Ray actors can import
`transfer_scenarios` by name (spawn copies the parent's sys.path).
"""

from __future__ import annotations

import sys
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


@pytest.fixture(autouse=True)
def no_shm_litter():
    """Every test leaves /dev/shm as it found it (heap files of other jobs aside)."""
    before = set(shm_leftovers())
    yield
    after = set(shm_leftovers()) - before
    for path in after:
        uid = bytes.fromhex(Path(path).name.split("-")[2])
        remove_shm_leftovers(uid)
    assert not after, f"test left heap files in /dev/shm: {sorted(after)}"
