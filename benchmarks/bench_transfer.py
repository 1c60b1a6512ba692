"""Benchmark KV transfer between two GPUs (two Ray actors, one GPU each); JSON out.

    source .whl/gpu-env.sh && python3 benchmarks/bench_transfer.py --out results/bench_transfer.json

Workload: an 8B model's KV (32 layers, 8 KV heads, head_dim 128, 16-token pages, bf16); 1 GiB of
it (8192 tokens) scattered over random pages on both sides. Each figure comes with its anchor
from the same run:
- push: KVPusher's fused append+push, all 32 layers, vs a contiguous peer `copy_` of 1 GiB
  (target ratio >= 0.90). The headline is the steady state of a serving loop: 8 forwards issued
  back to back (each with its own begin_forward, 32 push_layer_async, end_forward and doorbell),
  one sync at the end, seconds per forward; one forward started from an idle GPU, with its host
  work before the first launch on the clock, is reported beside it, with begin_forward's host
  time and a cProfile table of it (JSON `host_profile_of_five_forwards`). Also the host time of
  one `push_layer_async` next to the GPU time of one layer (the host must stay under it, or the
  push is CPU-bound); the same data as one 256-byte row per token, K/V and head (TVM's
  granularity, via torch `index_copy_` into the peer view); the forced segment-put path;
  NCCL send/recv of each layer's pages per request (vLLM's P2P-NCCL connector's way).
- doorbell: one-way latency, host-polled and device-waited (`signal_wait_until_on_stream`).
- overlap: a 32-layer compute loop sized like an 8B prefill of 4096 tokens, local append only
  (anchor) vs with the per-layer push (target overhead <= 3%), and vs per-layer NCCL sends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

GiB = 1 << 30
LAYERS, HEADS, DIM, PAGE, PAGES = 32, 8, 128, 16, 1024
PUSH_TOKENS, PREFILL_TOKENS = 8192, 4096
DEMO_TOKENS = 4096  # the demo's prompt, for the rows over pages as the cache hands them out
HIDDEN, Q_HEADS, FFN = 4096, 32, 14336
GPU_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
HEAP_BYTES = 3 * GiB + (256 << 20)  # KV (2 GiB) + the anchor's 1 GiB
PING_WORD, PONG_WORD, GATE_WORD = 4093, 4094, 4095  # signal words kept out of the doorbell table
BACK_TO_BACK = 8  # forwards per steady-state push measurement
PROFILED_FORWARDS = 40


def scattered_plan(num_tokens: int, seq_id: int, seed: int):
    """A one-sequence ForwardPlan: tokens on random local pages, pushed to random remote pages."""
    from disagg.plan import ForwardPlan

    rng = np.random.default_rng(seed)
    num_pages = num_tokens // PAGE
    offsets = np.arange(num_tokens) % PAGE

    def slots() -> np.ndarray:
        return (np.repeat(rng.permutation(PAGES)[:num_pages], PAGE) * PAGE + offsets).astype(np.int32)

    i32 = np.int32
    return ForwardPlan(
        seq_ids=(seq_id,), qo_indptr=np.array([0, num_tokens], i32),
        page_indptr=np.array([0, num_pages], i32), page_indices=np.zeros(num_pages, i32),
        last_page_len=np.array([PAGE], i32), append_slots=slots(),
        positions=np.arange(num_tokens, dtype=i32), push_slots=slots(),
        push_pes=np.ones(num_tokens, i32), copy_local_slots=np.zeros(0, i32),
        copy_remote_slots=np.zeros(0, i32), copy_pes=np.zeros(0, i32),
        fork_src_slots=np.zeros(0, i32), fork_dst_slots=np.zeros(0, i32),
        send_seq_ids=np.array([seq_id], np.int64), send_pes=np.array([1], i32),
        send_complete=np.array([True]))


def timed(fn, iters: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` (which must leave the GPU idle when it returns)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class BenchWorker:
    """One GPU's side (rank 0 sends/prefills, rank 1 receives); wrapped by ``ray.remote``."""

    def new_uid(self) -> bytes:
        from disagg.transfer import new_unique_id
        return new_unique_id("nvshmem", size_bytes=HEAP_BYTES)

    def free_port(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def setup(self, uid: bytes, rank: int, port: int) -> str:
        import torch.distributed as dist

        from disagg.transfer import DoorbellTable, open_heap

        self.rank, self.peer_pe = rank, 1 - rank
        self.heap = open_heap("nvshmem", uid=uid, rank=rank, world_size=2, size_bytes=HEAP_BYTES)
        self.kv = self.heap.alloc((LAYERS, PAGES, 2, HEADS, PAGE, DIM), torch.bfloat16)
        self.anchor = self.heap.alloc((GiB,), torch.uint8)
        self.doorbells = DoorbellTable(self.heap)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                device_id=torch.device("cuda", 0))
        gen = torch.Generator(device="cuda").manual_seed(rank)
        self.ks = [torch.randn(PUSH_TOKENS, HEADS, DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(LAYERS)]
        self.vs = [torch.randn_like(k) for k in self.ks]
        self.heap.barrier()
        return torch.cuda.get_device_name()

    def arm(self, count: int) -> list:
        return [self.doorbells.arm(i) for i in range(count)]

    # ------------------------------------------------------------------ bandwidth
    def push_bandwidth(self, tickets: list, force: bool, contiguous: bool, iters: int,
                       back_to_back: int = 0, profile: bool = False, caller_stream: bool = False,
                       slots: tuple | None = None) -> dict:
        """Seconds for the pusher to move one 8192-token request, every layer, to PE 1.

        ``total``: one forward from an idle GPU (its host work before the first launch, mostly
        ``begin_forward``, is on the clock); ``host``: begin_forward .. end_forward returning;
        ``begin``: begin_forward alone; ``layer_host``: one push_layer_async. With
        ``back_to_back``: ``steady``, seconds per forward over that many forwards issued
        without a sync in between (a serving loop: each forward's host work overlaps the
        previous one's transfers). With ``profile``: ``profile``, the cProfile table (by
        cumulative time) of five forwards' host calls. ``caller_stream``: the pusher's
        ``append_on_caller_stream`` mode. ``slots``: (local, remote) int32 slot arrays to use
        instead (`demo_pattern_slots`; fewer tokens than the default request).
        """
        from disagg.transfer import KVPusher

        pusher = KVPusher(self.heap, self.kv, force_segment_puts=force, append_on_caller_stream=caller_stream)
        plan = scattered_plan(PUSH_TOKENS, seq_id=1, seed=0)
        if contiguous:
            plan = _contiguous(plan)
        if slots is not None:
            plan = _with_slots(plan, *slots)
        ks = [k[: plan.num_tokens] for k in self.ks]
        vs = [v[: plan.num_tokens] for v in self.vs]
        tickets, host, begin, layer_host = list(tickets), [], [], []

        def forward() -> None:
            start = time.perf_counter()
            pusher.attach_doorbell(1, tickets.pop())
            pusher.begin_forward(plan)
            begin.append(time.perf_counter() - start)
            for layer in range(LAYERS):
                layer_start = time.perf_counter()
                pusher.push_layer_async(layer, ks[layer], vs[layer])
                layer_host.append(time.perf_counter() - layer_start)
            pusher.end_forward()
            host.append(time.perf_counter() - start)

        def once() -> None:
            forward()
            pusher.synchronize()
            torch.cuda.synchronize()

        total = timed(once, iters)
        result = {"total": total, "host": statistics.median(host[1:]), "begin": statistics.median(begin[1:]),
                  "layer_host": statistics.median(layer_host[LAYERS:])}
        if back_to_back:
            def many() -> None:
                for _ in range(back_to_back):
                    forward()
                pusher.synchronize()
                torch.cuda.synchronize()
            result["steady"] = timed(many, iters) / back_to_back
        if profile:
            result["profile"] = _profile_forwards(forward, pusher, PROFILED_FORWARDS)
        return result

    @staticmethod
    def tickets_for_push(iters: int, back_to_back: int, profile: bool) -> int:
        """Doorbell tickets one push_bandwidth call uses."""
        return (iters + 1) * (1 + back_to_back) + (PROFILED_FORWARDS if profile else 0)

    def kernels_only(self, iters: int) -> dict[str, float]:
        """Seconds of the same 1 GiB through the kernels alone (no pusher): the fused
        append_push_kv per layer (one-shot launcher, prepared launcher, CUDA graph), copy_slots
        page to page into the peer (all layers); and each launcher's host seconds per layer."""
        from disagg.kernels import append_push_kv, build_dst_table, copy_slots
        from disagg.kernels.append import prepare_append_push

        plan = scattered_plan(PUSH_TOKENS, seq_id=1, seed=0)
        slots = torch.from_numpy(plan.append_slots).cuda()
        dst_slots = torch.from_numpy(plan.push_slots).cuda()
        dst_index = torch.zeros_like(dst_slots)
        peer = self.heap.peer(self.kv, self.peer_pe)
        table = build_dst_table(self.kv[0], [peer[0]])
        prepared = prepare_append_push(self.kv, plan.append_slots, [peer], plan.push_slots,
                                       np.zeros(PUSH_TOKENS, np.int32))

        def one_shot(layer: int) -> None:
            append_push_kv(self.ks[layer], self.vs[layer], self.kv[layer], slots, [peer[layer]], dst_slots,
                           dst_index, dst_table=table, check_indices=False)

        def fused() -> None:
            for layer in range(LAYERS):
                one_shot(layer)
            torch.cuda.synchronize()

        def fused_prepared() -> None:
            for layer in range(LAYERS):
                prepared(layer, self.ks[layer], self.vs[layer])
            torch.cuda.synchronize()

        def pages() -> None:
            copy_slots(self.kv, slots, peer, dst_slots, check_indices=False)
            torch.cuda.synchronize()

        graph = torch.cuda.CUDAGraph()
        fused()
        with torch.cuda.graph(graph):
            for layer in range(LAYERS):
                append_push_kv(self.ks[layer], self.vs[layer], self.kv[layer], slots, [peer[layer]], dst_slots,
                               dst_index, dst_table=table, check_indices=False)

        def replay() -> None:
            graph.replay()
            torch.cuda.synchronize()

        return {"fused_kernel": timed(fused, iters), "fused_kernel_graph": timed(replay, iters),
                "fused_kernel_prepared": timed(fused_prepared, iters), "copy_slots_pages": timed(pages, iters),
                "one_shot_host": _host_per_layer(one_shot, iters),
                "prepared_host": _host_per_layer(lambda layer: prepared(layer, self.ks[layer], self.vs[layer]),
                                                 iters)}

    def anchor_copy(self, iters: int) -> float:
        """Seconds for a contiguous 1 GiB `copy_` into the peer's memory (the anchor)."""
        src = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device="cuda")
        dst = self.heap.peer(self.anchor, self.peer_pe)

        def once() -> None:
            dst.copy_(src)
            torch.cuda.synchronize()

        return timed(once, iters)

    def rows_256b(self, iters: int) -> float:
        """Seconds to move the same request as one 256-byte row per (token, K/V, head)."""
        plan = scattered_plan(PUSH_TOKENS, seq_id=1, seed=0)
        slots = torch.from_numpy(plan.push_slots.astype(np.int64)).cuda()
        page_row = (slots // PAGE) * (2 * HEADS * PAGE) + slots % PAGE  # [T] row of (K, head 0)
        heads = torch.arange(HEADS, device="cuda") * PAGE
        rows_k = (page_row[:, None] + heads[None, :]).reshape(-1)
        rows_v = rows_k + HEADS * PAGE
        peer_kv = self.heap.peer(self.kv, self.peer_pe)

        def once() -> None:
            for layer in range(LAYERS):
                dst = peer_kv[layer].view(-1, DIM)
                dst.index_copy_(0, rows_k, self.ks[layer].view(-1, DIM))
                dst.index_copy_(0, rows_v, self.vs[layer].view(-1, DIM))
            torch.cuda.synchronize()

        return timed(once, iters)

    def nccl_layers(self, iters: int) -> float:
        """Seconds for per-layer NCCL send (rank 0) / recv (rank 1) of the request's pages."""
        import torch.distributed as dist

        plan = scattered_plan(PUSH_TOKENS, seq_id=1, seed=0)
        slots = plan.append_slots if self.rank == 0 else plan.push_slots
        pages = torch.from_numpy(slots[::PAGE] // PAGE).long().cuda()
        buf = torch.empty((len(pages), 2, HEADS, PAGE, DIM), dtype=torch.bfloat16, device="cuda")

        def once() -> None:
            for layer in range(LAYERS):
                if self.rank == 0:
                    torch.index_select(self.kv[layer], 0, pages, out=buf)
                    dist.send(buf, dst=1)
                else:
                    dist.recv(buf, src=0)
                    self.kv[layer].index_copy_(0, pages, buf)
            torch.cuda.synchronize()

        return timed(once, iters)

    # ------------------------------------------------------------------ doorbell latency
    def pingpong_host(self, rounds: int) -> float:
        """One-way seconds: ring the peer on a stream, the peer's host polls, rings back."""
        stream = torch.cuda.Stream()
        self.heap.barrier()
        start = time.perf_counter()
        for i in range(1, rounds + 1):
            if self.rank == 0:
                self.heap.set_signal_async(PING_WORD, i, self.peer_pe, stream)
                self.heap.wait_signal(PING_WORD, i, timeout_s=10)
            else:
                self.heap.wait_signal(PING_WORD, i, timeout_s=10)
                self.heap.set_signal_async(PING_WORD, i, self.peer_pe, stream)
        return (time.perf_counter() - start) / (2 * rounds)

    def pingpong_device_enqueue(self, rounds: int) -> None:
        """Queue ``rounds`` device-side ping-pongs behind a gate (rank 0 opens it)."""
        self._pp_stream = torch.cuda.Stream()
        s = self._pp_stream
        if self.rank == 0:
            self.heap.wait_signal_async(GATE_WORD, 1, s)
        for i in range(1, rounds + 1):
            if self.rank == 0:
                self.heap.set_signal_async(PONG_WORD, i, self.peer_pe, s)
                self.heap.wait_signal_async(PONG_WORD, i, s)
            else:
                self.heap.wait_signal_async(PONG_WORD, i, s)
                self.heap.set_signal_async(PONG_WORD, i, self.peer_pe, s)

    def pingpong_device_run(self, rounds: int) -> float:
        start = time.perf_counter()
        if self.rank == 0:
            self.heap.set_signal_async(GATE_WORD, 1, self.rank, torch.cuda.Stream())
        self._pp_stream.synchronize()
        return (time.perf_counter() - start) / (2 * rounds)

    # ------------------------------------------------------------------ overlap
    def overlap(self, variant: str, tickets: list, iters: int) -> float:
        """Seconds of a 32-layer 8B-sized prefill of 4096 tokens on rank 0 (rank 1: NCCL recvs).

        Variants: ``local`` (append_kv only: the anchor), ``push`` (KVPusher, attention waits for
        each layer's write as a real model's paged attention must), ``push_nowait`` (no wait:
        attention over the new K/V directly, as for a prompt without a cached prefix),
        ``push_caller_stream`` (the local append on the compute stream, the receivers' stores on
        the transfer stream: paged attention needs no wait), ``nccl`` (local append + each layer's pages sent with NCCL on a side
        stream, received and scattered by rank 1).
        """
        plan = scattered_plan(PREFILL_TOKENS, seq_id=2, seed=1)
        pages = torch.from_numpy((plan.append_slots if self.rank == 0 else plan.push_slots)[::PAGE] // PAGE)
        pages = pages.long().cuda()
        buf = torch.empty((len(pages), 2, HEADS, PAGE, DIM), dtype=torch.bfloat16, device="cuda")
        if self.rank == 1:
            assert variant == "nccl", "rank 1 only takes part in the NCCL variant"
            return timed(lambda: self._recv_layers(buf, pages), iters)
        step = _PrefillStep(self, variant, plan, pages, buf, list(tickets))
        return timed(step.run, iters)

    def _recv_layers(self, buf: torch.Tensor, pages: torch.Tensor) -> None:
        import torch.distributed as dist
        for layer in range(LAYERS):
            dist.recv(buf, src=0)
            self.kv[layer].index_copy_(0, pages, buf)
        torch.cuda.synchronize()

    def close(self) -> None:
        import torch.distributed as dist
        dist.destroy_process_group()
        self.heap.close()


class _PrefillStep:
    """One synthetic 8B prefill of 4096 tokens with the KV written the way ``variant`` says."""

    def __init__(self, worker: BenchWorker, variant: str, plan, pages: torch.Tensor,
                 buf: torch.Tensor, tickets: list) -> None:
        from disagg.transfer import KVPusher

        self.worker, self.variant, self.plan, self.pages, self.buf = worker, variant, plan, pages, buf
        self.tickets = tickets
        self.weights = _weights()
        self.slots = torch.from_numpy(plan.append_slots).cuda()
        self.pusher = KVPusher(worker.heap, worker.kv, append_on_caller_stream=variant == "push_caller_stream")
        self.side = torch.cuda.Stream()
        self.x0 = torch.randn(PREFILL_TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def run(self) -> None:
        pushing = self.variant.startswith("push")
        if pushing:
            self.pusher.attach_doorbell(2, self.tickets.pop())
            self.pusher.begin_forward(self.plan)
        x = self.x0
        for layer in range(LAYERS):
            x = self.layer(layer, x)
        if pushing:
            self.pusher.end_forward()
        self.side.synchronize()
        self.pusher.synchronize()
        torch.cuda.synchronize()

    def layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.nn.functional as F

        from disagg.kernels import append_kv

        w = self.weights
        qkv = x @ w["qkv"]
        q = qkv[:, :HIDDEN].view(-1, Q_HEADS, DIM)
        k = qkv[:, HIDDEN:HIDDEN + HEADS * DIM].view(-1, HEADS, DIM)
        v = qkv[:, HIDDEN + HEADS * DIM:].view(-1, HEADS, DIM)
        if self.variant.startswith("push"):
            self.pusher.push_layer_async(layer, k, v)
            if self.variant != "push_nowait":
                self.pusher.wait_layer(layer)  # a no-op with push_caller_stream
        else:
            append_kv(k, v, self.worker.kv[layer], self.slots, check_indices=False)
        if self.variant == "nccl":
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                torch.index_select(self.worker.kv[layer], 0, self.pages, out=self.buf)
                dist.send(self.buf, dst=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        x = o[0].transpose(0, 1).reshape(-1, HIDDEN) @ w["o"]
        h = x @ w["gate_up"]
        return (F.silu(h[:, :FFN]) * h[:, FFN:]) @ w["down"]


def _profile_forwards(forward, pusher, count: int) -> list[str]:
    """cProfile of ``count`` forwards' host calls (the GPU drained between them, outside the
    profile): the 40 functions of highest cumulative time, in microseconds per forward (the
    profiler's own overhead inflates these; compare them with each other)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(count):
        profiler.enable()
        forward()
        profiler.disable()
        pusher.synchronize()
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][3])[:40]
    per = 1e6 / count
    return [f"{ct * per:9.1f} cum {tt * per:9.1f} own {nc / count:6.1f} calls  {Path(file).name}:{line}({name})"
            for (file, line, name), (_, nc, tt, ct, _) in rows]


def _host_per_layer(launch, iters: int) -> float:
    """Median host seconds of one ``launch(layer)`` call, over ``iters`` loops of all layers
    (the GPU is idle at each loop's start, so the launch queue never makes the host wait)."""
    times = []
    for _ in range(iters + 1):
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            start = time.perf_counter()
            launch(layer)
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[LAYERS:])


def _contiguous(plan):
    """The plan with both sides' pages made consecutive (one run per layer)."""
    import dataclasses
    consecutive = np.arange(plan.num_tokens, dtype=np.int32)
    return dataclasses.replace(plan, append_slots=consecutive, push_slots=consecutive)


def _with_slots(plan, local: np.ndarray, remote: np.ndarray):
    """A one-sequence plan over ``len(local)`` tokens at these local and remote slots."""
    import dataclasses
    n = len(local)
    i32 = np.int32
    return dataclasses.replace(
        plan, qo_indptr=np.array([0, n], i32), page_indptr=np.array([0, n // PAGE], i32),
        page_indices=np.zeros(n // PAGE, i32), append_slots=np.asarray(local, i32),
        positions=np.arange(n, dtype=i32), push_slots=np.asarray(remote, i32),
        push_pes=np.ones(n, i32))


def demo_pattern_slots(order: str) -> tuple[np.ndarray, np.ndarray]:
    """Slots of a DEMO_TOKENS request in a PAGES-page cache that served the demo's pattern
    (requests of 88, 53 and 44 pages in turn, the demo's 40,000/24,000/20,000 tokens scaled to
    this cache, until full; every other one finished), pages handed out in ``order``
    ("runs": the cache's; "tvm_stack": TVM's free stack, `bench_cache.TvmStackPool`). The same
    pattern on both sides: (local, remote)."""
    from bench_cache import new_cache  # benchmarks/ is sys.path[0] when run as a script

    cache = new_cache(PAGES, order)
    sizes, seq_id = (88 * PAGE, 53 * PAGE, 44 * PAGE), 0
    while cache.num_free_pages * PAGE >= sizes[seq_id % 3]:
        cache.add_sequence(seq_id)
        cache.disagg_prepare_recv(seq_id, sizes[seq_id % 3])
        cache.end_forward()
        seq_id += 1
    for finished in range(1, seq_id, 2):
        cache.remove_sequence(finished)
    cache.add_sequence(seq_id)
    cache.disagg_prepare_recv(seq_id, DEMO_TOKENS)
    cache.end_forward()
    slots = cache.slots(seq_id).astype(np.int32)
    return slots, slots.copy()


def _weights() -> dict[str, torch.Tensor]:
    """One layer's weights of an 8B Llama (shared by the 32 layers: same FLOPs)."""
    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) / rows ** 0.5
    return {"qkv": w(HIDDEN, HIDDEN + 2 * HEADS * DIM), "o": w(HIDDEN, HIDDEN),
            "gate_up": w(HIDDEN, 2 * FFN), "down": w(FFN, HIDDEN)}


def measure(pair: list, iters: int) -> dict:
    """Run every measurement on the two workers; return raw seconds (and the device name)."""
    import ray

    def both(method: str, *per_rank_args, timeout: float = 300.0) -> list:
        return ray.get([getattr(a, method).remote(*args) for a, args in zip(pair, per_rank_args)], timeout=timeout)

    def on(rank: int, method: str, *args, timeout: float = 300.0):
        return ray.get(getattr(pair[rank], method).remote(*args), timeout=timeout)

    n = iters
    uid, port = on(0, "new_uid"), on(0, "free_port")
    t = {"device": both("setup", (uid, 0, port), (uid, 1, port))[0]}
    tickets = on(1, "arm", 2 * BenchWorker.tickets_for_push(n, BACK_TO_BACK, True) + 8 * (n + 1) + 4)
    t["anchor"] = on(0, "anchor_copy", n)
    used = BenchWorker.tickets_for_push(n, BACK_TO_BACK, True)
    push = on(0, "push_bandwidth", tickets[:used], False, False, n, BACK_TO_BACK, True)
    tickets = tickets[used:]
    t["push"], t["push_host"], t["push_layer_host"] = push["total"], push["host"], push["layer_host"]
    t["push_steady"], t["push_begin"] = push["steady"], push["begin"]
    split = on(0, "push_bandwidth", tickets[:used - PROFILED_FORWARDS], False, False, n, BACK_TO_BACK, False, True)
    tickets = tickets[used - PROFILED_FORWARDS:]
    t["push_steady_caller_stream"] = split["steady"]
    profile = push["profile"]
    t["rows"] = on(0, "rows_256b", n)
    t.update(on(0, "kernels_only", n))
    t["segments"] = on(0, "push_bandwidth", tickets[0:2], True, False, 1)["total"]
    t["segments_contiguous"] = on(0, "push_bandwidth", tickets[2:4], True, True, 1)["total"]
    for i, order in enumerate(("tvm_stack", "runs")):  # the last 4 tickets
        got = on(0, "push_bandwidth", tickets[len(tickets) - 4 + 2 * i:len(tickets) - 2 + 2 * i or None],
                 True, False, 1, 0, False, False, demo_pattern_slots(order))
        t[f"segments_demo_{order}"] = got["total"]
    t["nccl"] = both("nccl_layers", (n,), (n,))[0]
    t["host_latency"] = both("pingpong_host", (200,), (200,))[0]
    both("pingpong_device_enqueue", (500,), (500,))
    t["device_latency"] = both("pingpong_device_run", (500,), (500,))[0]
    rest = tickets[4:]
    t["base"] = on(0, "overlap", "local", [], n)
    t["with_push"] = on(0, "overlap", "push", rest[:n + 1], n)
    t["with_push_free"] = on(0, "overlap", "push_nowait", rest[n + 1:2 * n + 2], n)
    t["with_push_caller_stream"] = on(0, "overlap", "push_caller_stream", rest[2 * n + 2:3 * n + 3], n)
    t["with_nccl"] = both("overlap", ("nccl", [], n), ("nccl", [], n))[0]
    both("close", (), ())
    t["profile"] = profile
    return t


def report(t: dict) -> dict:
    """Seconds -> the JSON result, with the table (metric, ours, anchor, ratio, target)."""
    gbps = lambda seconds: GiB / seconds / 1e9  # noqa: E731
    anchor, base = gbps(t["anchor"]), t["base"] * 1e3
    demo = DEMO_TOKENS / PUSH_TOKENS  # those rows move this fraction of a GiB
    gpu_layer_us = t["fused_kernel_graph"] / LAYERS * 1e6  # what the host must stay under
    rows = [("push 1 GiB scattered over 16-token pages, 32 layers, forwards back to back (GB/s)",
             gbps(t["push_steady"]), anchor, ">= 0.90"),
            ("  the same, one forward from an idle GPU, host work on the clock (GB/s)", gbps(t["push"]), anchor,
             "diagnosis"),
            ("  the same back to back, local append on the caller's stream (GB/s)",
             gbps(t["push_steady_caller_stream"]), anchor, ">= 0.90"),
            ("  begin_forward host time vs the forward's GPU time (us)", t["push_begin"] * 1e6,
             t["fused_kernel_graph"] * 1e6, "diagnosis"),
            ("  push_layer_async host time per layer vs GPU time per layer (us)", t["push_layer_host"] * 1e6,
             gpu_layer_us, "< 1 (host ahead of GPU)"),
            ("  prepared append_push_kv launch, host per layer (us)", t["prepared_host"] * 1e6, gpu_layer_us,
             "diagnosis"),
            ("  one-shot append_push_kv launch, host per layer (us)", t["one_shot_host"] * 1e6, gpu_layer_us,
             "diagnosis"),
            ("  fused append_push_kv kernels alone, one-shot launcher (GB/s)", gbps(t["fused_kernel"]), anchor,
             "diagnosis"),
            ("  fused append_push_kv kernels alone, prepared launcher (GB/s)", gbps(t["fused_kernel_prepared"]),
             anchor, "diagnosis"),
            ("  the same 32 launches replayed as one CUDA graph (GB/s)", gbps(t["fused_kernel_graph"]), anchor,
             "diagnosis"),
            ("  copy_slots page to page into the peer, all layers (GB/s)", gbps(t["copy_slots_pages"]), anchor,
             "diagnosis"),
            ("same bytes as 256-byte rows, torch index_copy_ (GB/s)", gbps(t["rows"]), anchor, "comparison"),
            ("forced segment puts, scattered pages (GB/s)", gbps(t["segments"]), anchor, "comparison"),
            ("forced segment puts, contiguous pages (GB/s)", gbps(t["segments_contiguous"]), anchor, "comparison"),
            ("forced segment puts, 4096 tok on pages the cache hands out after the demo pattern, "
             "TVM stack order (GB/s)", demo * gbps(t["segments_demo_tvm_stack"]), anchor, "comparison"),
            ("forced segment puts, the same, run order (disagg.pages) (GB/s)",
             demo * gbps(t["segments_demo_runs"]), anchor, "comparison"),
            ("NCCL send/recv per layer per request (GB/s)", gbps(t["nccl"]), anchor, "comparison"),
            ("prefill 4096 tok + push, attention waits per layer (ms)", t["with_push"] * 1e3, base, "<= 1.03"),
            ("prefill 4096 tok + push, no wait (ms)", t["with_push_free"] * 1e3, base, "<= 1.03"),
            ("prefill 4096 tok + push, local append on the compute stream (ms)", t["with_push_caller_stream"] * 1e3,
             base, "<= 1.03"),
            ("prefill 4096 tok + NCCL send per layer (ms)", t["with_nccl"] * 1e3, base, "comparison")]
    return {
        "device": t["device"],
        "workload": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "page_size": PAGE, "dtype": "bfloat16",
                     "push_tokens": PUSH_TOKENS, "push_bytes": GiB, "prefill_tokens": PREFILL_TOKENS},
        "anchors": {"bandwidth": "contiguous 1 GiB peer copy_ (same run)",
                    "prefill": "same loop with local append_kv only"},
        "doorbell_one_way_us": {"host_polled": t["host_latency"] * 1e6, "device_waited": t["device_latency"] * 1e6},
        "push_host_us_per_layer": t["push_host"] / LAYERS * 1e6,
        "push_layer_async_host_us": t["push_layer_host"] * 1e6,
        "table": [{"metric": m, "ours": ours, "anchor": ref, "ratio": ours / ref, "target": target}
                  for m, ours, ref, target in rows],
        "seconds": {k: v for k, v in t.items() if k not in ("device", "profile")},
        "host_profile_of_five_forwards": t["profile"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_transfer.json"))
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    import ray

    ray.init(num_gpus=2, include_dashboard=False,
             runtime_env={"env_vars": dict(GPU_ENV, PYTHONPATH=os.environ.get("PYTHONPATH", ""))})
    worker = ray.remote(num_gpus=1)(BenchWorker)
    try:
        result = report(measure([worker.remote() for _ in range(2)], args.iters))
    finally:
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
