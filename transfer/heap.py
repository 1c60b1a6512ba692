"""The symmetric heap: one allocation per PE at the same offset on every PE, peer views, signals.

`open_heap` is the only way in: every rank of a job calls it at the same time with the bytes that
rank 0 got from `new_unique_id`. Two backends, each a module registered by name in
`disagg.transfer.registry`, share the `SymmetricHeap` interface below:

- ``"nvshmem"`` (`disagg.transfer.nvshmem_heap`): nvshmem4py on one GPU per process; peers on the
  same NVLink domain are load/store reachable, others only through host-initiated puts.
- ``"shm"`` (`disagg.transfer.shm_heap`): one file per PE under /dev/shm that every PE maps; CPU
  only; what CI runs. A write through `peer()` lands in the other process one-sidedly.

Runs in every worker process (prefill and decode). Callers above this module never import a
backend directly, so `nvshmem` is only imported when the ``"nvshmem"`` backend is opened.
"""

from __future__ import annotations

import abc
import time
import zlib
from typing import TYPE_CHECKING, Sequence

import numpy as np

from disagg.errors import HeapError, SignalTimeout
from disagg.transfer.registry import backend_names, get_backend

if TYPE_CHECKING:
    import torch

BACKENDS = backend_names()  # ("nvshmem", "shm"): `disagg.transfer.registry.BACKENDS`
NUM_SIGNALS_DEFAULT = 4096
# Fields of one allocation record, compared across PEs before an allocation is committed.
ALLOC_RECORD_FIELDS = ("sequence", "offset", "nbytes", "dtype", "ndim", "shape_crc")
ALLOC_RECORD_WORDS = 8


class SymmetricHeap(abc.ABC):
    """Memory that every PE allocates identically and that peers can address.

    Attributes:
        backend: ``"nvshmem"`` or ``"shm"``.
        rank: this process's PE number, ``0 <= rank < world_size``.
        world_size: number of PEs in the job.
        device: where allocations live (``cuda:N`` or ``cpu``).
        num_signals: number of 64-bit signal words each PE owns (indices ``0..num_signals-1``).
    """

    backend: str
    rank: int
    world_size: int
    device: torch.device
    num_signals: int

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Collectively allocate a zero-initialised tensor at the same heap offset on every PE.

        Every PE must call `alloc` with the same shapes and dtypes in the same order. A mismatch
        is detected before anything is committed and raises `HeapError` on every PE.

        Raises:
            HeapError: the heap is closed or full, or the PEs disagree on the allocation.
        """

    @abc.abstractmethod
    def peer(self, tensor: torch.Tensor, pe: int) -> torch.Tensor | None:
        """Return a tensor aliasing PE ``pe``'s copy of ``tensor`` (a view into `alloc` memory).

        Args:
            tensor: any view (same sizes/strides kept) of a tensor returned by `alloc`.
            pe: the peer; ``pe == rank`` returns ``tensor`` itself.

        Returns:
            The peer view, or None when PE ``pe`` is not load/store reachable from here (use
            `put_segments_async` for it).
        """

    @abc.abstractmethod
    def put_segments_async(self, tensor: torch.Tensor, pe: int, segments: np.ndarray,
                           stream: object | None = None) -> None:
        """Copy byte runs of this PE's ``tensor`` into PE ``pe``'s copy of the same tensor.

        One host-initiated put per row of ``segments``; works whether or not ``pe`` is load/store
        reachable. Ordered after earlier work on ``stream`` (the current stream when None).

        Args:
            tensor: a contiguous tensor returned by `alloc`.
            pe: destination PE.
            segments: int64 ``[num_segments, 3]``, rows ``(src_byte, dst_byte, num_bytes)``
                relative to ``tensor``'s first byte (see `disagg.transfer.segments`).
            stream: a CUDA stream (GPU backends); ignored on CPU, where the copies are done
                before the call returns.
        """

    # ------------------------------------------------------------------ synchronisation
    @abc.abstractmethod
    def barrier(self, timeout_s: float = 60.0) -> None:
        """Wait until every PE reached the barrier and every write this PE issued has landed.

        Raises:
            HeapError: the heap is closed, or (where the backend can time out) a PE did not
                arrive within ``timeout_s``.
        """

    @abc.abstractmethod
    def set_signal_async(self, index: int, value: int, pe: int, stream: object | None = None) -> None:
        """Set signal word ``index`` of PE ``pe`` to ``value``, after all earlier work on ``stream``.

        Every write issued before on ``stream`` (kernels storing into peer views, segment puts)
        is visible at system scope before the word changes, so a reader that sees ``value`` may
        read the data. Words are single-writer by protocol (the owner of a doorbell ticket).
        """

    def quiet_async(self, stream: object | None = None) -> None:
        """Complete every put this PE issued, after all earlier work on ``stream`` (the current
        stream when None): work recorded after it on ``stream`` runs once they have landed.

        The default does nothing: backends whose puts complete before the call returns (shm).
        """

    @abc.abstractmethod
    def read_signals(self) -> np.ndarray:
        """Return a snapshot of this PE's signal words, int64 ``[num_signals]``."""

    @abc.abstractmethod
    def read_signal(self, index: int) -> int:
        """Return this PE's signal word ``index``."""

    def try_wait_signal(self, index: int, value: int, timeout_s: float) -> int | None:
        """Wait until local signal word ``index`` is ``>= value``; return it, or None on timeout."""
        check_signal_index(index, self.num_signals)
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            seen = self.read_signal(index)
            if seen >= value:
                return seen
            if time.monotonic() >= deadline:
                return None
            spins += 1
            if spins > 1000:  # spin briefly for latency, then stop burning a core
                time.sleep(min(1e-3, 1e-6 * spins))

    def wait_signal(self, index: int, value: int, timeout_s: float, *,
                    request_id: int | str | None = None, src_pe: int = -1) -> int:
        """Like `try_wait_signal` but raise `SignalTimeout` naming request and PEs on timeout."""
        seen = self.try_wait_signal(index, value, timeout_s)
        if seen is None:
            raise SignalTimeout(
                f"signal word {index} stayed at {self.read_signal(index)}, below {value}, "
                f"for {timeout_s:.3f} s", request_id=request_id, src_pe=src_pe, dst_pe=self.rank)
        return seen

    # ------------------------------------------------------------------ lifetime
    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True after `close`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the heap (collective on every PE); later calls on it raise `HeapError`."""

    def __enter__(self) -> SymmetricHeap:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise HeapError(f"{what}: the {self.backend} heap of PE {self.rank} is closed")

    def _check_pe(self, pe: int, what: str) -> None:
        if not 0 <= pe < self.world_size:
            raise HeapError(f"{what}: pe must be in [0, {self.world_size}), got {pe}")


def check_signal_index(index: int, num_signals: int) -> None:
    """Raise ValueError unless ``0 <= index < num_signals``."""
    if not 0 <= index < num_signals:
        raise ValueError(f"signal index must be in [0, {num_signals}), got {index}")


def check_segments(tensor: torch.Tensor, segments: np.ndarray) -> None:
    """Raise ValueError unless ``segments`` are int64 ``[n, 3]`` byte runs inside ``tensor``."""
    if not tensor.is_contiguous():
        raise ValueError(f"segments: tensor must be contiguous, got strides {tensor.stride()}")
    if segments.ndim != 2 or segments.shape[1] != 3:
        raise ValueError(f"segments must be [num_segments, 3] (src_byte, dst_byte, num_bytes), got shape {segments.shape}")
    if len(segments) == 0:
        return
    nbytes = tensor.numel() * tensor.element_size()
    src, dst, size = segments[:, 0], segments[:, 1], segments[:, 2]
    if size.min() <= 0 or min(src.min(), dst.min()) < 0 or max((src + size).max(), (dst + size).max()) > nbytes:
        raise ValueError(f"segments must be non-empty byte runs inside the tensor's {nbytes} bytes")


def alloc_record(sequence: int, offset: int, nbytes: int, shape: Sequence[int],
                 dtype: torch.dtype) -> np.ndarray:
    """Describe one allocation as int64 ``[ALLOC_RECORD_WORDS]`` so PEs can compare them."""
    record = np.zeros(ALLOC_RECORD_WORDS, dtype=np.int64)
    shape_text = ",".join(str(int(s)) for s in shape).encode()
    record[:6] = (sequence, offset, nbytes, zlib.crc32(str(dtype).encode()), len(shape),
                  zlib.crc32(shape_text))
    return record


def check_alloc_records(records: np.ndarray, rank: int, shape: Sequence[int],
                        dtype: torch.dtype) -> None:
    """Raise HeapError naming the first field where a PE's allocation differs from this PE's.

    Args:
        records: int64 ``[world_size, ALLOC_RECORD_WORDS]``, row ``p`` written by PE ``p``.
        rank: this PE.
        shape, dtype: this PE's request, quoted in the message.
    """
    mine = records[rank]
    for pe, theirs in enumerate(records):
        if np.array_equal(theirs, mine):
            continue
        field = next(ALLOC_RECORD_FIELDS[i] for i in range(len(ALLOC_RECORD_FIELDS))
                     if theirs[i] != mine[i])
        raise HeapError(
            f"collective alloc mismatch: PE {rank} asked for shape {tuple(shape)} {dtype} "
            f"but PE {pe} differs in {field} (PE {rank}: {int(mine[ALLOC_RECORD_FIELDS.index(field)])},"
            f" PE {pe}: {int(theirs[ALLOC_RECORD_FIELDS.index(field)])}); every PE must allocate "
            "the same shapes and dtypes in the same order")


def new_unique_id(backend: str, *, size_bytes: int | None = None) -> bytes:
    """Make the bootstrap id of a new heap job; call once, on rank 0, and send it to every rank.

    Args:
        backend: ``"nvshmem"`` or ``"shm"``.
        size_bytes: optional, nvshmem only: the ``size_bytes`` rank 0 will pass to `open_heap`.
            NVSHMEM reads its options when the id is made, so this is when rank 0's symmetric
            heap size is set (see `disagg.transfer.nvshmem_heap.new_nvshmem_unique_id`).

    Returns:
        Opaque bytes for `open_heap(uid=...)` (128 bytes for nvshmem, 16 for shm).
    """
    return get_backend(backend).new_unique_id(size_bytes)


def open_heap(backend: str, *, uid: bytes, rank: int, world_size: int, size_bytes: int,
              device: object | None = None, num_signals: int = NUM_SIGNALS_DEFAULT,
              timeout_s: float = 60.0) -> SymmetricHeap:
    """Open this rank's part of a symmetric heap; every rank calls it concurrently.

    Args:
        backend: ``"nvshmem"`` or ``"shm"``.
        uid: the bytes rank 0 got from `new_unique_id(backend)`.
        rank: this PE, ``0 <= rank < world_size``.
        world_size: number of PEs.
        size_bytes: bytes available to `alloc` on each PE.
        device: CUDA device for ``"nvshmem"`` (default: the current one); must be None or
            ``"cpu"`` for ``"shm"``.
        num_signals: signal words per PE (doorbells).
        timeout_s: how long to wait for the other PEs (``"shm"``; NVSHMEM's own bootstrap has
            no timeout, so wrap that call in one).

    Raises:
        ValueError: a bad argument (named in the message).
        HeapError: the bootstrap failed (a PE missing, sizes that differ across PEs).
    """
    entry = get_backend(backend)  # raises naming the registered backends
    if not isinstance(uid, (bytes, bytearray)) or not uid:
        raise ValueError(f"uid must be the non-empty bytes of new_unique_id({backend!r}), got {type(uid).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if size_bytes <= 0:
        raise ValueError(f"size_bytes must be positive, got {size_bytes}")
    if num_signals <= 0:
        raise ValueError(f"num_signals must be positive, got {num_signals}")
    return entry.open(bytes(uid), rank=rank, world_size=world_size, size_bytes=size_bytes, device=device,
                      num_signals=num_signals, timeout_s=timeout_s)
