"""The ``"shm"`` symmetric heap: one /dev/shm file per PE, mapped by every PE (CPU, what CI runs).

Each PE creates ``/dev/shm/disagg-heap-<uid hex>-pe<rank>`` (header + data), maps every peer's
file with ``torch.from_file(..., shared=True)``, and, once every PE reports that it mapped every
file, unlinks its own. From then on the memory lives only in the mappings, so a crash of any
process leaves nothing in /dev/shm; a crash during `open` is cleaned up by the PEs that time out
(every file carries the uid, see `shm_leftovers`).

Header words are single-writer: a PE writes only its own ``mapped``/``barrier``/``record``
words, and a signal word is written only by the holder of its doorbell ticket, so no atomics are
needed. Ordering relies on x86-64's total store order: data stored before a word is visible to a
process that sees the word.
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import time
from typing import Sequence

import numpy as np
import torch

from disagg.errors import HeapError
from disagg.transfer.heap import (ALLOC_RECORD_WORDS, SymmetricHeap, alloc_record,
                                  check_alloc_records, check_segments, check_signal_index)
from disagg.transfer.heap_connector import HeapConnector
from disagg.transfer.registry import TransferBackend

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FILE_PREFIX = "disagg-heap-"
PAGE_BYTES = 4096
ALLOC_ALIGN_BYTES = 256
# Header words (int64), each written only by the PE that owns the file.
W_MAPPED = 0      # 1 once this PE mapped every peer's file
W_BARRIER = 1     # number of barriers this PE entered
W_RECORDS = 8     # two alloc records (double-buffered by call parity)
W_SIGNALS = W_RECORDS + 2 * ALLOC_RECORD_WORDS


def new_shm_unique_id() -> bytes:
    """Return 16 random bytes naming one shm heap job (its files carry them in hex)."""
    return secrets.token_bytes(16)


def shm_path(uid: bytes, pe: int) -> str:
    """Path of PE ``pe``'s heap file for the job ``uid``."""
    return os.path.join(SHM_DIR, f"{FILE_PREFIX}{uid.hex()}-pe{pe}")


def shm_leftovers(uid: bytes | None = None) -> list[str]:
    """Heap files (of job ``uid``, or of any job) still present in /dev/shm."""
    tag = uid.hex() if uid is not None else ""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{tag}*")))


def remove_shm_leftovers(uid: bytes) -> list[str]:
    """Unlink every file of job ``uid`` left in /dev/shm; return the paths removed."""
    removed = []
    for path in shm_leftovers(uid):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class ShmHeap(SymmetricHeap):
    """Symmetric heap over /dev/shm files; see the module docstring. Build with `open_heap`."""

    backend = "shm"

    def __init__(self, uid: bytes, rank: int, world_size: int, data_bytes: int, header_bytes: int,
                 maps: list[torch.Tensor], num_signals: int) -> None:
        self.uid = uid
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.num_signals = num_signals
        self.size_bytes = data_bytes
        self._headers = [m[:header_bytes].numpy().view(np.int64) for m in maps]
        self._data = [m[header_bytes:] for m in maps]
        self._data_ptr = self._data[rank].data_ptr()
        self._signals = self._headers[rank][W_SIGNALS:W_SIGNALS + num_signals]
        self._next_offset = 0
        self._num_alloc_calls = 0
        self._num_barriers = 0
        self._closed = False

    @classmethod
    def open(cls, uid: bytes, *, rank: int, world_size: int, size_bytes: int, device: object | None,
             num_signals: int, timeout_s: float) -> ShmHeap:
        """Create, map and unlink this PE's file; see `disagg.transfer.heap.open_heap`."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the shm heap lives in host memory: device must be None or 'cpu', got {device}")
        data_bytes = _round_up(size_bytes, PAGE_BYTES)
        header_bytes = _round_up((W_SIGNALS + num_signals) * 8, PAGE_BYTES)
        total_bytes = header_bytes + data_bytes
        try:
            _create_file(shm_path(uid, rank), total_bytes)
            maps = [_map_when_ready(shm_path(uid, pe), total_bytes, pe, rank, timeout_s)
                    for pe in range(world_size)]
            headers = [m[:header_bytes].numpy().view(np.int64) for m in maps]
            headers[rank][W_MAPPED] = 1
            _wait_all(headers, W_MAPPED, 1, rank, timeout_s, "map every heap file")
            os.unlink(shm_path(uid, rank))
        except BaseException:
            removed = remove_shm_leftovers(uid)
            logger.warning("shm heap %s: open failed on PE %d/%d; removed %d file(s)",
                           uid.hex(), rank, world_size, len(removed))
            raise
        logger.info("shm heap %s open: PE %d/%d, %d data bytes, %d signals",
                    uid.hex(), rank, world_size, data_bytes, num_signals)
        return cls(uid, rank, world_size, data_bytes, header_bytes, maps, num_signals)

    # ------------------------------------------------------------------ memory
    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        self._check_open("alloc")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"alloc: shape must be non-negative, got {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        offset = _round_up(self._next_offset, ALLOC_ALIGN_BYTES)
        call = self._num_alloc_calls
        self._num_alloc_calls += 1  # every PE counts every call, failed or not (keeps parity)
        word = W_RECORDS + (call % 2) * ALLOC_RECORD_WORDS
        self._headers[self.rank][word:word + ALLOC_RECORD_WORDS] = alloc_record(call, offset, nbytes, shape, dtype)
        self.barrier()
        records = np.stack([h[word:word + ALLOC_RECORD_WORDS] for h in self._headers])
        check_alloc_records(records, self.rank, shape, dtype)
        if offset + nbytes > self.size_bytes:
            raise HeapError(f"alloc: shm heap full: {shape} {dtype} needs {nbytes} bytes at offset "
                            f"{offset}, heap has {self.size_bytes} (raise size_bytes)")
        self._next_offset = offset + nbytes
        return self._data[self.rank][offset:offset + nbytes].view(dtype).view(shape)

    def peer(self, tensor: torch.Tensor, pe: int) -> torch.Tensor | None:
        self._check_open("peer")
        self._check_pe(pe, "peer")
        byte_offset = self._byte_offset(tensor, "peer")
        if pe == self.rank:
            return tensor
        typed = self._data[pe].view(tensor.dtype)
        return torch.as_strided(typed, tensor.size(), tensor.stride(),
                                typed.storage_offset() + byte_offset // tensor.element_size())

    def put_segments_async(self, tensor: torch.Tensor, pe: int, segments: np.ndarray,
                           stream: object | None = None) -> None:
        self._check_open("put_segments_async")
        self._check_pe(pe, "put_segments_async")
        base = self._byte_offset(tensor, "put_segments_async")
        check_segments(tensor, segments)
        src = self._data[self.rank]
        dst = self._data[pe]
        for src_byte, dst_byte, num_bytes in segments.tolist():
            dst[base + dst_byte:base + dst_byte + num_bytes].copy_(
                src[base + src_byte:base + src_byte + num_bytes])

    def _byte_offset(self, tensor: torch.Tensor, what: str) -> int:
        """Byte offset of ``tensor``'s first element in this PE's data region (checked)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"{what}: tensor must be on cpu for the shm heap, got {tensor.device}")
        offset = tensor.data_ptr() - self._data_ptr
        extent = (sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride())) + 1
                  if tensor.numel() else 0) * tensor.element_size()
        if offset < 0 or offset + extent > self.size_bytes or any(st < 0 for st in tensor.stride()):
            raise ValueError(f"{what}: tensor (shape {tuple(tensor.shape)}, {tensor.dtype}) is not "
                             f"memory of this heap's alloc() on PE {self.rank}")
        return offset

    # ------------------------------------------------------------------ synchronisation
    def barrier(self, timeout_s: float = 60.0) -> None:
        self._check_open("barrier")
        self._num_barriers += 1
        self._headers[self.rank][W_BARRIER] = self._num_barriers
        _wait_all(self._headers, W_BARRIER, self._num_barriers, self.rank, timeout_s, "barrier")

    def set_signal_async(self, index: int, value: int, pe: int, stream: object | None = None) -> None:
        self._check_open("set_signal_async")
        self._check_pe(pe, "set_signal_async")
        check_signal_index(index, self.num_signals)
        self._headers[pe][W_SIGNALS + index] = value

    def read_signals(self) -> np.ndarray:
        self._check_open("read_signals")
        return self._signals.copy()

    def read_signal(self, index: int) -> int:
        self._check_open("read_signal")
        check_signal_index(index, self.num_signals)
        return int(self._signals[index])

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop this PE's mappings (the memory goes when the last process unmaps it).

        Not blocking on peers: a crashed or slow peer cannot keep this PE from closing.
        """
        if self._closed:
            return
        self._closed = True
        self._headers, self._data, self._signals = [], [], np.zeros(0, dtype=np.int64)
        logger.info("shm heap %s closed: PE %d/%d", self.uid.hex(), self.rank, self.world_size)


def _create_file(path: str, total_bytes: int) -> None:
    """Create ``path`` at its full size atomically (peers never see a short file)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total_bytes)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if the path exists: a uid must not be reused
    except FileExistsError as err:
        raise HeapError(f"shm heap file {path} already exists: uid reused or a leftover "
                        "(remove_shm_leftovers(uid) removes it)") from err
    finally:
        os.unlink(tmp)


def _map_when_ready(path: str, total_bytes: int, pe: int, rank: int, timeout_s: float) -> torch.Tensor:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            size = None
        if size == total_bytes:
            return torch.from_file(path, shared=True, size=total_bytes, dtype=torch.uint8)
        if size is not None:
            raise HeapError(f"shm heap file of PE {pe} is {size} bytes, PE {rank} expects "
                            f"{total_bytes}: size_bytes or num_signals differ across PEs")
        if time.monotonic() > deadline:
            raise HeapError(f"PE {rank}: PE {pe} did not create its heap file {path} within {timeout_s} s")
        time.sleep(1e-3)


def _wait_all(headers: list[np.ndarray], word: int, value: int, rank: int, timeout_s: float,
              what: str) -> None:
    """Wait until header ``word`` of every PE is ``>= value``; HeapError names the late PEs."""
    deadline = time.monotonic() + timeout_s
    spins = 0
    while True:
        late = [pe for pe, h in enumerate(headers) if h[word] < value]
        if not late:
            return
        if time.monotonic() > deadline:
            raise HeapError(f"PE {rank}: {what} timed out after {timeout_s} s waiting for PE(s) {late}")
        spins += 1
        if spins > 200:
            time.sleep(min(1e-3, 1e-6 * spins))


def _open_shm(uid: bytes, *, rank: int, world_size: int, size_bytes: int, device: object | None,
              num_signals: int, timeout_s: float) -> ShmHeap:
    return ShmHeap.open(uid, rank=rank, world_size=world_size, size_bytes=size_bytes, device=device,
                        num_signals=num_signals, timeout_s=timeout_s)


# The registry's entry (`disagg.transfer.registry`): shm heaps share the symmetric-heap connector.
BACKEND = TransferBackend(name="shm", new_unique_id=lambda size_bytes=None: new_shm_unique_id(),
                          open=_open_shm, connector=HeapConnector)
