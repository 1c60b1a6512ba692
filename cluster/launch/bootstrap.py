"""From a validated config to a running, checked fleet of instance actors.

`start_fleet(config)` first checks what needs no Ray (the model source, and the GPUs of this
host when Ray is to start here: `check_model_source`, `check_local_gpus`), then connects to Ray
(`disagg.cluster.launch.connect`: joins ``cluster.address`` or starts an embedded head on loopback,
token authentication on), reserves one placement group bundle per instance (one GPU each, a
share 1/k of one with ``instances.gpus_per_instance``, or CPU), starts one actor of
`ACTOR_CLASS` per instance (its config without secrets: `SECRET_FIELDS`; its environment:
`NO_MULTICAST_ENV` and the launcher's `PASSED_ENV`), loads the weights everywhere at once,
runs the preflight (`disagg.cluster.launch.preflight`), bootstraps one symmetric heap over every
prefill and decode actor (rank 0's unique id travels through Ray; every rank opens
concurrently) and builds the engines. Every step is one `ray.get` over all actors. Runs in the
launching process; on any failure everything started so far is torn down.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from disagg.cluster.launch.actors import InstanceActor
from disagg.cluster.launch.connect import connect
from disagg.cluster.launch.instance import Instance  # the router's view of an actor; importable from here too
from disagg.cluster.launch.preflight import (CacheSizing, check_model_source, check_same_model, size_cache,
                                             transfer_paths)
from disagg.config import SECRET_FIELDS, SMOLLM2_SOURCE, Config, InstancesSection
from disagg.errors import ClusterError, PreflightError

logger = logging.getLogger(__name__)

# Every GPU process keeps NVLink multicast off (docs/ARCHITECTURE.md §8).
NO_MULTICAST_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Said once per launch when instances share a GPU (instances.gpus_per_instance < 1).
SHARED_GPU_NOTE = ("%d instances share each GPU (instances.gpus_per_instance): NVSHMEM runs their PEs in its "
                   "limited multi-process mode and the GPU time-slices between them, so this fleet proves "
                   "correctness; its timings are not a comparison of deployments")
# Appended to "too few GPUs" when there are none at all: what runs without one.
NO_GPU_HINT = ("; with no GPU, run a CPU config (configs/tiny-1p1d.yaml, configs/tiny-colocated.yaml; "
               "configs/smollm2-*.yaml take the CPU when they see no GPU), or this one on the CPU (small "
               "models run there): --set instances.device=cpu --set transfer.backend=auto")
# Variables of the launching process that the actors inherit when set.
PASSED_ENV = ("TRITON_INTERPRET", "DISAGG_LOG", "DISAGG_TRACE_DIR", "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_DEBUG",
              "HF_HOME")
# The class of every instance actor, wrapped with `ray.remote` at each launch. A subclass (another
# `engine_module` or `step_loop_class`, more methods) may stand in for it: set this before the
# launch; the class travels to the actors pickled, so it must be importable there or pickled by value.
ACTOR_CLASS: type[InstanceActor] = InstanceActor


@dataclass
class Fleet:
    """Everything `start_fleet` started; `stop` releases it."""

    config: Config
    device: str
    backend: str | None
    instances: list[Instance]
    sizing: CacheSizing
    paths: dict[tuple[int, int], str]
    placement_group: Any
    started_ray: bool

    def of_role(self, role: str) -> list[Instance]:
        return [inst for inst in self.instances if inst.role == role]

    def stop(self) -> None:
        """Close heaps, kill the actors, free the placement group; shut Ray down if we started it."""
        stop_actors(self.instances, self.placement_group, self.started_ray)


def resolve_source(config: Config) -> Config:
    """``model.source: smollm2`` -> the cached HF conversion (built once, here, not per actor)."""
    if config.model.source != SMOLLM2_SOURCE:
        return config
    from disagg.model.smollm2 import ensure_smollm2

    return config.override({"model.source": str(ensure_smollm2())})


def actor_config(config: Config) -> dict:
    """``config`` as the dict each actor is built from, without its secrets (`SECRET_FIELDS`)."""
    return config.model_dump(exclude=SECRET_FIELDS)


def choose_device(config: Config) -> str:
    """``instances.device`` with auto resolved against the Ray cluster's GPUs (`resolve_device`)."""
    device = resolve_device(config.instances, float(ray.cluster_resources().get("GPU", 0)))
    if device == "cuda" and config.instances.instances_per_gpu > 1:
        logger.warning(SHARED_GPU_NOTE, config.instances.instances_per_gpu)
    return device


def resolve_device(inst: InstancesSection, num_gpus: float, where: str = "the Ray cluster") -> str:
    """"cuda" or "cpu" for ``inst`` on a cluster of ``num_gpus`` GPUs.

    Instances need ``num_instances * gpus_per_instance`` GPUs: one each, or 1/k each when k
    share a GPU. auto takes the GPUs when there are enough, else the CPU.

    Args:
        where: what has the ``num_gpus``, as the error names it.

    Raises:
        PreflightError: ``device: cuda`` and too few GPUs (the message says how to share one, or,
            with none, what runs on the CPU).
    """
    needed = inst.num_instances * inst.gpus_per_instance
    enough = num_gpus + 1e-9 >= needed
    if inst.device == "cuda" and not enough:
        share = "" if inst.instances_per_gpu == 1 else f" at {inst.gpus_per_instance:g} GPU each"
        hint = f"; set instances.gpus_per_instance: {1 / inst.num_instances:g} to share one GPU" \
            if num_gpus >= 1 and inst.num_instances > 1 else NO_GPU_HINT if num_gpus < 1 else ""
        raise PreflightError(f"instances.device is cuda: {inst.num_instances} instances{share} need {needed:g} "
                             f"GPUs, {where} has {num_gpus:g}{hint}")
    if inst.device == "auto":
        device = "cuda" if enough and num_gpus > 0 else "cpu"
        logger.info("instances.device auto -> %s (%g GPUs for %d instances at %g GPU each)", device, num_gpus,
                    inst.num_instances, inst.gpus_per_instance)
        return device
    return inst.device


def check_local_gpus(config: Config) -> None:
    """Before Ray starts: an embedded head (``cluster.address: null``) has this host's GPUs alone,
    so ``instances.device: cuda`` with too few of them fails here rather than after Ray's start-up.

    Raises:
        PreflightError: as `resolve_device`.
    """
    if config.instances.device == "cuda" and config.cluster.address is None:
        resolve_device(config.instances, count_local_gpus(),
                       where="this host (cluster.address: null starts Ray here)")


def count_local_gpus() -> int:
    """The GPUs this process sees (after CUDA_VISIBLE_DEVICES), as an embedded Ray head counts them."""
    import torch

    return torch.cuda.device_count()


def start_fleet(config: Config) -> Fleet:
    """Start, load, check and bootstrap every instance of ``config``; see the module docstring.

    Args:
        config: the validated config.

    Raises:
        PreflightError: a check failed (geometry, memory, devices); the message says which.
        ClusterError: placement, loading or the heap bootstrap failed or timed out.
    """
    config = resolve_source(config).with_environment()  # DISAGG_* switches, read once, travel with it
    check_model_source(config)  # what this host can check fails in a moment, not after Ray's start-up
    check_local_gpus(config)
    started_ray = connect(config)
    instances, group = [], None
    try:
        device = choose_device(config)
        group, instances = _place(config, device)
        timeout_s = config.cluster.startup_timeout_s
        names = [inst.name for inst in instances]
        infos = _get([inst.actor.load.remote(device) for inst in instances], timeout_s, "loading the weights")
        for inst, info in zip(instances, infos):
            inst.info = info
        check_same_model(names, infos)
        sizing = size_cache(config, names, infos)
        backend, paths = None, {}
        if config.mode == "disaggregated":
            backend = _choose_backend(config, device)
            paths = _open_heap(config, instances, backend, sizing, timeout_s)
        _get([inst.actor.build_engine.remote(sizing.num_pages) for inst in instances], timeout_s,
             "building the engines")
    except BaseException:
        stop_actors(instances, group, started_ray)
        raise
    logger.info("fleet up: %s on %s, backend %s", ", ".join(names), device, backend)
    return Fleet(config, device, backend, instances, sizing, paths, group, started_ray)


def _place(config: Config, device: str) -> tuple[Any, list[Instance]]:
    """One placement-group bundle and one actor (of `ACTOR_CLASS`) per instance."""
    inst_cfg = config.instances
    roles = ([("prefill", i) for i in range(inst_cfg.prefill)] + [("decode", i) for i in range(inst_cfg.decode)]
             + [("colocated", i) for i in range(inst_cfg.colocated)])
    gpus = inst_cfg.gpus_per_instance if device == "cuda" else 0
    bundle = {"CPU": inst_cfg.cpus_per_instance, **({"GPU": gpus} if gpus else {})}
    group = placement_group([dict(bundle) for _ in roles], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=config.cluster.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ClusterError(f"the Ray cluster cannot place {len(roles)} instances of {bundle} within "
                           f"{config.cluster.startup_timeout_s:.0f} s (resources: {ray.cluster_resources()})") from None
    env = {**NO_MULTICAST_ENV, **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}}
    remote = ray.remote(ACTOR_CLASS)
    instances = []
    for index, (role, i) in enumerate(roles):
        name = f"{role}-{i}"
        actor = remote.options(
            num_cpus=inst_cfg.cpus_per_instance, num_gpus=gpus,
            max_concurrency=64, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote(role, name, actor_config(config))
        instances.append(Instance(name=name, role=role, actor=actor))
    return group, instances


def _choose_backend(config: Config, device: str) -> str:
    backend = config.transfer.backend
    if backend == "auto":
        return "nvshmem" if device == "cuda" else "shm"
    if (backend == "nvshmem") != (device == "cuda"):
        raise PreflightError(f"transfer.backend {backend} does not run on {device} instances "
                             "(nvshmem needs GPUs, shm the CPU)")
    return backend


def _open_heap(config: Config, instances: list[Instance], backend: str, sizing: CacheSizing,
               timeout_s: float) -> dict[tuple[int, int], str]:
    """Bootstrap one heap over every prefill and decode instance; return each pair's transfer path."""
    heap_bytes = sizing.num_pages * sizing.page_bytes + config.transfer.heap_headroom_bytes
    uid = _get([instances[0].actor.new_uid.remote(backend, heap_bytes)], timeout_s, "making the heap id")[0]
    world = len(instances)
    opened = _get([inst.actor.open_heap.remote(backend, uid, pe, world, heap_bytes,
                                               config.transfer.bootstrap_timeout_s)
                   for pe, inst in enumerate(instances)], timeout_s, f"bootstrapping the {backend} heap")
    for pe, inst in enumerate(instances):
        inst.pe = pe
    prefill = [inst.pe for inst in instances if inst.role == "prefill"]
    decode = [inst.pe for inst in instances if inst.role == "decode"]
    reachable = {got["rank"]: got["reachable"] for got in opened}
    return transfer_paths(prefill, decode, reachable, config.transfer.force_segment_puts)


def _get(refs: list, timeout_s: float, what: str) -> list:
    """One ray.get over every actor's call; errors name the step and the instance's error."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(f"{what} did not finish within {timeout_s:.0f} s "
                           "(cluster.startup_timeout_s)") from None
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if getattr(err, "cause", None) is not None else err
        kind = PreflightError if isinstance(cause, (ValueError, PreflightError)) else ClusterError
        raise kind(f"{what} failed: {type(cause).__name__}: {cause}") from err
    except ray.exceptions.RayActorError as err:
        raise ClusterError(f"{what} failed: an instance actor died: {err}") from err


def stop_actors(instances: list[Instance], group: Any, started_ray: bool) -> None:
    """Best-effort teardown: close heaps (collective), kill actors, free the group, stop Ray."""
    live = [inst for inst in instances if inst.alive]
    if live and all(inst.pe is not None for inst in live) and len(live) == len(instances):
        try:
            ray.get([inst.actor.close.remote() for inst in live], timeout=30)
        except Exception as err:  # dying actors: kill them below anyway
            logger.info("closing the heap failed on some instance: %s", err)
    for inst in instances:
        ray.kill(inst.actor, no_restart=True)
    if group is not None:
        remove_placement_group(group)
    if started_ray:
        ray.shutdown()
