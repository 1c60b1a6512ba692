"""Per-rank steps of the multi-process transfer tests: one module for CPU workers and GPU actors.

A rank is a sender (prefill: runs a fake prefill whose K/V of layer l at position p of request r
is a seeded function of (r, l, p), and pushes it), a receiver (decode: reserves pages, arms a
doorbell, later checks that exactly its reserved slots changed and hold those K/V), or both.
State lives in `STATE` between steps, as it would in a worker actor. Runs in spawned processes
(`proc_group.ProcGroup`, shm heap) and in Ray actors (`test_nvshmem_ray.py`, NVSHMEM heap).
"""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import torch

STATE: dict[str, Any] = {}


class ScenarioRunner:
    """Actor body for Ray (wrapped with ``ray.remote`` by the test): runs steps in its process."""

    def run(self, step: str, kwargs: dict) -> Any:
        return globals()[step](**kwargs)

    def new_uid(self, backend: str, size_bytes: int | None = None) -> bytes:
        from disagg.transfer import new_unique_id
        return new_unique_id(backend, size_bytes=size_bytes)


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


def request_kv(request_id: int, layer: int, positions: np.ndarray, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake prefill's K and V, each ``[len(positions), H, D]``, same on every rank."""
    length = int(positions.max()) + 1 if len(positions) else 0
    gen = torch.Generator().manual_seed(1_000_003 * request_id + 7919 * layer + 1)
    kv = torch.randn(length, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    rows = kv[torch.from_numpy(np.asarray(positions, dtype=np.int64))]
    return rows[:, 0].contiguous(), rows[:, 1].contiguous()


def setup(backend: str, uid: bytes, rank: int, world_size: int, geometry: dict, dtype: str,
          force_segment_puts: bool = False, size_bytes: int = 64 << 20, timeout_s: float = 30.0) -> dict:
    """Open the heap, allocate and randomly fill the KV tensor, build cache/pusher/doorbells."""
    from disagg.cache import PagedKVCache
    from disagg.transfer import DoorbellTable, KVPusher, open_heap

    device = "cuda" if backend == "nvshmem" else None
    heap = open_heap(backend, uid=uid, rank=rank, world_size=world_size, size_bytes=size_bytes,
                     device=device, timeout_s=timeout_s)
    g = geometry
    torch_dtype = getattr(torch, dtype)
    kv = heap.alloc((g["num_layers"], g["num_pages"], 2, g["num_kv_heads"], g["page_size"], g["head_dim"]), torch_dtype)
    gen = torch.Generator().manual_seed(12345 + rank)
    kv.copy_(torch.randn(kv.shape, generator=gen).to(torch_dtype))
    heap.barrier()  # every PE filled before anyone pushes
    STATE.clear()
    STATE.update(heap=heap, kv=kv, geometry=g, dtype=torch_dtype, snapshot=kv.cpu().clone(),
                 cache=PagedKVCache(g["num_pages"], g["page_size"]), doorbells=DoorbellTable(heap),
                 pusher=KVPusher(heap, kv, force_segment_puts=force_segment_puts),
                 request_of_seq={}, received={})
    return {"reachable": [heap.peer(kv, pe) is not None for pe in range(world_size)]}


def prepare_recv(requests: list[dict], rank: int | None = None) -> dict[int, dict]:
    """Receiver: reserve pages for each ``{request_id, seq_id, length}``; return maps and tickets."""
    cache, doorbells = STATE["cache"], STATE["doorbells"]
    out = {}
    for req in requests:
        cache.add_sequence(req["seq_id"])
        cmap = cache.disagg_prepare_recv(req["seq_id"], req["length"])
        cache.end_forward()
        ticket = doorbells.arm(req["request_id"])
        STATE["received"][req["request_id"]] = (req["seq_id"], ticket)
        out[req["request_id"]] = {"cmap": [int(x) for x in cmap], "ticket": ticket}
    return out


def run_forward(seq_ids: list[int], lengths: list[int], *, end: bool = True,
                layer_delay_s: float = 0.0) -> None:
    """Sender: one forward of the fake model (every layer: K/V -> fused append+push).

    ``layer_delay_s``: sleep after each layer's push (the next layer's K/V comes later), so a
    doorbell rung before the last layer's write would be seen while that layer is missing.
    """
    import time

    cache, pusher, g = STATE["cache"], STATE["pusher"], STATE["geometry"]
    plan = cache.begin_forward(seq_ids, lengths)
    pusher.begin_forward(plan)
    device = STATE["kv"].device
    for layer in range(g["num_layers"]):
        ks, vs = [], []
        for b, seq in enumerate(seq_ids):
            positions = plan.positions[plan.qo_indptr[b]:plan.qo_indptr[b + 1]]
            k, v = request_kv(STATE["request_of_seq"][seq], layer, positions, g["num_kv_heads"],
                              g["head_dim"], STATE["dtype"])
            ks.append(k)
            vs.append(v)
        pusher.push_layer_async(layer, torch.cat(ks).to(device), torch.cat(vs).to(device))
        pusher.wait_layer(layer)
        if layer_delay_s:
            time.sleep(layer_delay_s)
    if end:
        finish_forward()


def use_segment_puts(force: bool, rank: int | None = None) -> None:
    """Sender: rebuild the pusher, forcing (or not) segment puts to every receiver."""
    use_pusher(force_segment_puts=force)


def use_pusher(force_segment_puts: bool = False, append_on_caller_stream: bool = False,
               rank: int | None = None) -> None:
    """Sender: rebuild the pusher with these `KVPusher` options."""
    from disagg.transfer import KVPusher

    STATE["pusher"] = KVPusher(STATE["heap"], STATE["kv"], force_segment_puts=force_segment_puts,
                               append_on_caller_stream=append_on_caller_stream)


def finish_forward(rank: int | None = None) -> None:
    """Sender: end the open forward (rings the doorbells of completed requests)."""
    STATE["pusher"].end_forward()
    STATE["cache"].end_forward()
    STATE["pusher"].synchronize()


def prefill(requests: list[dict], ring: bool = True, rank: int | None = None,
            layer_delay_s: float = 0.0) -> None:
    """Sender: prefill ``{request_id, seq_id, prompt_len, local_len, begin, cmap, ticket, pe}``.

    First ``local_len`` tokens run locally (no send), then `disagg_mark_send(begin)` and the rest
    run with pushes, so positions ``begin..local_len`` go page to page. ``ring=False`` leaves the
    last forward open (its doorbells not rung) for `finish_forward`.
    """
    cache, pusher = STATE["cache"], STATE["pusher"]
    for req in requests:
        cache.add_sequence(req["seq_id"])
        STATE["request_of_seq"][req["seq_id"]] = req["request_id"]
    local = [r for r in requests if r.get("local_len", 0) > 0]
    if local:
        run_forward([r["seq_id"] for r in local], [r["local_len"] for r in local])
    for req in requests:
        cache.disagg_mark_send(req["seq_id"], req.get("begin", 0), req["cmap"], req["pe"])
        pusher.attach_doorbell(req["seq_id"], req["ticket"])
    run_forward([r["seq_id"] for r in requests],
                [r["prompt_len"] - r.get("local_len", 0) for r in requests], end=ring,
                layer_delay_s=layer_delay_s)


def ring_race(role: str, rank: int | None = None, **kwargs: Any) -> Any:
    """One step, two roles that run at once: ``"send"`` runs `prefill(**kwargs)`; ``"watch"``
    runs `watch_ring(**kwargs)`."""
    return prefill(**kwargs) if role == "send" else watch_ring(**kwargs)


def watch_ring(request_id: int, begin: int = 0, timeout_s: float = 30.0) -> dict:
    """Receiver, while the sender pushes: spin on the doorbell and, the moment it is rung, read
    the request's slots (on the KV tensor's device) and compare them with the expected K/V of
    every layer. A ring that came before the last write shows up as missing layers."""
    import time

    g, kv = STATE["geometry"], STATE["kv"]
    seq_id, ticket = STATE["received"][request_id]
    deadline = time.monotonic() + timeout_s
    while not STATE["doorbells"].is_rung(ticket):
        if time.monotonic() > deadline:
            return {"rung": False}
    slots = torch.from_numpy(np.asarray(STATE["cache"].slots(seq_id), dtype=np.int64)).to(kv.device)
    pages, offsets = slots // g["page_size"], slots % g["page_size"]
    seen = [kv[layer, pages, :, :, offsets].clone() for layer in range(g["num_layers"])]  # [n, 2, H, D]
    positions = begin + np.arange(len(slots))
    missing = []
    for layer in range(g["num_layers"]):
        k, v = request_kv(request_id, layer, positions, g["num_kv_heads"], g["head_dim"], STATE["dtype"])
        want = torch.stack([k, v], dim=1).to(kv.device)
        if not torch.equal(seen[layer].view(torch.uint8), want.view(torch.uint8)):
            missing.append(layer)
    if not missing:  # later whole-tensor checks (check_received) expect what has landed here
        pages_cpu, offsets_cpu = pages.cpu(), offsets.cpu()
        for layer in range(g["num_layers"]):
            STATE["snapshot"][layer, pages_cpu, :, :, offsets_cpu] = seen[layer].cpu()
    return {"rung": True, "layers_wrong_at_ring": missing}


def is_rung(request_id: int, rank: int | None = None) -> bool:
    """Receiver: has the doorbell of ``request_id`` been rung?"""
    return STATE["doorbells"].is_rung(STATE["received"][request_id][1])


def wait_error(request_id: int, timeout_s: float, rank: int | None = None) -> dict | None:
    """Receiver: wait for a doorbell; return the error as ``{type, message, ...}`` (None if rung)."""
    ticket = STATE["received"][request_id][1]
    try:
        STATE["doorbells"].wait(ticket, timeout_s)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return {"type": type(err).__name__, "message": str(err),
                "request_id": getattr(err, "request_id", None), "dst_pe": getattr(err, "dst_pe", None)}
    return None


def check_received(begins: dict[int, int], timeout_s: float = 30.0, rank: int | None = None) -> dict:
    """Receiver: wait for the doorbells of ``begins`` (request -> first sent position), then
    compare the whole KV tensor with the snapshot (set-up, or the last passing check) plus the expected K/V at the reserved
    slots. Returns ``{"equal": bool, "mismatched_elements": int, ...}``."""
    g, kv = STATE["geometry"], STATE["kv"]
    expected = STATE["snapshot"].clone()
    for request_id, begin in begins.items():
        seq_id, ticket = STATE["received"][request_id]
        STATE["doorbells"].wait(ticket, timeout_s)
        slots = np.asarray(STATE["cache"].slots(seq_id), dtype=np.int64)
        positions = begin + np.arange(len(slots))
        pages, offsets = slots // g["page_size"], slots % g["page_size"]
        for layer in range(g["num_layers"]):
            k, v = request_kv(request_id, layer, positions, g["num_kv_heads"], g["head_dim"], STATE["dtype"])
            expected[layer, pages, 0, :, offsets] = k
            expected[layer, pages, 1, :, offsets] = v
    got = kv.cpu()
    equal = bool(torch.equal(got.view(torch.uint8), expected.view(torch.uint8)))
    if equal:
        STATE["snapshot"] = expected  # later checks compare against what has landed so far
    return {"equal": equal,
            "mismatched_bytes": int((got.view(torch.uint8) != expected.view(torch.uint8)).sum()),
            "num_slots_received": {r: len(STATE["cache"].slots(STATE["received"][r][0])) for r in begins}}


def sender_unchanged_outside(rank: int | None = None) -> bool:
    """Sender: the local KV equals the snapshot except at its sequences' slots (bit-exact writes);
    False when it has sent no sequence (nothing would be checked)."""
    g, kv = STATE["geometry"], STATE["kv"]
    if not STATE["request_of_seq"]:
        return False
    expected = STATE["snapshot"].clone()
    for seq_id, request_id in STATE["request_of_seq"].items():
        slots = np.asarray(STATE["cache"].slots(seq_id), dtype=np.int64)
        pages, offsets = slots // g["page_size"], slots % g["page_size"]
        for layer in range(g["num_layers"]):
            k, v = request_kv(request_id, layer, np.arange(len(slots)), g["num_kv_heads"], g["head_dim"], STATE["dtype"])
            expected[layer, pages, 0, :, offsets] = k
            expected[layer, pages, 1, :, offsets] = v
    return bool(torch.equal(kv.cpu().view(torch.uint8), expected.view(torch.uint8)))


def teardown(rank: int | None = None) -> list[str]:
    """Close the heap; return shm files of this job still in /dev/shm (should be none)."""
    heap = STATE.get("heap")
    leftovers: list[str] = []
    if heap is not None:
        heap.close()
        if heap.backend == "shm":
            from disagg.transfer.shm_heap import shm_leftovers
            leftovers = shm_leftovers(heap.uid)
    STATE.clear()
    return leftovers


def hold_heap(uid: bytes, rank: int, world_size: int, opened, timeout_s: float) -> None:
    """Spawned target of the crash tests: open a shm heap, report it, then wait to be killed."""
    import time

    from disagg.transfer import open_heap

    heap = open_heap("shm", uid=uid, rank=rank, world_size=world_size, size_bytes=1 << 20,
                     timeout_s=timeout_s)
    opened.set()
    time.sleep(timeout_s)
    heap.close()
