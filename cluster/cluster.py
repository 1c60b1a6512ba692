"""`Cluster`: the handle a caller (CLI, HTTP server, benchmark, test) holds on a running fleet.

`Cluster.launch(config)` starts the fleet (`disagg.cluster.launch.bootstrap`) and the router on its own
thread and event loop. `stream` is an async generator usable from any event loop or thread: the
request is submitted to the router's loop with `call_soon_threadsafe`, as aborts are, so an
abort sent after a submit reaches the router after it; its deltas come back to the caller's
loop in one call per router loop turn (`Handoff`: a batch's deltas together).
Closing the generator or cancelling its task (even before the submit ran) aborts the request.
`generate` is the blocking form for lists of prompts. Runs in the launching process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Sequence, Union

import ray

from disagg.cluster.launch.bootstrap import Fleet, Instance, start_fleet
from disagg.cluster.outputs import Completion, RequestMetrics, StreamDelta
from disagg.cluster.routing.placement.placer import seed_fit
from disagg.cluster.routing.router import Router
from disagg.config import Config
from disagg.errors import ClusterError, NoLiveInstance, PreflightError

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


class Cluster:
    """A running fleet plus its router; build with `Cluster.launch`, end with `shutdown`."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.config: Config = fleet.config
        self.tokenizer = _fetch_tokenizer(fleet)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="disagg-router", daemon=True)
        self._thread.start()
        self._router = Router(fleet)
        # per caller loop, the deltas of one router turn go over together (`Handoff`)
        self._handoffs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Handoff] = weakref.WeakKeyDictionary()
        self._handoffs_lock = threading.Lock()
        self._call(self._router.start())
        self._closed = False
        if self.config.cluster.warmup:
            try:
                self._warm_up()
            except BaseException:
                self.shutdown()
                raise

    @classmethod
    def launch(cls, config: Config | str | Path) -> Cluster:
        """Start the fleet of ``config`` (a `Config` or a YAML path) and its router.

        Args:
            config: the deployment.

        Raises:
            ConfigError: the YAML is invalid, or router.step_profile is not a readable profile.
            PreflightError / ClusterError: see `start_fleet`.
        """
        if not isinstance(config, Config):
            config = Config.from_yaml(config)
        seed_fit(config.router.step_profile)  # a bad router.step_profile fails before any actor starts
        return cls(start_fleet(config))

    # ------------------------------------------------------------------ properties
    @property
    def model_name(self) -> str:
        return self.fleet.instances[0].info.get("model_name", self.config.model.source)

    @property
    def max_model_len(self) -> int:
        return self.fleet.sizing.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self.fleet.instances[0].info.get("vocab_size")

    @property
    def healthy(self) -> bool:
        """True while the cluster can serve: the router runs and some instance lives, or the
        fleet is being rebuilt (`rebuild_phase`: requests wait in the router's queue for it).

        Any one instance serves: a prefill + decode fleet that lost a whole role puts every
        request on the survivors (`degraded_path`: local on decode instances, kept on prefill
        ones). A fleet that lost instances is degraded (`degraded` names them), not unhealthy.
        """
        return not self._closed and (any(inst.alive for inst in self.fleet.instances)
                                     or self.rebuild_phase is not None)

    @property
    def rebuild_phase(self) -> str | None:
        """None at full strength (or with `cluster.rebuild` off), else the rebuild's phase
        (`disagg.cluster.routing.rebuild`): "waiting" (the survivors serve degraded until
        `cluster.rebuild_after_s`), "draining" (new requests queue while those in flight finish),
        "restarting" (the fresh fleet starts; requests queue). No actor round trip."""
        rebuild = self._router.rebuilder
        return None if rebuild is None or self._closed else rebuild.phase

    @property
    def degraded(self) -> list[dict]:
        """The dead instances, in fleet order, each as ``{"name", "role", "why", "replaced_by"}``
        (``why``: the reason the router recorded at its death; ``replaced_by``: the name of the
        instance serving in its place, `cluster.restart`, or None); [] at full strength. A
        replaced instance stays listed: its replacement is a colocated instance outside the
        heap, so the fleet's KV transfer through it is back only once the fleet is rebuilt
        (`cluster.rebuild`, `rebuild_phase`: every old instance is listed while the fresh fleet
        starts, none once it serves). No actor round trip."""
        return [{"name": inst.name, "role": inst.role, "why": inst.error or "dead", "replaced_by": inst.replaced_by}
                for inst in self.fleet.instances if not inst.alive]

    def instance(self, name: str) -> Instance:
        """The instance named ``name`` ("prefill-0", ...): its actor handle, PE and state."""
        for inst in self.fleet.instances:
            if inst.name == name:
                return inst
        raise KeyError(f"no instance {name!r}; have {[inst.name for inst in self.fleet.instances]}")

    def _warm_up(self) -> None:
        """Short requests through the router, one per instance, before the first real one.

        The kernels compile here rather than inside the first caller's TTFT, and every instance
        (each prefill -> decode push included) has served a request end to end.

        Raises:
            PreflightError: a warm-up request failed; the message says where and why.
        """
        from disagg.sampling import SamplingParams

        num = len(self.fleet.instances)
        prompts = [[3 + (i + j) % 60 for j in range(8 + 5 * i)] for i in range(num)]
        done = self.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True),
                             timeout_s=self.config.cluster.startup_timeout_s)
        failed = [c for c in done if c.finish_reason not in ("length", "stop")]
        if failed:
            m = failed[0].metrics
            raise PreflightError(f"warm-up request on {m.prefill_instance} -> {m.decode_instance} failed: "
                                 f"{failed[0].finish_reason}: {failed[0].error}")
        self._call(_async(self._router.clear_counts))

    # ------------------------------------------------------------------ requests
    async def stream(self, prompt: Prompt, params: Any = None, request_id: str | None = None
                     ) -> AsyncIterator[StreamDelta]:
        """Submit one request and yield its deltas as the actors produce them (the last one
        carries the request's `RequestMetrics`).

        Args:
            prompt: text (needs a tokenizer) or token ids.
            params: a `disagg.sampling.SamplingParams` (default: its defaults).
            request_id: unique among live requests; default: a fresh uuid.

        Raises:
            ValueError: a bad prompt, id or length (before anything is queued).
            NoLiveInstance: the cluster is shut down. QueueFull: the router's queue is full.
        """
        handoff = self._handoff_to(asyncio.get_running_loop())
        deltas: asyncio.Queue[StreamDelta] = asyncio.Queue()

        def sink(delta: StreamDelta, metrics: RequestMetrics | None) -> None:
            if metrics is not None:
                delta = dataclasses.replace(delta, metrics=metrics)
            handoff.put(deltas, delta)

        request_id, _, submitted = self._submit(prompt, params, request_id, sink)
        finished = False
        try:
            await asyncio.wrap_future(submitted)  # cancelled here: the submit is dropped or aborted
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished and _may_have_run(submitted):
                self.abort(request_id)

    def _handoff_to(self, caller_loop: asyncio.AbstractEventLoop) -> Handoff:
        """The one `Handoff` from the router's loop to ``caller_loop`` (made on first use)."""
        with self._handoffs_lock:
            handoff = self._handoffs.get(caller_loop)
            if handoff is None:
                handoff = self._handoffs[caller_loop] = Handoff(self._loop, caller_loop)
            return handoff

    def generate(self, prompts: Sequence[Prompt], params: Any = None,
                 timeout_s: float | None = None) -> list[Completion]:
        """Run ``prompts`` concurrently and wait for every completion (never call from the router loop).

        Args:
            prompts: texts or token-id lists.
            params: one `SamplingParams` for all, or one per prompt.
            timeout_s: how long to wait in all; default: router.request_timeout_s plus a margin.
        """
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: expected one per prompt ({len(prompts)}), got {len(per_prompt)}")
        collectors = [_Collector() for _ in prompts]
        try:
            for prompt, param, collector in zip(prompts, per_prompt, collectors):
                request_id, collector.prompt_token_ids, submitted = self._submit(prompt, param, None, collector.sink)
                submitted.result()
                collector.request_id = request_id  # only ids the router took are aborted below
        except BaseException:  # a bad prompt: the ones already submitted are not left running
            for collector in collectors:
                if collector.request_id:
                    self.abort(collector.request_id)
            raise
        limit = timeout_s if timeout_s is not None else (self.config.router.request_timeout_s or 86400) + 30
        deadline = time.monotonic() + limit
        for collector in collectors:
            if not collector.done.wait(max(0.0, deadline - time.monotonic())):
                raise ClusterError(f"generate: request {collector.request_id} did not finish within {limit} s")
        return [c.completion(self.tokenizer) for c in collectors]

    def abort(self, request_id: str) -> None:
        """Abort a request; its pages are released on both sides.

        Sent after `stream` began (or `generate` returned its id), it reaches the router after
        the submit. One that reaches the router before any submit with that id is remembered,
        and the first such submit ends at once as aborted; one for an id that has just ended
        does nothing (`Router.abort` says how long each is remembered).
        """
        if not self._closed:
            self._loop.call_soon_threadsafe(self._router.abort, request_id)

    def _submit(self, prompt: Prompt, params: Any, request_id: str | None, sink
                ) -> tuple[str, list[int], concurrent.futures.Future]:
        """Hand a request to the router's loop; the future raises what `Router.submit` raised.

        A plain callback (not a task, which would run one loop turn later), so that an `abort`
        sent after this call reaches the router after the submit. A cancelled future (the
        caller gave up before the loop got to it) submits nothing.
        """
        if self._closed:
            raise NoLiveInstance("the cluster is shut down")
        token_ids = self._encode(prompt)
        params = params if params is not None else _default_params()
        request_id = request_id or uuid.uuid4().hex
        submitted: concurrent.futures.Future = concurrent.futures.Future()

        def submit() -> None:
            if not submitted.set_running_or_notify_cancel():
                return
            try:
                self._router.submit(request_id, token_ids, params, sink)
            except BaseException as err:  # handed to the caller's thread
                submitted.set_exception(err)
            else:
                submitted.set_result(None)

        self._loop.call_soon_threadsafe(submit)
        return request_id, token_ids, submitted

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: text needs a tokenizer, but {self.model_name} has none; "
                                 "give token ids")
            return list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        if any(t < 0 for t in ids):
            raise ValueError(f"prompt: token ids must be >= 0, got {min(ids)}")
        return ids

    # ------------------------------------------------------------------ state
    def stats(self, timeout_s: float = 30.0) -> dict:
        """Per instance (role, pe, tensor_parallel and ranks (each rank's pe and device), free/total
        pages, running, waiting, busy_s, alive, the engine's
        counters: num_preemptions, pushed_bytes/push_s/push_gbps on prefill, doorbell_wait_s and
        num_doorbells_rung on decode) and the router's state (queue, outcomes, aborts and failures
        by reason), ``degraded``: the dead instances (`degraded`), and ``rebuild``: the rebuild's
        ``phase`` (`rebuild_phase`), the rebuilds begun and the latest one's seconds, or None
        when the fleet is not rebuilt (`cluster.rebuild`).

        One round trip to every live instance at once; an instance that does not answer within
        ``timeout_s`` (or died) is listed with ``alive: False`` and the reason.
        """
        live = [inst for inst in self.fleet.instances if inst.alive]
        refs = [inst.actor.stats.remote() for inst in live]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready = set(ready)
        answered = [(inst, ref) for inst, ref in zip(live, refs) if ref in ready]
        try:
            got = ray.get([ref for _, ref in answered])
            by_name = {inst.name: dict(stats, alive=True) for (inst, _), stats in zip(answered, got)}
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            by_name = {inst.name: _answer(inst, ref) for inst, ref in answered}  # rare: find the failed one
        for inst in live:
            by_name.setdefault(inst.name, {"name": inst.name, "role": inst.role, "pe": inst.pe, "alive": False,
                                           "error": "no answer to stats() in time"})
        instances = [by_name.get(inst.name) or {"name": inst.name, "role": inst.role, "pe": inst.pe,
                                                "alive": False, "error": inst.error}
                     for inst in self.fleet.instances]
        for inst, entry in zip(self.fleet.instances, instances):  # its ranks: PE and device each
            entry.update(tensor_parallel=inst.tensor_parallel, ranks=inst.rank_entries())
        router = self.router_stats()
        return {"mode": self.config.mode, "device": self.fleet.device, "backend": self.fleet.backend,
                "num_pages": self.fleet.sizing.num_pages, "max_model_len": self.max_model_len,
                "paths": {f"{a}->{b}": p for (a, b), p in self.fleet.paths.items()},
                "instances": instances, "degraded": self.degraded, "rebuild": router.get("rebuild"),
                "router": router}

    def reset_prefix_cache(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Forget every live instance's cached prefixes (vLLM's ``/reset_prefix_cache``), and the
        router's prefix affinity with them; running requests keep their pages. Returns the pages
        each instance freed, by name.

        Raises:
            TimeoutError: an instance did not answer within ``timeout_s`` (named).
        """
        live = [inst for inst in self.fleet.instances if inst.alive]
        refs = [inst.actor.reset_prefix_cache.remote() for inst in live]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        late = [inst.name for inst, ref in zip(live, refs) if ref not in set(ready)]
        if late:
            raise TimeoutError(f"reset_prefix_cache: no answer within {timeout_s:g} s from {', '.join(late)}")
        freed = {inst.name: int(n) for inst, n in zip(live, ray.get(refs))}

        def forget() -> None:  # the router's belief of what each instance holds (cluster/routing/affinity.py)
            affinity = self._router.placer.affinity
            for name in freed if affinity is not None else ():
                affinity.forget(name)
        self._call(_async(forget))
        return freed

    def router_stats(self) -> dict:
        """The router's state alone (queue, requests per stage, outcomes, loads): no actor round trip."""
        return self._call(_async(self._router.snapshot)) if not self._closed else {}

    def shutdown(self) -> None:
        """Abort live requests, stop the router, release every actor (and Ray, if started here)."""
        if self._closed:
            return
        try:
            self._call(self._router.stop(), timeout_s=30)
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self.fleet.stop()

    def _call(self, coro, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


async def _async(fn):
    return fn()


def _may_have_run(submitted: concurrent.futures.Future) -> bool:
    """False when a submit surely did not create the request (cancelled before it ran, or
    refused): an abort then would only be remembered for a later request with the same id."""
    if submitted.cancelled():
        return False
    return not submitted.done() or submitted.exception() is None


def _answer(inst: Instance, ref: Any) -> dict:
    """One instance's stats (``ref`` is ready), or why it gave none."""
    base = {"name": inst.name, "role": inst.role, "pe": inst.pe}
    try:
        return dict(ray.get(ref), alive=True)
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
        return dict(base, alive=False, error=inst.error or f"stats() failed: {type(err).__name__}")


def _default_params() -> Any:
    from disagg.sampling import SamplingParams
    return SamplingParams()


class Handoff:
    """Items from the router's loop to one caller's loop, handed over once per router loop turn.

    The router emits a delta per request for every batch an engine returns (~150 at once on a
    busy instance); each `call_soon_threadsafe` writes the caller loop's self-pipe and wakes it,
    and both loops share one interpreter lock. `put` (on the router's loop) queues the item and,
    for the first of a turn, schedules `_flush` after the callback running now (a whole batch's
    `_on_rows`), which hands every queued item over in one call; the caller's loop puts them
    into their queues in order: woken per item, the caller's loop would slow the router's as
    the streams grow. `benchmarks/bench_handoff.py` measures the two ways.
    """

    def __init__(self, router_loop: asyncio.AbstractEventLoop, caller_loop: asyncio.AbstractEventLoop) -> None:
        self.router_loop, self.caller_loop = router_loop, caller_loop
        self._pending: list[tuple[asyncio.Queue, Any]] = []

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """Queue ``item`` for ``queue`` (on the router's loop). Raises RuntimeError when the
        caller's loop is closed (nobody reads: the router aborts the request)."""
        if self.caller_loop.is_closed():
            raise RuntimeError("the caller's event loop is closed")
        if not self._pending:
            self.router_loop.call_soon(self._flush)
        self._pending.append((queue, item))

    def _flush(self) -> None:
        items, self._pending = self._pending, []
        try:
            self.caller_loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the caller's loop closed since `put`: nobody reads
            logger.debug("dropped %d deltas for a closed event loop", len(items))


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _fetch_tokenizer(fleet: Fleet) -> Any:
    """The model's tokenizer, shipped from the first instance (None when the model has none)."""
    first = fleet.instances[0]
    if not first.info.get("has_tokenizer"):
        return None
    try:
        return ray.get(first.actor.tokenizer.remote(), timeout=60)
    except Exception as err:  # unpicklable tokenizer: text prompts are refused, ids still work
        logger.warning("could not fetch the tokenizer from %s: %s", first.name, err)
        return None


class _Collector:
    """Gathers one request's deltas for `Cluster.generate` (sink runs on the router's loop)."""

    def __init__(self) -> None:
        self.request_id = ""
        self.prompt_token_ids: list[int] = []
        self.token_ids: list[int] = []
        self.last: StreamDelta | None = None
        self.metrics: RequestMetrics | None = None
        self.done = threading.Event()

    def sink(self, delta: StreamDelta, metrics: RequestMetrics | None) -> None:
        self.token_ids.extend(delta.token_ids)
        if delta.finished:
            self.last, self.metrics = delta, metrics
            self.done.set()

    def completion(self, tokenizer: Any) -> Completion:
        text = tokenizer.decode(self.token_ids) if tokenizer is not None else None
        return Completion(self.request_id, self.prompt_token_ids, self.token_ids, text,
                          self.last.finish_reason, self.last.error, self.metrics)


__all__ = ["Cluster", "Completion", "StreamDelta"]
