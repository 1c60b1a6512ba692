"""The ``"nvshmem"`` symmetric heap: nvshmem4py on one GPU per process (the only nvshmem import).

Bootstrap (docs/ARCHITECTURE.md §5): rank 0 makes a unique id, its 128 bytes travel to every
rank (through Ray), every rank binds its GPU and calls
``nvshmem.core.init(..., initializer_method="uid")`` at the same time. Allocations are
``nvshmem.core.tensor`` (collective); ``get_peer_tensor`` gives load/store views of PEs on the
same NVLink domain (never asked for this PE); other PEs take ``putmem_on_stream`` puts. `close`
frees every tensor in allocation order (the same on every PE) and then finalizes.

Signal words are an int64 symmetric array; a ring is ``quiet_on_stream`` + ``signal_op_on_stream``
(SIGNAL_SET) on the writer's stream, so it lands after every earlier write of that stream (see
`set_signal_async`). The owner reads its words with a small device-to-host copy on a side stream.
"""

from __future__ import annotations

import logging
import os
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

UID_BYTES = 128
# Heap headroom beyond size_bytes: signal/record arrays, allocation alignment, NVSHMEM's own use.
HEADROOM_BYTES = 256 << 20
_active: dict[str, NvshmemHeap] = {}
# NVSHMEM reads its environment once per process, at the first get_unique_id or init.
_frozen_symmetric_size: dict[str, str | None] = {}


def _nvshmem():
    """Import nvshmem4py lazily (only GPU processes that open this backend need it)."""
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except ImportError as err:
        raise HeapError("the nvshmem heap needs nvshmem4py (pip install nvshmem4py-cu13)") from err
    return core, bindings


def new_nvshmem_unique_id(size_bytes: int | None = None) -> bytes:
    """Rank 0: a fresh NVSHMEM unique id as 128 bytes (send them to every rank).

    NVSHMEM reads its options here, in this process, once: pass the ``size_bytes`` that
    `open_heap` will get so that NVSHMEM_SYMMETRIC_SIZE is set in time (without it the heap still
    grows on demand through CUDA VMM, from NVSHMEM's default initial size).
    """
    if size_bytes is not None:
        _set_symmetric_size(size_bytes)
    _frozen_symmetric_size.setdefault("value", os.environ.get("NVSHMEM_SYMMETRIC_SIZE"))
    core, _ = _nvshmem()
    return core.get_unique_id()._data.view(np.int8).tobytes()


def _set_symmetric_size(size_bytes: int) -> None:
    """Size the symmetric heap before NVSHMEM reads its options (once per process)."""
    wanted = str(size_bytes + HEADROOM_BYTES)
    if "value" not in _frozen_symmetric_size:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = wanted
    elif _frozen_symmetric_size["value"] != wanted:
        logger.info("NVSHMEM read its options when this process made the unique id: "
                    "NVSHMEM_SYMMETRIC_SIZE stays %s (wanted %s); the heap grows on demand",
                    _frozen_symmetric_size["value"], wanted)


class NvshmemHeap(SymmetricHeap):
    """Symmetric heap over NVSHMEM; see the module docstring. Build with `open_heap`."""

    backend = "nvshmem"

    def __init__(self, rank: int, world_size: int, device: torch.device, num_signals: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.num_signals = num_signals
        self._core, self._bindings = _nvshmem()
        self._stream = torch.cuda.Stream(device)       # barriers, alloc records
        self._poll_stream = torch.cuda.Stream(device)  # signal reads
        self._allocs: list[torch.Tensor] = []          # every nvshmem tensor, in allocation order
        self._peer_views: dict[tuple[int, int], torch.Tensor | None] = {}
        self._num_alloc_calls = 0
        self._allocated_bytes = 0
        self._closed = False
        self._signals = self._raw_alloc((num_signals,), torch.int64)
        self._records = self._raw_alloc((2, world_size, ALLOC_RECORD_WORDS), torch.int64)
        # Word p: the number of barriers PE p has entered (set remotely by p): bounds `barrier`.
        self._arrivals = self._raw_alloc((world_size,), torch.int64)
        self._host_arrivals = torch.zeros(world_size, dtype=torch.int64, pin_memory=True)
        self._num_barriers = 0
        self._barrier_failed: list[int] = []
        self._host_signals = torch.zeros(num_signals, dtype=torch.int64, pin_memory=True)
        # Unbounded once: no PE may announce a barrier before every PE zeroed its arrival words.
        torch.cuda.synchronize(device)
        self._bindings.barrier_all_on_stream(self._stream.cuda_stream)
        self._stream.synchronize()

    @classmethod
    def open(cls, uid: bytes, *, rank: int, world_size: int, size_bytes: int, device: object | None,
             num_signals: int) -> NvshmemHeap:
        """Bind the GPU, run the UID bootstrap and allocate the signal words (collective)."""
        if len(uid) != UID_BYTES:
            raise ValueError(f"uid must be the {UID_BYTES} bytes of new_unique_id('nvshmem'), got {len(uid)}")
        if _active:
            raise HeapError(f"PE {rank}: an nvshmem heap is already open in this process "
                            "(NVSHMEM is process-global: one heap per process)")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"the nvshmem heap needs a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        _set_symmetric_size(size_bytes)
        _frozen_symmetric_size.setdefault("value", os.environ.get("NVSHMEM_SYMMETRIC_SIZE"))
        core, _ = _nvshmem()
        from cuda.core import Device  # nvshmem4py's own dependency

        cu_device = Device(dev.index)
        cu_device.set_current()
        nv_uid = core.get_unique_id(empty=True)
        nv_uid._data.view(np.int8)[:] = np.frombuffer(uid, dtype=np.int8)
        try:
            core.init(device=cu_device, uid=nv_uid, rank=rank, nranks=world_size, initializer_method="uid")
        except Exception as err:
            raise HeapError(f"PE {rank}/{world_size}: NVSHMEM UID bootstrap failed: {err!r}") from err
        if core.my_pe() != rank or core.n_pes() != world_size:
            raise HeapError(f"NVSHMEM says PE {core.my_pe()}/{core.n_pes()}, expected {rank}/{world_size}")
        heap = cls(rank, world_size, dev, num_signals)
        _active["heap"] = heap
        logger.info("nvshmem heap open: PE %d/%d on %s, %d bytes, %d signals",
                    rank, world_size, dev, size_bytes, num_signals)
        return heap

    # ------------------------------------------------------------------ memory
    def _raw_alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        try:
            tensor = self._core.tensor(tuple(shape), dtype=dtype)
        except Exception as err:
            raise HeapError(f"alloc: nvshmem could not allocate {tuple(shape)} {dtype} on PE "
                            f"{self.rank}: {err!r} (raise size_bytes)") from err
        self._allocs.append(tensor)
        tensor.zero_()
        return tensor

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        self._check_open("alloc")
        shape = tuple(int(s) for s in shape)
        if any(s <= 0 for s in shape):
            raise ValueError(f"alloc: every dim must be positive, got {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        call = self._num_alloc_calls
        self._num_alloc_calls += 1
        record = alloc_record(call, self._allocated_bytes, nbytes, shape, dtype)
        self._check_alloc_record(call % 2, record, shape, dtype)
        tensor = self._raw_alloc(shape, dtype)
        self._allocated_bytes += nbytes
        self.barrier()  # no peer writes into the tensor before it is zeroed everywhere
        return tensor

    def _check_alloc_record(self, parity: int, record: np.ndarray, shape: tuple[int, ...],
                            dtype: torch.dtype) -> None:
        """Publish this PE's record to every PE's row ``rank``, barrier, compare all rows."""
        row = self._records[parity, self.rank]
        handle = self._stream.cuda_stream
        with torch.cuda.stream(self._stream):
            row.copy_(torch.from_numpy(record))
            for pe in range(self.world_size):
                if pe != self.rank:
                    self._bindings.putmem_on_stream(row.data_ptr(), row.data_ptr(), row.nbytes, pe, handle)
        self.barrier()
        with torch.cuda.stream(self._stream):
            records = self._records[parity].cpu().numpy()
        check_alloc_records(records, self.rank, shape, dtype)

    def _base_of(self, tensor: torch.Tensor, what: str) -> tuple[int, torch.Tensor, int]:
        """(allocation index, allocation tensor, byte offset) of a view into `alloc` memory."""
        if tensor.device != self.device:
            raise ValueError(f"{what}: tensor must be on {self.device}, got {tensor.device}")
        ptr = tensor.data_ptr()
        extent = (sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()
        for index, base in enumerate(self._allocs):
            offset = ptr - base.data_ptr()
            if 0 <= offset and offset + extent <= base.nbytes:
                return index, base, offset
        raise ValueError(f"{what}: tensor (shape {tuple(tensor.shape)}, {tensor.dtype}) is not "
                         f"memory of this heap's alloc() on PE {self.rank}")

    def peer(self, tensor: torch.Tensor, pe: int) -> torch.Tensor | None:
        self._check_open("peer")
        self._check_pe(pe, "peer")
        index, base, offset = self._base_of(tensor, "peer")
        if pe == self.rank:
            return tensor
        key = (index, pe)
        if key not in self._peer_views:
            reachable = self._bindings.ptr(base.data_ptr(), pe) != 0
            self._peer_views[key] = self._core.get_peer_tensor(base, pe) if reachable else None
            if not reachable:
                logger.info("PE %d -> PE %d: not load/store reachable; puts only", self.rank, pe)
        peer_base = self._peer_views[key]
        if peer_base is None:
            return None
        typed = peer_base.view(-1).view(torch.uint8).view(tensor.dtype)
        return torch.as_strided(typed, tensor.size(), tensor.stride(),
                                typed.storage_offset() + offset // tensor.element_size())

    def put_segments_async(self, tensor: torch.Tensor, pe: int, segments: np.ndarray,
                           stream: object | None = None) -> None:
        self._check_open("put_segments_async")
        self._check_pe(pe, "put_segments_async")
        self._base_of(tensor, "put_segments_async")
        check_segments(tensor, segments)
        handle = (stream or torch.cuda.current_stream(self.device)).cuda_stream
        base = tensor.data_ptr()
        put = self._bindings.putmem_on_stream
        for src_byte, dst_byte, num_bytes in segments.tolist():
            put(base + dst_byte, base + src_byte, num_bytes, pe, handle)

    # ------------------------------------------------------------------ synchronisation
    def barrier(self, timeout_s: float = 60.0) -> None:
        """Device-wide sync, then ``barrier_all`` (which also completes this PE's puts).

        NVSHMEM's own barrier cannot time out, so it is entered only once every PE has arrived:
        each PE first sets its word in every PE's arrival array (``signal_op_on_stream``) and
        polls its own array from the host until every PE has entered this barrier or
        ``timeout_s`` passes. A PE that dies after arriving but before ``barrier_all`` can still
        hang it; bound the process (the cluster's actor health checks) for that.

        Args:
            timeout_s: how long to wait for every PE to arrive (> 0).

        Raises:
            HeapError: the heap is closed, or PEs did not arrive within ``timeout_s`` (names
                them; every later barrier then raises too: the PEs' counts are out of step).
        """
        self._check_open("barrier")
        if self._barrier_failed:
            raise HeapError(f"PE {self.rank}: an earlier barrier timed out waiting for PE(s) "
                            f"{self._barrier_failed}; this heap cannot synchronise any more")
        if not timeout_s > 0:
            raise ValueError(f"barrier: expected timeout_s > 0, got {timeout_s}")
        torch.cuda.synchronize(self.device)
        self._num_barriers += 1
        self._wait_arrivals(self._num_barriers, timeout_s)
        self._bindings.barrier_all_on_stream(self._stream.cuda_stream)
        self._stream.synchronize()

    def _wait_arrivals(self, count: int, timeout_s: float) -> None:
        """Announce barrier number ``count`` to every PE; wait until every PE announced it."""
        handle = self._stream.cuda_stream
        word = self._arrivals.data_ptr() + 8 * self.rank
        op = int(self._core.SignalOp.SIGNAL_SET)
        for pe in range(self.world_size):
            self._bindings.signal_op_on_stream(word, count, op, pe, handle)
        self._stream.synchronize()
        deadline = time.monotonic() + timeout_s
        while True:
            with torch.cuda.stream(self._poll_stream):
                self._host_arrivals.copy_(self._arrivals, non_blocking=True)
            self._poll_stream.synchronize()
            late = [pe for pe, n in enumerate(self._host_arrivals.tolist()) if n < count]
            if not late:
                return
            if time.monotonic() > deadline:
                self._barrier_failed = late
                raise HeapError(f"PE {self.rank}: barrier timed out after {timeout_s} s waiting for "
                                f"PE(s) {late}; the heap's barriers are out of step now: close it")
            time.sleep(1e-4)

    def set_signal_async(self, index: int, value: int, pe: int, stream: object | None = None) -> None:
        """Ring PE ``pe``'s word ``index`` after every earlier write on ``stream``.

        Ordering argument: the data writes of a request are earlier work on the same stream:
        kernels storing through peer views (complete, and visible system-wide, when the kernel
        completes, before the stream runs anything after it) and host-initiated puts (completed
        by ``quiet_on_stream``, which also covers remote transports). ``signal_op_on_stream``
        runs after both, so a reader that sees the value sees the data.
        """
        self._check_open("set_signal_async")
        self._check_pe(pe, "set_signal_async")
        check_signal_index(index, self.num_signals)
        handle = (stream or torch.cuda.current_stream(self.device)).cuda_stream
        self._bindings.quiet_on_stream(handle)
        self._bindings.signal_op_on_stream(self._signals.data_ptr() + 8 * index, int(value),
                                           int(self._core.SignalOp.SIGNAL_SET), pe, handle)

    def quiet_async(self, stream: object | None = None) -> None:
        """``quiet_on_stream``: the puts issued before (remote transports included) complete
        before anything later on ``stream`` runs."""
        self._check_open("quiet_async")
        self._bindings.quiet_on_stream((stream or torch.cuda.current_stream(self.device)).cuda_stream)

    def read_signals(self) -> np.ndarray:
        self._check_open("read_signals")
        with torch.cuda.stream(self._poll_stream):
            self._host_signals.copy_(self._signals, non_blocking=True)
        self._poll_stream.synchronize()
        return self._host_signals.numpy().copy()

    def read_signal(self, index: int) -> int:
        self._check_open("read_signal")
        check_signal_index(index, self.num_signals)
        word = self._host_signals[index:index + 1]
        with torch.cuda.stream(self._poll_stream):
            word.copy_(self._signals[index:index + 1], non_blocking=True)
        self._poll_stream.synchronize()
        return int(word[0])

    def wait_signal_async(self, index: int, value: int, stream: object | None = None) -> None:
        """Make ``stream`` wait on the device until local word ``index`` is ``>= value``.

        No host round trip and no timeout: use after the host saw the word move, or bound it.
        """
        self._check_open("wait_signal_async")
        check_signal_index(index, self.num_signals)
        handle = (stream or torch.cuda.current_stream(self.device)).cuda_stream
        self._bindings.signal_wait_until_on_stream(self._signals.data_ptr() + 8 * index,
                                                   int(self._core.ComparisonType.CMP_GE), int(value), handle)

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Barrier, free every allocation in allocation order, finalize (collective).

        Tensors returned by `alloc` and `peer` must not be used afterwards.
        """
        if self._closed:
            return
        self.barrier()
        self._peer_views.clear()
        for tensor in self._allocs:
            self._core.free_tensor(tensor)
        self._allocs.clear()
        self._core.finalize()
        self._closed = True
        _active.clear()
        logger.info("nvshmem heap closed: PE %d/%d", self.rank, self.world_size)


def _open_nvshmem(uid: bytes, *, rank: int, world_size: int, size_bytes: int, device: object | None,
                  num_signals: int, timeout_s: float) -> NvshmemHeap:
    """`NvshmemHeap.open`; NVSHMEM's bootstrap has no timeout (the caller wraps it in one)."""
    return NvshmemHeap.open(uid, rank=rank, world_size=world_size, size_bytes=size_bytes, device=device,
                            num_signals=num_signals)


# The registry's entry (`disagg.transfer.registry`): the symmetric-heap connector, as shm's.
BACKEND = TransferBackend(name="nvshmem", new_unique_id=new_nvshmem_unique_id, open=_open_nvshmem,
                          connector=HeapConnector)
