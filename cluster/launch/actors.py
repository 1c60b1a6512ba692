"""One Ray actor per instance: owns one engine (prefill, decode or colocated) and its step loop.

The actor is an async Ray actor; every method hands its work to the `StepLoop` thread that owns
the model, the heap and the engine, and awaits it, so calls from the router never run
concurrently with a step. Outputs leave in batches: the router keeps one `next_outputs` call
outstanding per actor, which returns everything produced since the previous call (or waits up to
``wait_s`` for something). Set-up methods (`identity` and `join_group` for a tensor-parallel
instance, then `load`, `new_uid`, `open_heap`, `build_engine`) are called by
`disagg.cluster.launch.bootstrap` in that order.

A tensor-parallel instance is one actor per rank, each with its own GPU (or share of one), its own
PE of the heap and its own replica of the engine. The router calls rank 0 only; every call that
changes the engine goes through `StepLoop.call_engine`, which hands it to the other ranks' loops
too (`disagg.cluster.launch.step_loop`); the other ranks' actors are called only while the fleet
is set up and torn down. A subclass may replace the engine module or
the step loop through the class attributes `engine_module` and `step_loop_class`, and add methods
(`disagg.cluster.launch.bootstrap.ACTOR_CLASS` names the class the launcher starts). Runs in the actor's
own process.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from typing import Any

from disagg import trace
from disagg.cluster.launch.step_loop import EngineCall, StepLoop
from disagg.cluster.messages import OutputBatch
from disagg.config import Config
from disagg.engine.request import PushState

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_MODULE = "disagg.cluster.launch.engines"


class InstanceActor:
    """One instance of the fleet (wrapped with `ray.remote` by the launcher).

    Args:
        role: "prefill", "decode" or "colocated".
        name: the instance's name ("prefill-0"), for logs and errors.
        config: the validated config as a dict (model.source already resolved to a path).
        rank: this actor's rank in its tensor-parallel instance (0: the leader, which the router
            calls).

    Attributes:
        engine_module: the name of the module providing `load`, `describe`, `make_engine`,
            `tokenizer_of` and optionally `warm_up` (`disagg.cluster.launch.engines`); imported in the
            actor's process.
        step_loop_class: the `StepLoop` (or a subclass) that runs the engine.
    """

    engine_module: str = DEFAULT_ENGINE_MODULE
    step_loop_class: type[StepLoop] = StepLoop

    def __init__(self, role: str, name: str, config: dict, rank: int = 0) -> None:
        logging.basicConfig(level=os.environ.get("DISAGG_LOG", "WARNING"))
        self.role, self.name, self.rank = role, name, rank
        self.tp: Any = None  # the instance's TPGroup once joined (`join_group`); None: one rank
        self.config = Config.model_validate(config)
        self.engines = importlib.import_module(self.engine_module)
        self.model: Any = None
        self.heap: Any = None
        self.num_pages: int | None = None
        self.warmup_s: dict = {}  # the engine warm-up's seconds per phase (cluster.warmup)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self.loop = self.step_loop_class(name if rank == 0 else f"{name}.rank{rank}", on_output=self._wake)

    # ------------------------------------------------------------------ plumbing
    async def _run(self, fn, *args, **kwargs) -> Any:
        """Run ``fn`` on the step-loop thread and return its result (exceptions re-raised here)."""
        self._bind_event_loop()
        return await asyncio.wrap_future(self.loop.call(fn, *args, **kwargs))

    async def _engine(self, method: str, *args: Any, then=None, mid_step: bool = False, **kwargs: Any) -> Any:
        """``engine.<method>(*args, **kwargs)`` on every rank's loop (`StepLoop.call_engine`); this
        rank's result (or ``then(result)``, run right after it here)."""
        self._bind_event_loop()
        call = EngineCall(method, args, kwargs)
        return await asyncio.wrap_future(self.loop.call_engine(call, then=then, mid_step=mid_step))

    def _bind_event_loop(self) -> None:
        if self._event_loop is None:
            self._event_loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()

    def _wake(self) -> None:
        """Called on the step-loop thread after a step produced outputs."""
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._wakeup.set)

    # ------------------------------------------------------------------ set-up
    async def identity(self, device: str) -> dict:
        """Where this actor runs: {"host", "gpu" (the CUDA device's UUID, None on the CPU), "pid"}
        (the launcher picks the tensor-parallel backend from the ranks' GPUs)."""
        def _identity() -> dict:
            from disagg.parallel import local_address
            gpu = None
            if device == "cuda":
                import torch
                gpu = str(torch.cuda.get_device_properties(0).uuid)
            return {"address": local_address(), "gpu": gpu, "pid": os.getpid()}
        return await self._run(_identity)

    async def join_group(self, address: str, size: int, backend: str, timeout_s: float,
                         ranks: list | None = None) -> None:
        """Join this instance's tensor-parallel group as rank ``self.rank`` of ``size`` (every rank
        at once; rank 0 listens at ``address``). ``ranks``: rank 0 only, every rank's actor handle
        (rank 0 first), asked which are gone when a collective fails."""
        if ranks is not None:
            self.loop.diagnose = lambda: _gone_ranks(self.name, ranks)

        def _join() -> None:
            from disagg.parallel import init_tensor_parallel
            if backend == "nccl":
                import torch
                torch.cuda.set_device(0)  # Ray shows each actor exactly its own GPU
            self.tp = init_tensor_parallel(address, self.rank, size, backend, timeout_s)
        await self._run(_join)

    async def load(self, device: str) -> dict:
        """Load the weights (this rank's shard) on ``device``; return `engines.describe` plus the
        process's identity."""
        def _load() -> dict:
            self.model = self.engines.load(self.config, device, tp=self.tp)
            info = self.engines.describe(self.model, self.config, device)
            info.update(pid=os.getpid(), cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                        rank=self.rank)
            return info
        return await self._run(_load)

    async def new_uid(self, backend: str, heap_bytes: int) -> bytes:
        """Rank 0 only: the bootstrap id of the symmetric heap (sizes NVSHMEM's heap too)."""
        from disagg.transfer import new_unique_id
        return await self._run(new_unique_id, backend, size_bytes=heap_bytes)

    async def open_heap(self, backend: str, uid: bytes, rank: int, world_size: int, heap_bytes: int,
                        timeout_s: float) -> dict:
        """Join the symmetric heap as PE ``rank`` (collective: every PE at once).

        Returns:
            {"rank": this PE, "reachable": {pe: True when this PE can store into pe's memory
            directly, False when pushes to it take the segment-put path}}
        """
        def _open() -> dict:
            import torch

            from disagg.transfer import open_heap
            device = "cuda:0" if backend == "nvshmem" else None
            self.heap = open_heap(backend, uid=uid, rank=rank, world_size=world_size,
                                  size_bytes=heap_bytes, device=device, timeout_s=timeout_s)
            probe = self.heap.alloc((256,), torch.uint8)  # collective; every PE probes every peer
            reachable = {pe: self.heap.peer(probe, pe) is not None for pe in range(world_size)}
            return {"rank": self.heap.rank, "reachable": reachable}
        return await self._run(_open)

    async def build_engine(self, num_pages: int) -> dict:
        """Build the engine over ``num_pages`` pages (collective with the heap); return its stats."""
        def _build() -> dict:
            engine = self.engines.make_engine(self.role, self.model, self.heap, num_pages, self.config)
            warm_up = getattr(self.engines, "warm_up", None)  # optional in an engine module
            if self.config.cluster.warmup and warm_up is not None:
                self.warmup_s = warm_up(engine, self.role, self.config)
                logger.info("%s: warm-up %s", self.name, {k: round(v, 3) for k, v in self.warmup_s.items()})
            tensor_parallel = self.tp is not None and self.tp.size > 1
            if self.role == "decode" and self.config.scheduler.overlap_reservations and not tensor_parallel:
                engine.on_gpu_wait = self.loop.while_gpu_runs  # (the ranks run every call between steps)
            self.loop.engine = engine
            self.num_pages = num_pages
            if tensor_parallel and self.rank:
                self.loop.follow(self.tp)  # from now on this rank runs the leader's passes
            elif tensor_parallel:
                self.loop.group = self.tp
            return dict(engine.stats())
        return await self._run(_build)

    # ------------------------------------------------------------------ requests
    async def add(self, request_id: Any, prompt_token_ids: list[int], params: Any, dest: Any = None) -> None:
        """Queue a request: prefill (with the decode side's ``dest``) or colocated (no dest)."""
        trace.event("actor_add", request_id)

        args = (request_id, prompt_token_ids, params) + ((dest,) if self.role == "prefill" else ())
        await self._engine("add", *args, then=lambda _: trace.event("engine_add", request_id))

    async def reserve(self, request_id: Any, prompt_len: int, params: Any,
                      prompt_token_ids: list[int] | None = None) -> Any:
        """Decode: reserve pages for the prompt's KV past this instance's cached prefix of
        ``prompt_token_ids`` (when given); return the `RecvDest` (raises OutOfPages)."""
        return await self._engine("reserve", request_id, prompt_len, params, prompt_token_ids=prompt_token_ids,
                                  mid_step=True)

    async def start(self, request_id: Any, first_token_id: int) -> None:
        """Decode: the prefill side produced ``first_token_id``; decode once the KV has landed."""
        await self._engine("start", request_id, first_token_id)

    async def abort(self, request_id: Any) -> Any:
        """Drop a request wherever it is (pages freed, or quarantined while KV may be in flight).

        Returns:
            Decode, colocated: whether the engine had the request. Prefill: None when the engine
            does not have it (never got it, or its prompt completed: the doorbell ends the decode
            side's lease), else `PushState.QUIESCED` once no push of it can land anymore; an
            abort whose pushes are in flight answers when the engine reports them complete.
        """
        if self.role != "prefill":
            return await self._engine("abort", request_id)
        def _watch(state: Any) -> tuple[Any, Any]:
            return state, self.loop.watch_end(request_id) if state is PushState.IN_FLIGHT else None
        state, quiesced = await self._engine("abort", request_id, then=_watch)
        if quiesced is not None:
            await asyncio.wrap_future(quiesced)  # the engine's abort output: the pushes completed
            state = PushState.QUIESCED
        return state

    async def cancel_reservation(self, dest: Any) -> None:
        """Decode: free a reservation at once; the caller vouches that no sender will write it."""
        await self._engine("cancel_reservation", dest)

    async def next_outputs(self, wait_s: float) -> OutputBatch:
        """Every output since the previous call, waiting up to ``wait_s`` seconds for one, with
        the step samples since then and the load after the last step (`disagg.cluster.messages`)."""
        self._bind_event_loop()
        self._wakeup.clear()
        rows, steps = self.loop.drain()
        if not rows and self.loop.fatal is None:
            try:
                await asyncio.wait_for(self._wakeup.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
            more_rows, more_steps = self.loop.drain()
            rows, steps = rows + more_rows, steps + more_steps
        return OutputBatch(rows, self.loop.fatal, steps, self.loop.load)

    async def stats(self) -> dict:
        """The engine's stats plus this instance's name, role and PE."""
        def _stats() -> dict:
            out = dict(self.loop.engine.stats()) if self.loop.engine is not None else {}
            out.update(name=self.name, role=self.role, pe=None if self.heap is None else self.heap.rank,
                       rank=self.rank, tensor_parallel=1 if self.tp is None else self.tp.size,
                       num_steps=self.loop.num_steps, busy_s=self.loop.busy_s, fatal=self.loop.fatal,
                       warmup_s=dict(self.warmup_s), num_mid_step_calls=self.loop.num_mid_step_calls,
                       overlaps_reservations=getattr(self.loop.engine, "on_gpu_wait", None) is not None)
            return out
        return await self._run(_stats)

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefixes between two steps; the pages freed."""
        return await self._engine("reset_prefix_cache")

    async def rank_pages(self) -> dict:
        """This rank's free and total pages, read off its engine without waiting for its loop (a
        follower's loop runs the leader's passes only): a snapshot for tests and `disagg check`
        once the instance is idle."""
        engine = self.loop.engine
        if engine is None:
            return {"rank": self.rank, "free_pages": None, "total_pages": None}
        return {"rank": self.rank, "free_pages": engine.cache.num_free_pages, "total_pages": engine.cache.num_pages}

    async def ping(self) -> int:
        """This actor's pid (alive); the leader asks its ranks when a collective failed."""
        return os.getpid()

    async def tokenizer(self) -> Any:
        """The model's tokenizer (pickled to the caller), or None."""
        return self.engines.tokenizer_of(self.model)

    # ------------------------------------------------------------------ lifetime
    async def close(self) -> None:
        """Release the engine and the heap (collective on every PE of the heap)."""
        def _close() -> None:
            self.loop.release_followers()  # they run their own close (the heap's collective) next
            self.loop.engine = None
            if self.heap is not None:
                self.heap.close()
                self.heap = None
        await self._run(_close)
        self.loop.stop()


def _gone_ranks(name: str, ranks: list, timeout_s: float = 5.0) -> str | None:
    """Which of ``ranks`` (actor handles, rank 0 first) do not answer a ping: the line a failed
    collective's error ends with, naming the instance and the ranks (None: all answer)."""
    import ray

    pings = {rank: actor.ping.remote() for rank, actor in enumerate(ranks) if rank}
    ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
    gone = []
    for rank, ref in pings.items():
        try:
            if ref not in ready:
                raise TimeoutError
            ray.get(ref)
        except Exception:
            gone.append(rank)
    if not gone:
        return None
    return f"tensor-parallel instance {name}: rank(s) {gone} of {len(ranks)} are gone (actor dead or not answering)"
