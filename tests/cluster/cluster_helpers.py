"""Helpers of the cluster tests: launching shipped configs (with the production actor or
`hooked_actor.HookedInstanceActor`), waiting for free pages, references, holding the router's
loop, forcing placements."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from pathlib import Path

from disagg.cluster import Cluster
from disagg.cluster.launch import bootstrap
from disagg.cluster.launch.actors import InstanceActor
from disagg.cluster.routing.placement import Decision, Prediction
from disagg.config import Config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The actors' environment: the kernels' torch references on CPU tensors (conftest.py); CUDA tensors
# run the Triton kernels either way, compiled (not interpreted) when this is set at the start.
ACTOR_ENV = {"TRITON_INTERPRET": "0"}


def launch(name: str, actor_class: type[InstanceActor] = InstanceActor, **overrides) -> Cluster:
    """Launch ``configs/<name>.yaml`` (`launch_config`) with dotted overrides given as
    ``section__key=value``."""
    config = Config.from_yaml(CONFIGS / f"{name}.yaml")
    if overrides:
        config = config.override({key.replace("__", "."): value for key, value in overrides.items()})
    return launch_config(config, actor_class)


def launch_config(config: Config, actor_class: type[InstanceActor] = InstanceActor) -> Cluster:
    """`Cluster.launch(config)` with actors of ``actor_class`` (e.g. `hooked_actor.HookedInstanceActor`)
    and `ACTOR_ENV` in their environment."""
    with actors_of(actor_class), launcher_environment(**ACTOR_ENV):
        return Cluster.launch(config)


@contextlib.contextmanager
def actors_of(actor_class: type[InstanceActor]):
    """Launches inside the block start actors of ``actor_class`` (`bootstrap.ACTOR_CLASS`)."""
    saved, bootstrap.ACTOR_CLASS = bootstrap.ACTOR_CLASS, actor_class
    try:
        yield
    finally:
        bootstrap.ACTOR_CLASS = saved


@contextlib.contextmanager
def launcher_environment(**variables: str):
    """Set ``variables`` in this process's environment for the block: a launch inside passes them
    on to its actors (`bootstrap.PASSED_ENV`, which must list each one)."""
    unknown = sorted(set(variables) - set(bootstrap.PASSED_ENV))
    if unknown:
        raise ValueError(f"variables: {unknown} never reach the actors; bootstrap passes {bootstrap.PASSED_ENV}")
    with environment(**variables):
        yield


@contextlib.contextmanager
def environment(**variables: str):
    """Set ``variables`` in this process's environment for the block (restored after it)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def wait_all_free(cluster: Cluster, timeout_s: float = 20.0) -> dict:
    """Wait until every live instance has all its pages free and nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.stats()
        live = [inst for inst in stats["instances"] if inst["alive"]]
        if all(inst["free_pages"] == inst["total_pages"] and not inst["running"] and not inst["waiting"]
               for inst in live):
            assert stats["router"]["live"] == 0 and stats["router"]["queued"] == 0, stats["router"]
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"pages not all free after {timeout_s} s: {stats['instances']}")
        time.sleep(0.1)


def every_rank_free(cluster: Cluster, ray_local, timeout_s: float = 60.0) -> None:
    """Each live instance's every rank has all its pages free within ``timeout_s``, read off each
    rank's own engine (`InstanceActor.rank_pages`: a follower's loop answers no stats). A
    follower runs the leader's last pass a moment after the leader (it receives the pass, then
    runs it), so an idle leader's follower may still be freeing: poll, and fail on what is left
    at the deadline."""
    deadline = time.monotonic() + timeout_s
    for inst in cluster.fleet.instances:
        while inst.alive:
            pages = ray_local.get([actor.rank_pages.remote() for actor in inst.actors], timeout=timeout_s)
            if all(p["free_pages"] == p["total_pages"] for p in pages):
                break
            assert time.monotonic() < deadline, (inst.name, pages)
            time.sleep(0.1)


@contextlib.contextmanager
def hold_router_loop(cluster: Cluster, timeout_s: float = 30.0):
    """Block the router's event loop for the ``with`` block: what callers send to the router
    meanwhile (submits, aborts) runs once it exits, in the order it was sent."""
    release, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(timeout_s)
    cluster._loop.call_soon_threadsafe(hold)
    assert held.wait(timeout_s), "the router's loop did not come to the hold"
    try:
        yield
    finally:
        release.set()


def mixed_prompts(num: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """``num`` prompts of mixed lengths (1..90 tokens, several pages and partial pages)."""
    import random

    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 33, 90] + [rng.randint(1, 90) for _ in range(num)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths[:num]]


def reference_tokens(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy outputs of an in-process ColocatedEngine on dummy:tiny (float32, CPU)."""
    from disagg.engine import ColocatedEngine
    from disagg.model import load_model
    from disagg.sampling import SamplingParams

    with environment(TRITON_INTERPRET="0"):
        model = load_model("dummy:tiny", dtype="float32", device="cpu")
        engine = ColocatedEngine(model, num_pages=256, page_size=16, max_num_seqs=16, max_num_batched_tokens=256)
        return engine_tokens(engine, prompts, [SamplingParams(max_tokens=n) for n in max_tokens])


class BackgroundStream:
    """One `cluster.stream` consumed on its own thread and event loop (any loop must work).

    Attributes:
        deltas: every delta received, in order.
        started: set at the first delta; done: set at the last (or when the stream raised).
        error: what the stream raised, if anything.
    """

    def __init__(self, cluster: Cluster, prompt, params, request_id: str | None = None,
                 stop_after: int | None = None) -> None:
        import threading

        self.deltas: list = []
        self.started, self.done = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self._args = (cluster, prompt, params, request_id, stop_after)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import asyncio

        cluster, prompt, params, request_id, stop_after = self._args

        async def consume() -> None:
            stream = cluster.stream(prompt, params, request_id=request_id)
            async for delta in stream:
                self.deltas.append(delta)
                self.started.set()
                if stop_after is not None and len(self.deltas) >= stop_after:
                    await stream.aclose()  # the caller walks away: the request must be aborted
                    return
        try:
            asyncio.run(consume())
        except BaseException as err:  # handed to the test
            self.error = err
        finally:
            self.started.set()
            self.done.set()

    def result(self, timeout_s: float = 60.0):
        """The last delta (raises what the stream raised)."""
        assert self.done.wait(timeout_s), f"stream not done after {timeout_s} s: {self.deltas[-3:]}"
        if self.error is not None:
            raise self.error
        return self.deltas[-1]

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


def force_paths(cluster: Cluster, monkeypatch, paths: list[str]) -> None:
    """Make the router's adaptive decisions give ``paths`` in turn to new requests (whatever the
    model says); a request retried at the queue head keeps its path."""
    router = cluster._router
    turns, given = itertools.cycle(paths), {}

    def forced(req, prefills, decodes, live):
        if req.request_id not in given:
            given[req.request_id] = next(turns)
        path = given[req.request_id]
        inst = prefills[0] if path == "kept" else decodes[0]
        pred = Prediction(path, inst.name if path != "remote" else prefills[0].name, inst.name, 0.0, 0.0, 0.0)
        return Decision(pred, (pred,))

    monkeypatch.setattr(router, "_decide", forced)


def engine_tokens(engine, prompts: list[list[int]], params: list) -> list[list[int]]:
    """Each prompt's output tokens from an in-process engine, all added at once and run to the end."""
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add(i, prompt, sp)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            if o.token_id is not None:
                out[o.request_id].append(o.token_id)
    return [out[i] for i in range(len(prompts))]
