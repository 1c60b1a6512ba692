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
comes back to the calling process (the CLI's), which joins no world itself.
"""

from __future__ import annotations

import logging
import os
import queue
import traceback
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
    import multiprocessing

    from disagg.parallel import local_address

    gpus, backend = rank_devices(config, size)
    address = local_address("127.0.0.1")
    ctx = multiprocessing.get_context("spawn")  # no CUDA state or torch threads inherited
    results = ctx.Queue()
    procs = [ctx.Process(target=_profile_rank, name=f"profile-rank-{rank}", daemon=True,
                         args=(config, grid, rank, size, address, backend, gpus[rank], results))
             for rank in range(size)]
    logger.info("profiling %d tensor-parallel ranks over %s (GPUs %s)", size, backend, gpus)
    for proc in procs:
        proc.start()
    try:
        return _rank0_profile(procs, results, size)
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


def _rank0_profile(procs: list, results: Any, size: int) -> dict:
    """Wait for every rank's answer; rank 0's profile. A rank's error, or a rank gone without
    one, raises ClusterError naming it."""
    profile, answered = None, set()
    while len(answered) < size:
        try:
            rank, ok, payload = results.get(timeout=POLL_S)
        except queue.Empty:
            gone = [r for r, proc in enumerate(procs) if r not in answered and not proc.is_alive()]
            if gone:
                raise ClusterError(f"profiling tensor-parallel rank(s) {gone} of {size}: the process ended "
                                   f"without a result (exit code {procs[gone[0]].exitcode})") from None
            continue
        if not ok:
            raise ClusterError(f"profiling tensor-parallel rank {rank} of {size} failed: {payload}")
        answered.add(rank)
        if rank == 0:
            profile = payload
    assert profile is not None, "rank 0 answers with its profile"
    return profile


def _profile_rank(config: Config, grid: Grid, rank: int, size: int, address: str, backend: str,
                  gpu: int | None, results: Any) -> None:
    """One rank's process: join the world, build the replica, run the grid, answer (rank 0 with
    its profile, the others with None; an error as its last line)."""
    if gpu is not None:  # before anything touches CUDA: the rank sees its GPU alone, as an actor does
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    from disagg.parallel import init_tensor_parallel

    tp = None
    try:
        tp = init_tensor_parallel(address, rank, size, backend, config.cluster.startup_timeout_s)
        profile = run_profile(config, grid, build_engine(config, tp))
        results.put((rank, True, profile if rank == 0 else None))
    except BaseException as err:  # noqa: BLE001 - reported to the caller, which raises it
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        results.put((rank, False, last))
    finally:
        if tp is not None:
            tp.close()
