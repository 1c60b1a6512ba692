"""From a validated config to a running, checked fleet of instance actors.

`start_fleet(config)` first checks what needs no Ray (the model source, and the GPUs of this
host when Ray is to start here: `check_model_source`, `check_local_gpus`), then connects to Ray
(`disagg.cluster.launch.connect`: joins ``cluster.address`` or starts an embedded head on loopback,
token authentication on), reserves one placement group bundle per rank (an instance has
``instances.tensor_parallel`` ranks; one GPU each, a share 1/k of one with
``instances.gpus_per_instance``, or CPU), starts one actor of `ACTOR_CLASS` per rank (its config
without secrets: `SECRET_FIELDS`; its environment: `NO_MULTICAST_ENV` and the launcher's
`PASSED_ENV`), joins each tensor-parallel instance's ranks into one process group (rank 0's
address travels through Ray; NCCL when its ranks have a GPU each, gloo otherwise), loads the
weights everywhere at once (each rank its shard), runs the preflight
(`disagg.cluster.launch.preflight`), bootstraps one symmetric heap over every rank of every
prefill and decode instance (PE 0's unique id travels through Ray; every PE opens concurrently)
and builds the engines. Every step is one `ray.get` over all actors. Runs in the
launching process; on any failure everything started so far is torn down. A rebuild
(`disagg.cluster.routing.rebuild`) kills a fleet without closing its heap (`Fleet.kill`), starts
its config afresh with the same actors' class and environment, and `Fleet.adopt`s the new one.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from disagg.cluster.launch.actors import InstanceActor
from disagg.cluster.launch.connect import connect
from disagg.cluster.launch.instance import Instance, Rank  # the router's view of an actor; importable from here too
from disagg.cluster.launch.preflight import (CacheSizing, check_model_source, check_same_model, size_cache,
                                             transfer_paths)
from disagg.config import SECRET_FIELDS, SMOLLM2_SOURCE, Config, InstancesSection
from disagg.errors import ClusterError, PreflightError

logger = logging.getLogger(__name__)

# Every GPU process keeps NVLink multicast off (docs/ARCHITECTURE.md §8).
NO_MULTICAST_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Said once per launch when instances share a GPU (instances.gpus_per_instance < 1).
SHARED_GPU_NOTE = ("%d ranks share each GPU (instances.gpus_per_instance): NVSHMEM runs their PEs in its "
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
    actor_class: type = InstanceActor  # what a replacement starts (`start_replacement`), and
    env: dict[str, str] | None = None  # in which environment (the launch's: `actor_env`)

    def of_role(self, role: str) -> list[Instance]:
        return [inst for inst in self.instances if inst.role == role]

    def stop(self) -> None:
        """Close heaps, kill the actors, free the placement group; shut Ray down if we started it."""
        stop_actors(self.instances, self.placement_group, self.started_ray)

    def kill(self) -> None:
        """Kill every actor (replacements included) and free the placement group, closing no heap:
        once a PE died, NVSHMEM's finalize on a survivor does not return. Ray stays up; the fleet
        keeps its config and its instances (dead) until `adopt` (a rebuild)."""
        for inst in self.instances:
            inst.alive = False
            for actor in inst.actors:
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    def adopt(self, new: Fleet) -> None:
        """Become ``new`` (a fresh fleet of the same config, `start_fleet`) in place: its instances,
        heap, paths and placement group; whoever holds this fleet (the router, its placer, the
        `Cluster`) sees the new instances. Ray stays owned as before (``started_ray``)."""
        self.instances[:] = new.instances  # the same list: the placer's list is the fleet's
        self.device, self.backend, self.sizing, self.paths = new.device, new.backend, new.sizing, new.paths
        self.placement_group = new.placement_group


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
    if device == "cuda" and config.instances.ranks_per_gpu > 1:
        logger.warning(SHARED_GPU_NOTE, config.instances.ranks_per_gpu)
    return device


def resolve_device(inst: InstancesSection, num_gpus: float, where: str = "the Ray cluster") -> str:
    """"cuda" or "cpu" for ``inst`` on a cluster of ``num_gpus`` GPUs.

    Instances need ``num_ranks * gpus_per_instance`` GPUs: one per rank (an instance has
    ``tensor_parallel`` ranks), or 1/k each when k share a GPU. auto takes the GPUs when there
    are enough, else the CPU.

    Args:
        where: what has the ``num_gpus``, as the error names it.

    Raises:
        PreflightError: ``device: cuda`` and too few GPUs (the message says how to share one, or,
            with none, what runs on the CPU).
    """
    needed = inst.num_ranks * inst.gpus_per_instance
    enough = num_gpus + 1e-9 >= needed
    if inst.device == "cuda" and not enough:
        share = "" if inst.ranks_per_gpu == 1 else f" at {inst.gpus_per_instance:g} GPU each"
        what = f"{inst.num_instances} instances" + (
            f" ({inst.num_ranks} tensor-parallel ranks)" if inst.num_ranks != inst.num_instances else "")
        per_gpu = -(-inst.num_ranks // max(1, int(num_gpus)))  # the smallest share that fits
        hint = (f"; set instances.gpus_per_instance: {1 / per_gpu:g} to put {per_gpu} ranks on each GPU"
                if num_gpus >= 1 and inst.num_ranks > 1 else NO_GPU_HINT if num_gpus < 1 else "")
        raise PreflightError(f"instances.device is cuda: {what}{share} need {needed:g} "
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


def start_fleet(config: Config, actor_class: type | None = None, env: dict[str, str] | None = None) -> Fleet:
    """Start, load, check and bootstrap every instance of ``config``; see the module docstring.

    Args:
        config: the validated config.
        actor_class: the actors' class (default `ACTOR_CLASS`; a rebuild passes its fleet's).
        env: the actors' environment (default `actor_env`; a rebuild passes its fleet's).

    Raises:
        PreflightError: a check failed (geometry, memory, devices); the message says which.
        ClusterError: placement, loading or the heap bootstrap failed or timed out.
    """
    config = resolve_source(config).with_environment()  # DISAGG_* switches, read once, travel with it
    actor_class = ACTOR_CLASS if actor_class is None else actor_class
    env = actor_env() if env is None else env
    check_model_source(config)  # what this host can check fails in a moment, not after Ray's start-up
    check_local_gpus(config)
    started_ray = connect(config)
    instances, group = [], None
    try:
        device = choose_device(config)
        group, instances = _place(config, device, actor_class, env)
        timeout_s = config.cluster.startup_timeout_s
        _join_groups(instances, device, timeout_s)
        names = [inst.name if r == 0 else f"{inst.name} rank {r}" for inst in instances
                 for r in range(len(inst.actors))]
        actors = [actor for inst in instances for actor in inst.actors]
        infos = _get([actor.load.remote(device) for actor in actors], timeout_s, "loading the weights")
        by_actor = dict(zip(map(id, actors), infos))
        for inst in instances:
            inst.info = by_actor[id(inst.actor)]
            for rank in inst.ranks:
                rank.device = by_actor[id(rank.actor)].get("device")
        check_same_model(names, infos)
        sizing = size_cache(config, names, infos)
        backend, paths = None, {}
        if config.mode == "disaggregated":
            backend = _choose_backend(config, device)
            paths = _open_heap(config, instances, backend, sizing, timeout_s)
        _get([actor.build_engine.remote(sizing.num_pages) for actor in actors], timeout_s,
             "building the engines")
    except BaseException:
        stop_actors(instances, group, started_ray)
        raise
    logger.info("fleet up: %s on %s, backend %s", ", ".join(inst.name for inst in instances), device, backend)
    return Fleet(config, device, backend, instances, sizing, paths, group, started_ray, actor_class, env)


def actor_env() -> dict[str, str]:
    """Every actor's environment: `NO_MULTICAST_ENV` and this process's `PASSED_ENV` now."""
    return {**NO_MULTICAST_ENV, **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}}


def start_replacement(fleet: Fleet, dead: Instance, name: str) -> Instance:
    """Start, load and build an instance ``name`` in ``dead``'s place: as many ranks, in its
    placement-group bundles (its GPU or share of one), joined as ``dead``'s were, with the
    fleet's pages. It is no PE of the heap (NVSHMEM's membership is fixed once the heap is
    made), so it runs a colocated engine: it computes and decodes its own requests, role
    "colocated". Blocking; any rank of ``dead`` still running is killed first. Runs in the
    launching process, off the router's loop.

    Raises:
        ClusterError / PreflightError: a step failed or timed out (what it started is killed).
    """
    for actor in dead.actors:
        ray.kill(actor, no_restart=True)  # a rank left of a dead instance holds its bundle
    config, timeout_s = fleet.config, fleet.config.cluster.startup_timeout_s
    ranks = [("colocated", name, r, index) for r, index in enumerate(dead.bundles)]
    (inst,) = _start_ranks(config, fleet.device, fleet.placement_group, fleet.actor_class, ranks, fleet.env)
    try:
        _join_groups([inst], fleet.device, timeout_s)
        infos = _get([actor.load.remote(fleet.device) for actor in inst.actors], timeout_s,
                     f"loading the weights of {name}")
        inst.info = infos[0]
        for rank, info in zip(inst.ranks, infos):
            rank.device = info.get("device")
        _get([actor.build_engine.remote(fleet.sizing.num_pages) for actor in inst.actors], timeout_s,
             f"building the engine of {name}")
    except BaseException:
        for actor in inst.actors:
            ray.kill(actor, no_restart=True)
        raise
    return inst


def _place(config: Config, device: str, actor_class: type | None = None, env: dict[str, str] | None = None
           ) -> tuple[Any, list[Instance]]:
    """One placement-group bundle and one actor (of ``actor_class``, default `ACTOR_CLASS`, in
    ``env``, default `actor_env`) per rank of every instance."""
    actor_class = ACTOR_CLASS if actor_class is None else actor_class
    inst_cfg = config.instances
    roles = ([("prefill", i) for i in range(inst_cfg.prefill)] + [("decode", i) for i in range(inst_cfg.decode)]
             + [("colocated", i) for i in range(inst_cfg.colocated)])
    # Rank-major (every instance's rank 0, then every rank 1, ...): PACK fills a GPU with
    # consecutive bundles, so ranks sharing GPUs (1/k each) put one rank of each instance per GPU,
    # and an instance's ranks land on different GPUs where there are enough (NCCL between them).
    ranks = sorted(((role, i, r) for role, i in roles for r in range(inst_cfg.tensor_parallel_of(role))),
                   key=lambda rank: rank[2])
    gpus = inst_cfg.gpus_per_instance if device == "cuda" else 0
    bundle = {"CPU": inst_cfg.cpus_per_instance, **({"GPU": gpus} if gpus else {})}
    group = placement_group([dict(bundle) for _ in ranks], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=config.cluster.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ClusterError(f"the Ray cluster cannot place {len(ranks)} ranks of {len(roles)} instances of {bundle} "
                           f"within {config.cluster.startup_timeout_s:.0f} s (resources: {ray.cluster_resources()})"
                           ) from None
    return group, _start_ranks(config, device, group, actor_class,
                               [(role, f"{role}-{i}", r, index) for index, (role, i, r) in enumerate(ranks)], env)


def _start_ranks(config: Config, device: str, group: Any, actor_class: type,
                 ranks: list[tuple[str, str, int, int]], env: dict[str, str] | None = None) -> list[Instance]:
    """One actor of ``actor_class`` per ``(role, name, rank, bundle index)`` of ``ranks`` (rank 0
    of each name first), in that bundle of ``group``, in ``env`` (default `actor_env`); the
    instances, in order."""
    inst_cfg = config.instances
    gpus = inst_cfg.gpus_per_instance if device == "cuda" else 0
    env = actor_env() if env is None else env
    remote = ray.remote(actor_class)
    sizes = collections.Counter(name for _, name, _, _ in ranks)
    instances: dict[str, Instance] = {}
    for role, name, r, index in ranks:
        actor = remote.options(
            num_cpus=inst_cfg.cpus_per_instance, num_gpus=gpus,
            max_concurrency=64, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote(role, name, actor_config(config), **({"rank": r} if r else {}))  # (rank 0: any actor class)
        if r == 0:
            instances[name] = Instance(name=name, role=role, actor=actor)
        instances[name].bundles.append(index)
        if sizes[name] > 1:
            instances[name].ranks.append(Rank(r, actor))
    return list(instances.values())


def _join_groups(instances: list[Instance], device: str, timeout_s: float) -> None:
    """Join each tensor-parallel instance's ranks into its process group: NCCL when every rank
    has a GPU of its own, gloo on the CPU and where ranks share a GPU (NCCL refuses two ranks on
    one device). Rank 0's address travels through Ray."""
    parallel = [inst for inst in instances if inst.tensor_parallel > 1]
    if not parallel:
        return
    idents = _get([actor.identity.remote(device) for inst in parallel for actor in inst.actors], timeout_s,
                  "asking the tensor-parallel ranks where they run")
    joins, at = [], 0
    for inst in parallel:
        mine, at = idents[at: at + inst.tensor_parallel], at + inst.tensor_parallel
        gpus = [ident["gpu"] for ident in mine]
        backend = "nccl" if device == "cuda" and len(set(gpus)) == len(gpus) else "gloo"
        logger.info("%s: %d tensor-parallel ranks over %s (GPUs %s)", inst.name, inst.tensor_parallel, backend, gpus)
        joins += [actor.join_group.remote(mine[0]["address"], inst.tensor_parallel, backend, timeout_s,
                                          inst.actors if index == 0 else None)
                  for index, actor in enumerate(inst.actors)]
    _get(joins, timeout_s, "joining the tensor-parallel ranks of each instance")


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
    """Bootstrap one heap over every rank of every prefill and decode instance (one PE per rank,
    in instance then rank order); return each PE pair's transfer path."""
    heap_bytes = sizing.num_pages * sizing.page_bytes + config.transfer.heap_headroom_bytes
    uid = _get([instances[0].actor.new_uid.remote(backend, heap_bytes)], timeout_s, "making the heap id")[0]
    members = [(inst, index, actor) for inst in instances for index, actor in enumerate(inst.actors)]
    world = len(members)
    opened = _get([actor.open_heap.remote(backend, uid, pe, world, heap_bytes, config.transfer.bootstrap_timeout_s)
                   for pe, (_, _, actor) in enumerate(members)], timeout_s, f"bootstrapping the {backend} heap")
    for pe, (inst, index, _) in enumerate(members):
        if index == 0:
            inst.pe = pe
        if inst.ranks:
            inst.ranks[index].pe = pe
    prefill = [pe for pe, (inst, _, _) in enumerate(members) if inst.role == "prefill"]
    decode = [pe for pe, (inst, _, _) in enumerate(members) if inst.role == "decode"]
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
            ray.get([actor.close.remote() for inst in live for actor in inst.actors], timeout=30)
        except Exception as err:  # dying actors: kill them below anyway
            logger.info("closing the heap failed on some instance: %s", err)
    for inst in instances:
        for actor in inst.actors:
            ray.kill(actor, no_restart=True)
    if group is not None:
        remove_placement_group(group)
    if started_ray:
        ray.shutdown()
