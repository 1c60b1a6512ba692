"""`disagg profile` of a tensor-parallel instance: one process per rank, each driving its replica.

An instance of ``instances.tensor_parallel`` k runs as k processes (`cluster/launch`: one actor
per rank, each rank's `EngineCore` fed the same calls). Profiled, it runs as k processes too,
spawned here: each joins the instance's `torch.distributed` world (`init_tensor_parallel`; NCCL
when every rank has a GPU of its own, gloo on the CPU and where ranks share a GPU, as the
launcher chooses), builds its replica (`profile.build_engine` with its `TPGroup`) and runs the
same grid (`profile.run_profile`). The grid's calls depend only on the engine's state, which is
the same on every rank (same pages, same requests, same steps), so every rank makes the same
calls in the same order, as the step loop's followers do; each step's all-reduces keep the
ranks in step, and rank 0's timings, all-reduces included, are the profile. Rank 0's profile
comes back to the calling process (the CLI's), which joins no world itself. `run_ranks`, the
launcher (spawn, one GPU each, gather the answers, name a rank that failed), also runs
``benchmarks/bench_tensor_parallel.py``'s ranks.
"""

from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from disagg.cluster.simulate.profile import Grid, build_engine, instance_tensor_parallel, run_profile
from disagg.config import Config
from disagg.errors import ClusterError

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often the caller looks for a rank process that died without a word


def profile_instance(config: Config, grid: Grid = Grid()) -> dict:
    """The profile of CONFIG's instance (`run_profile`): in this process at TP 1, else from one
    spawned process per rank (module docstring).

    Raises:
        ValueError: the config's roles run at different TPs (`instance_tensor_parallel`).
        ClusterError: a rank failed (its error's last line and rank), or the machine has fewer
            GPUs than the ranks need.
    """
    size = instance_tensor_parallel(config)
    if size == 1:
        return run_profile(config, grid)
    gpus, backend = rank_devices(config, size)
    logger.info("profiling %d tensor-parallel ranks over %s (GPUs %s)", size, backend, gpus)
    return run_ranks(_profile_rank, size, (config, grid, backend), gpus=gpus,
                     what="profiling tensor-parallel rank")[0]


def run_ranks(target: Callable[..., Any], size: int, args: tuple = (), *, gpus: list[int | None] | None = None,
              what: str = "tensor-parallel rank", timeout_s: float | None = None) -> list[Any]:
    """Run ``target(rank, size, address, *args)`` in one spawned process per rank, and gather what
    each returns: the launcher of `disagg profile`'s ranks and of ``benchmarks/bench_tensor_parallel.py``.

    Each process is spawned (no CUDA state or torch threads inherited). ``address`` is a free local
    TCP address for the ranks' world (`disagg.parallel.init_tensor_parallel`). ``gpus[rank]``, when
    not None, becomes the rank's ``CUDA_VISIBLE_DEVICES`` before anything touches CUDA (it sees its
    GPU alone, as an actor does). ``target`` and ``args`` travel pickled, so ``target`` is a module's
    top-level function; so are the answers.

    Args:
        target: one rank's work; its return value is that rank's answer.
        size: ranks (processes), >= 1.
        args: passed to every rank after ``(rank, size, address)``.
        gpus: per rank, its GPU index of this machine, or None (default: no change).
        what: how errors name a rank, e.g. "profiling tensor-parallel rank".
        timeout_s: seconds to wait for every answer (default: as long as the ranks live).

    Returns:
        Each rank's answer, rank order.

    Raises:
        ValueError: ``size`` below 1, or ``gpus`` not one per rank.
        ClusterError: a rank raised (its rank and its error's last line), ended without an answer
            (its exit code), or the answers took longer than ``timeout_s``.
    """
    import multiprocessing

    from disagg.parallel import local_address

    if size < 1:
        raise ValueError(f"size: expected at least 1 rank, got {size}")
    gpus = [None] * size if gpus is None else list(gpus)
    if len(gpus) != size:
        raise ValueError(f"gpus: expected one per rank ({size}), got {len(gpus)}")
    address = local_address("127.0.0.1")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, name=f"rank-{rank}", daemon=True,
                         args=(target, rank, size, address, args, gpus[rank], results))
             for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        return _answers(procs, results, what, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)


def rank_devices(config: Config, size: int) -> tuple[list[int | None], str]:
    """Each rank's GPU (an index of this machine's visible GPUs; None on the CPU) and the backend
    of their world: ``instances.ranks_per_gpu`` consecutive ranks share a GPU; NCCL when each rank
    has its own, else gloo.

    Raises:
        ClusterError: fewer visible GPUs than the ranks need.
    """
    import torch

    device = config.instances.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return [None] * size, "gloo"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [int(v) for v in visible.split(",") if v.strip()] if visible else list(range(torch.cuda.device_count()))
    per_gpu = config.instances.ranks_per_gpu
    needed = -(-size // per_gpu)
    if len(ids) < needed:
        raise ClusterError(f"profiling tensor_parallel {size} at {per_gpu} rank(s) per GPU needs {needed} GPUs, "
                           f"this machine shows {len(ids)}")
    gpus = [ids[rank // per_gpu] for rank in range(size)]
    return gpus, "nccl" if len(set(gpus)) == size else "gloo"


def _answers(procs: list, results: Any, what: str, timeout_s: float | None) -> list[Any]:
    """Wait for every rank's answer. A rank's error, a rank gone without one, or the deadline
    passing raises ClusterError naming the rank(s)."""
    size = len(procs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    answers: dict[int, Any] = {}
    while len(answers) < size:
        try:
            rank, ok, payload = results.get(timeout=POLL_S)
        except queue.Empty:
            missing = [r for r in range(size) if r not in answers]
            gone = [r for r in missing if not procs[r].is_alive()]
            if gone:
                raise ClusterError(f"{what}(s) {gone} of {size}: the process ended without a result "
                                   f"(exit code {procs[gone[0]].exitcode})") from None
            if deadline is not None and time.monotonic() > deadline:
                raise ClusterError(f"{what}(s) {missing} of {size}: no answer within {timeout_s:g} s") from None
            continue
        if not ok:
            raise ClusterError(f"{what} {rank} of {size} failed: {payload}")
        answers[rank] = payload
    return [answers[rank] for rank in range(size)]


def _rank_entry(target: Callable[..., Any], rank: int, size: int, address: str, args: tuple, gpu: int | None,
                results: Any) -> None:
    """One rank's process: run ``target``, answer ``(rank, True, value)`` or, on an error,
    ``(rank, False, its last line)``."""
    if gpu is not None:  # before anything touches CUDA: the rank sees its GPU alone, as an actor does
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        results.put((rank, True, target(rank, size, address, *args)))
    except BaseException as err:  # noqa: BLE001 - reported to the caller, which raises it
        results.put((rank, False, traceback.format_exception_only(type(err), err)[-1].strip()))


def _profile_rank(rank: int, size: int, address: str, config: Config, grid: Grid, backend: str) -> dict | None:
    """One rank of `profile_instance`: join the world, build the replica, run the grid; rank 0's
    profile (the others answer None)."""
    from disagg.parallel import init_tensor_parallel

    tp = init_tensor_parallel(address, rank, size, backend, config.cluster.startup_timeout_s)
    try:
        profile = run_profile(config, grid, build_engine(config, tp))
        return profile if rank == 0 else None
    finally:
        tp.close()
