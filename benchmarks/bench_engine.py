"""Benchmark the engines' forward paths on one GPU; every figure comes with an anchor from the same run.

    python3 benchmarks/bench_engine.py --out results/bench_engine.json           # dummy:llama3-8b bf16
    python3 benchmarks/bench_engine.py --model dummy:tiny --device cpu            # CPU smoke check
    python3 benchmarks/bench_engine.py --batches 1,64 --contexts 1024 \
        --variants 'base;DISAGG_LINEAR=cublas;DISAGG_ROPE_APPEND=0;DISAGG_LAYER_PDL=1'   # A/B

Rows (ours / anchor = ratio, target):
- decode_B{b}_ctx{c}: one decode step replayed from its CUDA graph (plan copy-in included, back
  to back) / the memory bound: (weight bytes + KV bytes read) / the device-to-device copy
  bandwidth (bytes read + written) measured here. Target <= 1.25 at B=64 x 1024. Cases whose KV
  does not fit the free memory are reported as skipped. For attribution each row also carries
  the model's projections alone (cuBLAS GEMMs of every layer + LM head, in a graph) against the
  weights-only bound.
- decode_idle_B64[_async]: GPU idle per step of `DecodeEngine.step()` in steady state (host work
  not hidden behind the GPU) = (engine step period - the same step's GPU time back to back) / the
  period. Target <= 0.05. The decode engine runs over a one-PE local heap (doorbells rung here);
  `_async`: with `async_scheduling=True` (the next step launched before this one's tokens are read).
- prefill_8x2048: model TFLOP/s of one 8 x 2048-token prefill forward / a 8192^3 matmul's
  TFLOP/s in the model dtype. Target >= 0.6.
- mixed_chunk2048_dec64: one forward of a 2048-token chunk + 64 decodes (ctx 1024) / (the chunk
  alone + the 64 decodes alone from their graph). Below 1: mixing saves the decodes' weight reads.
- colocated_idle_B64[_async]: the same for `ColocatedEngine` decode-only steps (the baseline's
  host time; it reserves the next step during this one as the decode engine does).
- projections_B64_variants: the model's GEMMs alone under cuBLAS, the model's own choice
  (`DISAGG_LINEAR`, default auto: the skinny kernel for the LM head only), cuBLASLt, transposed
  weights and the skinny Triton GEMM (`disagg.kernels.linear`) for every weight, each against the
  weights-only bound. A/B of the model's choices as decode rows: `--variants`.
- short_p{n}_dec{d}_{piecewise,full}: a step of an n-token prompt beside d decodes (ctx 1024), the step a cached or
  short prompt costs: its period back to back / the pure-decode graph step of the same d decodes;
  `host_ms` is `execute()`'s host time with the GPU idle (over the period: the step is
  host-bound); `piecewise` rows run the prompt graphs, `full` ones the whole-forward mixed graphs
  (`scheduler.cuda_graphs: full`). `--host-profile` adds cProfile's top functions of those calls.
- cold/warm: the first forward of each kind (kernel compilation) vs the next; graph capture
  seconds for every bucket up to 256 at context 1024.

`--tensor-parallel N`: only the decode step at B=64 x 1024 and the 8 x 2048 prefill at TP=N
against TP=1 of the same model, one run, one process per rank on N GPUs
(`benchmarks/bench_tensor_parallel.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from disagg.engine import ColocatedEngine, DecodeEngine, EngineOptions
from disagg.kernels.linear import linear as skinny_linear
from disagg.model import layers, load_model
from disagg.sampling import SamplingParams
from disagg.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path (tests): its kit beside it
from forward_bench import GiB, PAGE_SIZE, Bench, kv_bytes_per_token, sync, timed  # noqa: E402

GROUPS = ("cold", "decode", "prefill", "mixed", "short", "projections", "idle")


class LocalHeap:
    """A one-PE stand-in for `SymmetricHeap` (plain device memory, host signal words), enough for a
    DecodeEngine whose doorbells the benchmark rings itself."""

    backend = "shm"  # its engine's KV connector: the symmetric heaps' (`disagg.transfer.registry`)

    def __init__(self, device: torch.device, num_signals: int = 1024) -> None:
        self.rank, self.world_size, self.device, self.num_signals = 0, 1, device, num_signals
        self.signals = np.zeros(num_signals, dtype=np.int64)
        self.closed = False

    def alloc(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def read_signal(self, index: int) -> int:
        return int(self.signals[index])

    def read_signals(self) -> np.ndarray:
        return self.signals.copy()


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = min(timed(lambda: dst.copy_(src), 5, device) for _ in range(3))
    return 2 * num_bytes / seconds


def weight_bytes(model) -> int:
    """Bytes a decode step reads from weights: every layer, the final norm and the LM head."""
    c, size = model.config, model.dtype.itemsize
    q, kv = c.num_qo_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = (q + 2 * kv) * c.hidden_size + c.hidden_size * q + 3 * c.intermediate_size * c.hidden_size
    return (c.num_layers * (layer + 2 * c.hidden_size) + c.vocab_size * c.hidden_size + c.hidden_size) * size


def prefill_flops(model, lengths: list[int]) -> float:
    """2 x (parameters touched) x tokens + causal attention (QK^T and PV)."""
    c = model.config
    q, kv = c.num_qo_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token = c.num_layers * ((q + 2 * kv) * c.hidden_size + c.hidden_size * q + 3 * c.intermediate_size * c.hidden_size)
    attn = sum(4 * c.num_layers * q * s * (s + 1) / 2 for s in lengths)
    return 2.0 * per_token * sum(lengths) + attn + 2.0 * c.vocab_size * c.hidden_size * len(lengths)


def linear_seconds(model, batch: int, backend: str | None = None) -> float:
    """The model's projections alone (every layer's GEMMs and the LM head) for ``batch`` rows,
    replayed from a CUDA graph: the share of a decode step that is weight reads. ``backend``:
    None runs `layers.linear` (what the model chooses under `DISAGG_LINEAR` and `DISAGG_BLAS`
    outside small-batch graphs), "cublas" torch's `F.linear`, "triton" the skinny kernel
    (`disagg.kernels.linear`) for every weight."""
    linear = {None: layers.linear, "cublas": torch.nn.functional.linear,
              "triton": skinny_linear}[backend]
    w = model.weights
    c = model.config
    x = torch.randn(batch, c.hidden_size, dtype=model.dtype, device=model.device)
    xq = torch.randn(batch, c.num_qo_heads * c.head_dim, dtype=model.dtype, device=model.device)
    xi = torch.randn(batch, c.intermediate_size, dtype=model.dtype, device=model.device)

    def run() -> None:
        for layer in w.layers:
            linear(x, layer.qkv)
            linear(xq, layer.o_proj)
            linear(x, layer.gate_up)
            linear(xi, layer.down)
        linear(x, w.lm_head)

    if model.device.type != "cuda":
        return timed(run, 3, model.device)
    blas = layers.preferred_blas(model.device, batch) if backend is None else contextlib.nullcontext()
    with blas:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    return timed(graph.replay, 10, model.device)


def projection_variants_row(model, batch: int, bandwidth: float) -> dict:
    """The projections alone (as `linear_seconds`) under other GEMM choices, against the
    weights-only bound: cuBLAS (torch's default), cuBLASLt (`preferred_blas_library`), and the
    weights stored transposed (`x @ W_t`, an "NN" GEMM). Says whether another choice closes the
    decode step's gap to its memory bound. GPU only (needs the weights' bytes again, free)."""
    bound = weight_bytes(model) / bandwidth
    row = {"name": f"projections_B{batch}_variants", "anchor_us": bound * 1e6,
           "anchor": "weights-only bound: weight bytes / copy bandwidth"}
    if model.device.type != "cuda":
        row["skipped"] = "GPU only"
        return row
    row["cublas_us"] = linear_seconds(model, batch, "cublas") * 1e6
    row["model_us"] = linear_seconds(model, batch) * 1e6
    row["model_linear"] = layers.linear_backend()
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_us"] = linear_seconds(model, batch, "cublas") * 1e6
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    w, c = model.weights, model.config
    x = torch.randn(batch, c.hidden_size, dtype=model.dtype, device=model.device)
    xq = torch.randn(batch, c.num_qo_heads * c.head_dim, dtype=model.dtype, device=model.device)
    xi = torch.randn(batch, c.intermediate_size, dtype=model.dtype, device=model.device)
    transposed = [(l.qkv.t().contiguous(), l.o_proj.t().contiguous(), l.gate_up.t().contiguous(),
                   l.down.t().contiguous()) for l in w.layers]
    head = w.lm_head.t().contiguous()

    def run() -> None:
        for qkv, o, gate_up, down in transposed:
            x @ qkv
            xq @ o
            x @ gate_up
            xi @ down
        x @ head

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    row["weight_t_us"] = timed(graph.replay, 10, model.device) * 1e6
    del transposed, head, graph
    torch.cuda.empty_cache()
    row["triton_us"] = linear_seconds(model, batch, "triton") * 1e6
    for key in ("cublas", "model", "cublaslt", "weight_t", "triton"):
        row[f"{key}_ratio"] = row[f"{key}_us"] / row["anchor_us"]
    return row


def decode_rows(bench: Bench, batches, contexts, bandwidth: float, free_bytes: int) -> list[dict]:
    rows = []
    model = bench.model
    for b in batches:
        linear = linear_seconds(model, b)  # as the model chooses
        for ctx in contexts:
            kv_read = b * ctx * kv_bytes_per_token(model, model.dtype)
            name = f"decode_B{b}_ctx{ctx}"
            if -(-ctx // PAGE_SIZE) * b > bench.num_pages:
                rows.append({"name": name, "skipped": f"needs {kv_read / GiB:.1f} GiB of KV, "
                                                       f"{free_bytes / GiB:.1f} GiB free"})
                continue
            plan, reqs = bench.plan([ctx - 1] * b, [1] * b)
            ids = torch.ones(b, dtype=torch.int64, device=bench.device)
            graphs = bench.runner.graphs
            run = (lambda: graphs.run(plan, ids)) if graphs else (lambda: bench.forward(plan, reqs))
            seconds = timed(run, 20, bench.device)
            bound = (weight_bytes(model) + kv_read) / bandwidth
            rows.append({"name": name, "ours_us": seconds * 1e6, "anchor_us": bound * 1e6,
                         "ratio": seconds / bound, "target": "<= 1.25 at B=64 x 1024",
                         "anchor": "memory bound: (weights + KV bytes) / copy bandwidth",
                         "projections_alone_us": linear * 1e6, "weights_alone_bound_us":
                         weight_bytes(model) / bandwidth * 1e6})
    return rows


def variant_decode_rows(model, variant: str, num_pages: int, batches, contexts, bandwidth: float,
                        free_bytes: int) -> list[dict]:
    """`decode_rows` with the environment settings of ``variant`` ("VAR=VALUE,..." or "base"),
    on a fresh runner (its graphs captured under them); rows named `...[variant]`. The model reads
    its DISAGG_* switches once (`disagg.settings`): they are read again here, over its own."""
    settings = {} if variant == "base" else dict(item.split("=", 1) for item in variant.split(","))
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    model_settings = model.settings
    try:
        model.settings = Settings.from_env(model_settings)
        bench = Bench(model, num_pages, max_num_seqs=max(batches))
        rows = decode_rows(bench, batches, contexts, bandwidth, free_bytes)
    finally:
        model.settings = model_settings
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    for row in rows:
        row["name"] += f"[{variant}]"
        row["env"] = settings
    del bench
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def decode_idle_row(model, batch: int, ctx: int, steps: int, async_scheduling: bool = False) -> dict:
    """Steady-state DecodeEngine step period vs the same step's GPU time back to back."""
    device = model.device
    heap = LocalHeap(device)
    num_pages = batch * -(-(ctx + steps + 16) // PAGE_SIZE)
    engine = DecodeEngine(model, heap, num_pages=num_pages, page_size=PAGE_SIZE, max_num_seqs=batch,
                          options=EngineOptions(async_scheduling=async_scheduling))
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        dest = engine.reserve(i, ctx, params)
        heap.signals[dest.ticket.index] = dest.ticket.epoch  # the "push" landed
        engine.start(i, 1)
    for _ in range(3):
        engine.step()  # admission, graph capture
    period, gpu = _idle_times(engine, engine.running, steps, device)
    name = f"decode_idle_B{batch}" + ("_async" if async_scheduling else "")
    return {"name": name, "ours_step_us": period * 1e6, "anchor_gpu_us": gpu * 1e6,
            "ratio": max(0.0, period - gpu) / period, "target": "<= 0.05",
            "anchor": "the same step's GPU time (forward from its graph + sampling) back to back"}


def _idle_times(engine, running_of, steps: int, device: torch.device) -> tuple[float, float]:
    """(steady-state step period, the same step's GPU time back to back) of a decoding engine;
    ``running_of`` is its running list (read after the steps)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    period = (time.perf_counter() - t0) / steps
    engine.async_scheduling = False
    if engine.has_work():
        engine.step()  # reads a step launched ahead (async scheduling); launches none
    running = list(running_of)
    plan = engine.cache.begin_forward([r.seq_id for r in running], [1] * len(running))
    engine.cache.end_forward()
    ids = torch.ones(len(running), dtype=torch.int64, device=device)
    rows = np.arange(len(running))
    gpu = timed(lambda: engine.runner.execute(plan, ids, rows, running), steps, device)
    return period, gpu


def colocated_idle_row(model, batch: int, ctx: int, steps: int, async_scheduling: bool = False) -> dict:
    """`decode_idle_row` for the colocated engine's decode-only steps (the baseline's host time)."""
    device = model.device
    num_pages = batch * -(-(ctx + steps + 32) // PAGE_SIZE)
    engine = ColocatedEngine(model, num_pages=num_pages, page_size=PAGE_SIZE, max_num_seqs=batch,
                             max_num_batched_tokens=8192,
                             options=EngineOptions(async_scheduling=async_scheduling))
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add(i, [1] * (ctx - 1), params)
    while engine.scheduler.waiting:
        engine.step()  # the prompts
    for _ in range(3):
        engine.step()  # graph capture
    period, gpu = _idle_times(engine, engine.scheduler.running, steps, device)
    return {"name": f"colocated_idle_B{batch}" + ("_async" if async_scheduling else ""), "ours_step_us": period * 1e6, "anchor_gpu_us": gpu * 1e6,
            "ratio": max(0.0, period - gpu) / period, "reserved_steps": engine.num_reserved_steps,
            "target": "report (the baseline's share of decode_idle)",
            "anchor": "the same step's GPU time (forward from its graph + sampling) back to back"}


def prefill_row(bench: Bench, num_seqs: int, length: int, matmul_n: int) -> dict:
    model, device = bench.model, bench.device
    plan, reqs = bench.plan([0] * num_seqs, [length] * num_seqs)
    seconds = timed(lambda: bench.forward(plan, reqs), 5, device)
    tflops = prefill_flops(model, [length] * num_seqs) / seconds / 1e12
    a = torch.randn(matmul_n, matmul_n, dtype=model.dtype, device=device)
    b = torch.randn(matmul_n, matmul_n, dtype=model.dtype, device=device)
    mm_seconds = timed(lambda: a @ b, 10, device)
    mm_tflops = 2 * matmul_n ** 3 / mm_seconds / 1e12
    return {"name": f"prefill_{num_seqs}x{length}", "ours_tflops": tflops, "anchor_tflops": mm_tflops,
            "ratio": tflops / mm_tflops, "ours_ms": seconds * 1e3, "target": ">= 0.6",
            "anchor": f"{matmul_n}^3 matmul in {model.dtype}"}


def mixed_row(bench: Bench, chunk: int, num_decodes: int, ctx: int) -> dict:
    device = bench.device
    mixed_plan, mixed_reqs = bench.plan([ctx - 1] * num_decodes + [0], [1] * num_decodes + [chunk])
    chunk_plan, chunk_reqs = bench.plan([0], [chunk])
    dec_plan, dec_reqs = bench.plan([ctx - 1] * num_decodes, [1] * num_decodes)
    mixed = timed(lambda: bench.forward(mixed_plan, mixed_reqs), 5, device)
    alone = timed(lambda: bench.forward(chunk_plan, chunk_reqs), 5, device)
    decodes = timed(lambda: bench.forward(dec_plan, dec_reqs), 10, device)
    return {"name": f"mixed_chunk{chunk}_dec{num_decodes}", "ours_ms": mixed * 1e3,
            "anchor_ms": (alone + decodes) * 1e3, "ratio": mixed / (alone + decodes),
            "chunk_alone_ms": alone * 1e3, "decodes_alone_ms": decodes * 1e3,
            "target": "report (< 1: one mixed forward beats two)", "anchor": "chunk alone + decodes alone"}


def short_rows(bench: Bench, prompts: list[int], num_decodes: int, ctx: int,
               host_profile: bool = False) -> list[dict]:
    """Steps of a short prompt beside running decodes (see the module docstring), piecewise and
    (on CUDA) from the whole-forward mixed graphs."""
    device, rows = bench.device, []
    dec_plan, dec_reqs = bench.plan([ctx - 1] * num_decodes, [1] * num_decodes)
    decodes = timed(lambda: bench.forward(dec_plan, dec_reqs), 20, device)
    modes = ["piecewise"]
    if bench.mixed_graphs is not None:
        modes.append("full")
        capture_s = bench.mixed_graphs.capture_all(ctx)
        rows.append({"name": "mixed_graphs_capture", "seconds": capture_s, "graphs": bench.mixed_graphs.num_graphs})
    for mode, prompt in ((m, p) for p in prompts for m in modes):
        bench.runner.mixed_graphs = bench.mixed_graphs if mode == "full" else None
        plan, reqs = bench.plan([ctx - 1] * num_decodes + [0], [1] * num_decodes + [prompt])
        period = timed(lambda: bench.forward(plan, reqs), 20, device)
        host = []
        for _ in range(10):
            sync(device)
            t0 = time.perf_counter()
            bench.forward(plan, reqs)
            host.append(time.perf_counter() - t0)
        sync(device)
        row = {"name": f"short_p{prompt}_dec{num_decodes}_{mode}", "ours_ms": period * 1e3,
               "anchor_ms": decodes * 1e3, "ratio": period / decodes,
               "host_ms": float(np.median(host)) * 1e3, "prompt_graph_replays": bench.runner.num_prompt_graph_replays,
               "target": "report (1.0: the prompt rides the decode step for free)",
               "anchor": f"decode graph step of {num_decodes}"}
        if host_profile:
            import cProfile
            import io
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                bench.forward(plan, reqs)
                sync(device)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            row["host_profile"] = text.getvalue()
        rows.append(row)
    bench.runner.mixed_graphs = None
    return rows


def cold_warm_rows(bench: Bench, prompt: int, capture_batches: list[int], ctx: int) -> list[dict]:
    device, rows = bench.device, []
    for name, (contexts, new) in {"prefill": ([0], [prompt]), "decode_eager": ([ctx - 1] * 4, [1] * 4)}.items():
        plan, reqs = bench.plan(contexts, new)
        times = []
        for _ in range(2):
            sync(device)
            t0 = time.perf_counter()
            if name == "decode_eager" and bench.runner.graphs is not None:
                graphs, bench.runner.graphs = bench.runner.graphs, None
                bench.forward(plan, reqs)
                bench.runner.graphs = graphs
            else:
                bench.forward(plan, reqs)
            sync(device)
            times.append(time.perf_counter() - t0)
        rows.append({"name": f"first_forward_{name}", "cold_s": times[0], "warm_s": times[1],
                     "ratio": times[0] / times[1]})
    capture = bench.runner.capture_graphs(capture_batches, ctx)
    rows.append({"name": "graph_capture", "seconds": capture, "batches": capture_batches, "context": ctx})
    return rows


def decode_profile(bench: Bench, batch: int, ctx: int, top: int = 25) -> dict:
    """Where one decode step's GPU time goes: the step's kernels under torch.profiler (eager, so
    each kernel is its own launch; graph replay runs the same kernels without the launch gaps),
    grouped by name, with the per-step sum against the graph replay time."""
    from torch.profiler import ProfilerActivity, profile

    plan, reqs = bench.plan([ctx - 1] * batch, [1] * batch)
    graphs, bench.runner.graphs = bench.runner.graphs, None
    try:
        for _ in range(3):
            bench.forward(plan, reqs)
        sync(bench.device)
        steps = 5
        gpu = bench.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                bench.forward(plan, reqs)
            sync(bench.device)
    finally:
        bench.runner.graphs = graphs
    kernels: dict[str, list[float]] = {}
    for event in prof.events():  # on CPU (a smoke check) the ops' self time stands in
        if not gpu or event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time if gpu else event.self_cpu_time_total
    total = sum(v[1] for v in kernels.values()) / steps
    rows = sorted(((name[:90], n // steps, us / steps) for name, (n, us) in kernels.items()),
                  key=lambda r: -r[2])
    ids = torch.ones(batch, dtype=torch.int64, device=bench.device)
    replay = timed(lambda: graphs.run(plan, ids), 20, bench.device) if graphs else None
    return {"name": f"profile_decode_B{batch}_ctx{ctx}", "kernel_us_per_step": total,
            "launches_per_step": sum(r[1] for r in rows),
            "graph_step_us": replay * 1e6 if replay else None,
            "top": [{"kernel": n, "per_step": c, "us": round(us, 1), "share": round(us / total, 4)}
                    for n, c, us in rows[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/bench_engine.json"))
    parser.add_argument("--profile", default=None, metavar="B,CTX",
                        help="only profile one decode step of batch B at context CTX (kernel table)")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"row groups to run, comma-separated, of {','.join(GROUPS)}")
    parser.add_argument("--variants", default=None, metavar="V1;V2;...",
                        help="only decode rows, once per variant: ';'-separated sets of "
                             "comma-separated VAR=VALUE environment settings ('base' for none), "
                             "each with a fresh runner and graphs, e.g. "
                             "'base;DISAGG_LINEAR=triton;DISAGG_LINEAR=triton,DISAGG_LAYER_PDL=1'")
    parser.add_argument("--host-profile", action="store_true",
                        help="short rows: add cProfile's top host functions (printed)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,64,256)")
    parser.add_argument("--contexts", default=None, help="decode contexts (default 1024,4096)")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="only the decode step (first of --batches x --contexts, default 64 x 1024) and "
                             "the 8 x 2048 prefill at TP=N against TP=1, N ranks on N GPUs "
                             "(benchmarks/bench_tensor_parallel.py)")
    args = parser.parse_args()
    if args.tensor_parallel is not None:
        import bench_tensor_parallel  # this script's folder is on sys.path: the spawned ranks import it too

        first = (lambda text: [] if text is None else [int(text.split(",")[0])])
        bench_tensor_parallel.main([
            "--tensor-parallel", str(args.tensor_parallel), "--model", args.model, "--device", args.device,
            "--out", str(args.out), *(["--dtype", args.dtype] if args.dtype else []),
            *(["--batch", *map(str, first(args.batches))] if args.batches else []),
            *(["--context", *map(str, first(args.contexts))] if args.contexts else [])])
        return
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    model = load_model(args.model, dtype=dtype, device=device)
    small = not gpu
    batches, contexts = ((1, 8), (64, 256)) if small else ((1, 8, 64, 256), (1024, 4096))
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.contexts:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    only = set(args.only.split(","))
    if only - set(GROUPS):
        parser.error(f"--only: expected groups of {GROUPS}, got {sorted(only - set(GROUPS))}")
    if gpu:
        torch.cuda.empty_cache()
        free_bytes = int(torch.cuda.mem_get_info(device)[0] * 0.85) - 4 * GiB
    else:
        free_bytes = 1 * GiB
    page_bytes = PAGE_SIZE * kv_bytes_per_token(model, dtype)
    needed = max(b * -(-c // PAGE_SIZE) for b in batches for c in contexts) + 8 * 2048 // PAGE_SIZE + 64
    num_pages = int(min(needed, free_bytes // page_bytes))
    bench = Bench(model, num_pages, max_num_seqs=max(batches))
    result = {"model": args.model, "dtype": str(dtype), "device": torch.cuda.get_device_name(device) if gpu else "cpu",
              "num_pages": num_pages, "page_size": PAGE_SIZE, "linear": model.settings.linear,
              "fused_layers": layers.use_fused(torch.empty(1, device=device)),
              "rope_append": model.settings.rope_append,
              "layer_pdl": {True: "1", False: "0"}.get(model.settings.layer_pdl, "auto"),
              "blas": model.settings.blas, "rows": []}
    rows = result["rows"]
    if args.variants:
        bandwidth = copy_bandwidth(device, (256 << 20) if small else 4 * GiB)
        result["copy_bandwidth_GBps"] = bandwidth / 1e9
        del bench
        for variant in args.variants.split(";"):
            rows += variant_decode_rows(model, variant, num_pages, batches, contexts, bandwidth,
                                        free_bytes)
            for row in rows[-len(batches) * len(contexts):]:
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        return
    if args.profile:
        b, ctx = (int(v) for v in args.profile.split(","))
        if bench.runner.graphs is not None:
            bench.runner.capture_graphs([b], ctx)
        row = decode_profile(bench, b, ctx)
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in row.items() if k != "top"}))
        for entry in row["top"]:
            print(f"{entry['us']:10.1f} us {entry['share']:6.1%} x{entry['per_step']:<4d} {entry['kernel']}")
        return
    if "cold" in only:
        rows += cold_warm_rows(bench, 128 if small else 2048, list(batches), contexts[0])
    bandwidth = copy_bandwidth(device, (256 << 20) if small else 4 * GiB)
    result["copy_bandwidth_GBps"] = bandwidth / 1e9
    if "decode" in only:
        rows += decode_rows(bench, batches, contexts, bandwidth, free_bytes)
    if "prefill" in only:
        rows.append(prefill_row(bench, 2 if small else 8, 128 if small else 2048, 512 if small else 8192))
    if "mixed" in only:
        rows.append(mixed_row(bench, 128 if small else 2048, 8 if small else 64, contexts[0]))
    if "short" in only:
        rows += short_rows(bench, [8, 128] if small else [8, 128, 512], 8 if small else 24, contexts[0],
                           args.host_profile)
    del bench
    if gpu:
        torch.cuda.empty_cache()
    if "projections" in only:
        try:  # the skinny variant is new: a failure must not lose the rows above
            rows.append(projection_variants_row(model, 1 if small else 64, bandwidth))
        except Exception as exc:  # noqa: BLE001 - reported in the row
            rows.append({"name": "projections_variants", "error": repr(exc)[:300]})
    steps = 10 if small else 100
    if "idle" in only:
        for async_scheduling in (False, True):
            rows.append(decode_idle_row(model, 8 if small else 64, contexts[0], steps, async_scheduling))
        for async_scheduling in (False, True):
            rows.append(colocated_idle_row(model, 8 if small else 64, contexts[0], steps, async_scheduling))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for row in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "host_profile"}))
        if "host_profile" in row:
            print(row["host_profile"])


if __name__ == "__main__":
    main()
