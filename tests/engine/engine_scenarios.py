"""Per-process steps of the disaggregated engine tests: one engine per PE, driven by a test.

A PE process (spawned worker on CPU with the shm heap, or a Ray actor on a GPU with NVSHMEM)
runs `setup` (load the model, open the heap, build a PrefillEngine or DecodeEngine: the KV
allocation is collective, so both PEs set up at once), then `call`s of engine methods. The test
side plays the router with `relay`: reserve on decode -> add on prefill -> step both, handing
each first token to decode. State lives in `STATE` between steps, as it would in an actor.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

STATE: dict[str, Any] = {}


class EngineRunner:
    """Actor body for Ray (wrapped with ``ray.remote`` by the GPU test)."""

    def run(self, step: str, kwargs: dict) -> Any:
        return globals()[step](**kwargs)

    def new_uid(self, backend: str) -> bytes:
        from disagg.transfer import new_unique_id
        return new_unique_id(backend)


def worker_loop(rank: int, inbox, outbox) -> None:
    """Spawned worker: run steps from ``inbox`` until None; answer ``(rank, ok, value)``."""
    while True:
        message = inbox.get()
        if message is None:
            return
        step, kwargs = message
        try:
            outbox.put((rank, True, globals()[step](**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the driver, which fails the test
            outbox.put((rank, False, traceback.format_exc()))


def setup(backend: str, uid: bytes, rank: int, role: str, source: str, dtype: str, sizes: dict,
          heap_bytes: int = 8 << 20, env: dict | None = None) -> dict:
    """Load the model, open this PE's heap and build its engine (role "prefill" or "decode")."""
    os.environ.update(env or {})
    import torch

    from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine
    from disagg.model import load_model
    from disagg.transfer import open_heap

    device = "cuda" if backend == "nvshmem" else "cpu"
    model = load_model(source, dtype=getattr(torch, dtype), device=device)
    heap = open_heap(backend, uid=uid, rank=rank, world_size=2, size_bytes=heap_bytes,
                     device=device if backend == "nvshmem" else None, num_signals=64, timeout_s=60.0)
    sizes = dict(sizes)
    if role == "prefill":
        sizes.pop("lease_s", None)
        engine = PrefillEngine(model, heap, **sizes)
    else:
        sizes.pop("max_num_batched_tokens", None)
        lease = {"lease_s": sizes.pop("lease_s")} if "lease_s" in sizes else {}
        engine = DecodeEngine(model, heap, **sizes, options=EngineOptions(**lease))
    STATE.update(heap=heap, engine=engine, model=model)
    return {"rank": heap.rank, "kv_shape": tuple(engine.kv.shape)}


def call(method: str, args: tuple = (), rank: int | None = None) -> Any:
    """Call an engine method; step outputs come back as plain tuples."""
    result = getattr(STATE["engine"], method)(*args)
    if method == "step":
        return [tuple(out) for out in result], STATE["engine"].has_work()
    return result


def teardown(rank: int | None = None) -> dict:
    """Report the engine's final stats and close the heap."""
    engine = STATE["engine"]
    stats = engine.stats()
    engine.cache.check_integrity()
    STATE["heap"].close()
    STATE.clear()
    return stats


def relay(call_on: Callable[[int, str, tuple], Any], prompts: dict, params, max_steps: int = 2000) -> dict:
    """Play the router between prefill (PE 0) and decode (PE 1); return {request_id: tokens}.

    Args:
        call_on: ``call_on(rank, method, args)`` runs ``engine.method(*args)`` on that PE.
        prompts: {request_id: prompt token ids}.
        params: SamplingParams of every request, or {request_id: SamplingParams}.
    """
    for rid, prompt in prompts.items():
        p = params[rid] if isinstance(params, dict) else params
        dest = call_on(1, "reserve", (rid, len(prompt), p))
        call_on(0, "add", (rid, prompt, p, dest))
    tokens: dict = {rid: [] for rid in prompts}
    busy = [True, True]
    for _ in range(max_steps):
        if not any(busy):
            return tokens
        outputs, busy[0] = call_on(0, "step", ())
        for rid, token, finished, reason, _error in outputs:
            tokens[rid].append(token)
            if not finished:
                call_on(1, "start", (rid, token))
                busy[1] = True
        outputs, busy[1] = call_on(1, "step", ())
        for rid, token, _finished, reason, error in outputs:
            assert reason not in ("error", "abort"), (rid, reason, error)
            tokens[rid].append(token)
    raise AssertionError(f"prefill/decode still busy after {max_steps} steps")


def colocated_tokens(source: str, dtype: str, prompts: dict, params: dict, sizes: dict) -> dict:
    """The same requests through a ColocatedEngine on this process's device (the reference)."""
    import torch

    from disagg.engine import ColocatedEngine
    from disagg.model import load_model

    model = STATE.get("model") or load_model(source, dtype=getattr(torch, dtype))
    sizes = {k: v for k, v in sizes.items() if k != "lease_s"}
    engine = ColocatedEngine(model, **sizes)
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, params[rid])
    tokens: dict = {rid: [] for rid in prompts}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
    return tokens
