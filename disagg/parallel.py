"""`TPGroup`: the ranks of one tensor-parallel instance and their collectives.

Each rank of an instance is its own process (an engine actor, a test's child process) and joins
one `torch.distributed` world per instance through `init_tensor_parallel`, over the address the
leader (rank 0) picked with `local_address`. The model (`disagg.model`) runs its all-reduces and
its logits gather on `device_group`: NCCL when each rank has its own GPU (CUDA-graph capturable),
gloo on the CPU and between ranks that share one GPU (NCCL refuses two ranks on one device);
gloo all-reduces CUDA tensors directly and gathers them through the host. The engine sends its
control objects (each step's calls) over `cpu_group`, always gloo. `SINGLE`, the one-rank group,
does no communication at all and never touches torch.distributed.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class TPGroup:
    """Rank `rank` of a tensor-parallel group of `size` ranks.

    Attributes:
        rank: this process's rank in [0, size); rank 0 is the instance's leader.
        size: ranks in the group.
        device_group: the torch.distributed group of the activations' collectives (None for
            `SINGLE`, or for a group that only names a rank's shard: its collectives raise).
        cpu_group: a gloo group over the same ranks for Python objects.
        backend: "nccl" or "gloo", the device group's backend (None without one).
    """

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    backend: str | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x` (any shape and dtype)."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self._group())
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (one shape on all ranks) concatenated along `dim` in rank order: a new
        tensor whose `dim` is `size` times `x`'s, on `x`'s device."""
        if self.size == 1:
            return x
        group = self._group()
        if self.backend == "nccl":
            out = x.new_empty((self.size, *x.shape))
            dist.all_gather_into_tensor(out, x.contiguous(), group=group)  # capturable
            return torch.cat(out.unbind(0), dim=dim)
        host = x.detach().cpu().contiguous()  # gloo: through the host for CUDA tensors too
        parts = [torch.empty_like(host) for _ in range(self.size)]
        dist.all_gather(parts, host, group=group)
        return torch.cat(parts, dim=dim).to(x.device)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` (picklable) on every rank; the other ranks' `obj` is ignored."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._group(cpu=True))
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group(cpu=True))
        return out

    def close(self) -> None:
        """Leave the world (destroys the default process group); `SINGLE` has none."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _group(self, cpu: bool = False) -> Any:
        group = self.cpu_group if cpu else self.device_group
        if group is None:
            raise RuntimeError(f"TPGroup rank {self.rank} of {self.size} has no process group: made "
                               "without init_tensor_parallel, it can name a shard but not communicate")
        return group


SINGLE = TPGroup()


def init_tensor_parallel(address: str, rank: int, size: int, backend: str,
                         timeout_s: float) -> TPGroup:
    """Join the instance's world as rank `rank` of `size` (every rank calls it; it returns once
    all have joined). One world per process: a process belongs to one instance.

    Args:
        address: "host:port" where rank 0 listens (`local_address` on the leader).
        rank: this process's rank in [0, size).
        size: the instance's ranks; 1 returns `SINGLE` without a process group.
        backend: "nccl" (one GPU per rank; set the CUDA device first) or "gloo".
        timeout_s: how long joining, and later each collective, may wait for the other ranks.

    Returns:
        The `TPGroup`: device_group the default group of `backend`, cpu_group a gloo group.

    Raises:
        ValueError: a bad backend, rank or size.
        RuntimeError, DistBackendError: the ranks did not all join within `timeout_s`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank, size: expected 0 <= rank < size, got rank={rank!r}, size={size!r}")
    if size == 1:
        return SINGLE
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=timeout)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else device_group
    logger.info("tensor-parallel rank %d of %d joined %s over %s", rank, size, address, backend)
    return TPGroup(rank=rank, size=size, device_group=device_group, cpu_group=cpu_group,
                   backend=backend)


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it; another process may take it before
    rank 0 binds it, which then fails to start: pick again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def local_address(host: str | None = None) -> str:
    """"host:port" for rank 0 to listen on: `host` (default this machine's address by its
    hostname, 127.0.0.1 if that does not resolve) and a `free_port`."""
    if host is None:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"{host}:{free_port()}"
