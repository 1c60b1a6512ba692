"""Engines on GPUs: CUDA-graph decode equals eager (one GPU); prefill engine on GPU 0 and decode
engine on GPU 1 over NVSHMEM (two Ray actors) equals the colocated engine.

Run on a GPU host from the project root (after ``source .whl/gpu-env.sh``):
``python3 -m pytest -q -m "gpu or multigpu" tests/engine/test_engine_gpu.py``.
The model is the SmolLM2-135M shape with seeded random weights in float32, so that different
split counts and batch paddings cannot flip a greedy token on a near tie.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_helpers import assert_all_free, drain

from disagg.sampling import SamplingParams

SOURCE = "dummy:smollm2-135m"
PROMPTS = {f"r{i}": [(37 * i + 11 * j) % 49000 + 5 for j in range(n)]
           for i, n in enumerate([3, 70, 129, 17, 1, 250, 33])}
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, seed=5, ignore_eos=True)
GPU_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _colocated_tokens(model, use_cuda_graphs: bool, max_num_seqs: int = 8,
                      async_scheduling: bool = False, mixed_graphs: bool | None = False) -> tuple[dict, dict]:
    from disagg.engine import ColocatedEngine, EngineOptions

    engine = ColocatedEngine(model, num_pages=256, page_size=16, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=128, options=EngineOptions(
                                 use_cuda_graphs=use_cuda_graphs, async_scheduling=async_scheduling,
                                 mixed_graphs=mixed_graphs))
    if use_cuda_graphs:
        seconds = engine.warmup(max_kv_len=512)
        assert seconds["graphs"] > 0 and engine.runner.graphs.capture_seconds > 0
        assert_all_free(engine)
    for rid, prompt in PROMPTS.items():
        engine.add(rid, prompt, SEEDED if rid == "r3" else PARAMS)
    results = drain(engine)
    assert_all_free(engine)
    return {rid: r["tokens"] for rid, r in results.items()}, engine.stats()


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager():
    """Colocated: graphs (decode graphs and the piecewise prompt graphs; with reserved decode-only
    steps, then with async scheduling) equal eager."""
    import torch

    from disagg.model import load_model

    model = load_model(SOURCE, dtype=torch.float32, device="cuda")
    eager, eager_stats = _colocated_tokens(model, use_cuda_graphs=False)
    graphs, graph_stats = _colocated_tokens(model, use_cuda_graphs=True)
    assert eager_stats["num_graph_replays"] == eager_stats["num_prompt_graph_replays"] == 0
    assert graph_stats["num_graph_replays"] > 10  # batches of 1..7 decodes, padded to 1/2/4/8
    assert graph_stats["num_prompt_graph_replays"] >= 5  # prompt chunks and mixed steps, piecewise
    assert graphs == eager
    assert graph_stats["num_reserved_steps"] > 0  # decode-only steps reuse the plan reserved ahead
    ahead, ahead_stats = _colocated_tokens(model, use_cuda_graphs=True, async_scheduling=True)
    assert ahead_stats["num_steps_ahead"] > 0
    assert ahead == eager


@pytest.mark.gpu
def test_mixed_graphs_equal_eager():
    """Colocated with whole-forward graphs of prompt and mixed steps (``cuda_graphs: full``), with
    and without async scheduling: the eager tokens, every prompt step of <= 128 tokens replayed."""
    import torch

    from disagg.model import load_model

    model = load_model(SOURCE, dtype=torch.float32, device="cuda")
    eager, _ = _colocated_tokens(model, use_cuda_graphs=False)
    for async_scheduling in (False, True):
        full, stats = _colocated_tokens(model, use_cuda_graphs=True, mixed_graphs=True,
                                        async_scheduling=async_scheduling)
        assert stats["num_mixed_graph_replays"] >= 5 and stats["num_prompt_graph_replays"] == 0
        assert full == eager


def _prefix_waves(model, prefix_caching: bool, use_cuda_graphs: bool,
                  mixed_graphs: bool | None = False) -> tuple[list[dict], dict]:
    """Two waves of prompts sharing a 40-token system prompt (hits on a page boundary, mid page, the
    whole prompt), on 24 pages of 16 so that the second wave evicts part of the first's cache."""
    from disagg.engine import ColocatedEngine, EngineOptions

    system = [(13 * j) % 200 + 7 for j in range(40)]
    waves = [{f"w{w}q{i}": system[: 16 * (1 + i % 3) + (i % 2) * 5] + [100 * w + i + 1] * (2 + i) for i in range(6)}
             for w in range(2)]
    waves[1]["again"] = waves[0]["w0q1"]
    engine = ColocatedEngine(model, num_pages=24, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                             options=EngineOptions(use_cuda_graphs=use_cuda_graphs, async_scheduling=True,
                                                   prefix_caching=prefix_caching, mixed_graphs=mixed_graphs))
    if use_cuda_graphs:
        engine.warmup(max_kv_len=256)
    out = []
    for wave in waves:
        for rid, prompt in wave.items():
            engine.add(rid, prompt, PARAMS)
        out.append({rid: r["tokens"] for rid, r in drain(engine).items()})
        engine.cache.check_integrity()
    assert_all_free(engine)
    return out, engine.stats()


@pytest.mark.gpu
def test_prefix_cache_hits_under_graphs_equal_uncached():
    """Colocated with CUDA graphs and async scheduling: forks of cached prefixes (fork copies on the
    GPU), eviction and preemption give the tokens of an engine without prefix caching."""
    import torch

    from disagg.model import load_model

    model = load_model(SOURCE, dtype=torch.float32, device="cuda")
    cached, stats = _prefix_waves(model, prefix_caching=True, use_cuda_graphs=True)
    uncached, _ = _prefix_waves(model, prefix_caching=False, use_cuda_graphs=True)
    assert cached == uncached
    assert stats["prefix_hit_tokens"] > 0 and stats["prefix_evicted_pages"] > 0 and stats["num_graph_replays"] > 0
    full, full_stats = _prefix_waves(model, prefix_caching=True, use_cuda_graphs=True, mixed_graphs=True)
    assert full == uncached and full_stats["num_mixed_graph_replays"] > 0


@pytest.mark.multigpu
def test_prefill_and_decode_over_nvshmem_equal_colocated(gpu_share):
    """Prefill on one PE, decode on another (two GPUs, or both sharing GPU 0)."""
    ray = pytest.importorskip("ray")
    import engine_scenarios

    here = str(Path(__file__).parent)
    env = dict(GPU_ENV, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    ray.init(num_gpus=gpu_share.ray_num_gpus, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        runner = ray.remote(num_gpus=gpu_share.per_actor)(engine_scenarios.EngineRunner)
        pair = [runner.remote() for _ in range(2)]
        uid = ray.get(pair[0].new_uid.remote("nvshmem"), timeout=120)
        sizes = dict(num_pages=256, page_size=16, max_num_seqs=8, max_num_batched_tokens=128, lease_s=120.0)
        ray.get([a.run.remote("setup", dict(backend="nvshmem", uid=uid, rank=r, role=("prefill", "decode")[r],
                                            source=SOURCE, dtype="float32", sizes=sizes, heap_bytes=1 << 30))
                 for r, a in enumerate(pair)], timeout=300)

        def call_on(rank, method, args):
            return ray.get(pair[rank].run.remote("call", {"method": method, "args": args}), timeout=120)

        params = {rid: SEEDED if rid == "r3" else PARAMS for rid in PROMPTS}
        got = engine_scenarios.relay(call_on, PROMPTS, params)
        want = ray.get(pair[0].run.remote("colocated_tokens", dict(source=SOURCE, dtype="float32", prompts=PROMPTS,
                                                                   params=params, sizes=sizes)), timeout=300)
        stats = ray.get([a.run.remote("teardown", {}) for a in pair], timeout=120)
    finally:
        ray.shutdown()
    assert got == want
    for s in stats:
        assert s["free_pages"] == s["total_pages"], s


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["smollm2", "llama3-8b-1-layer"])
def test_no_kernel_compiles_after_warmup(shape):
    """Batches of new sizes and prompts of new lengths after warm-up (served by decode, whole mixed
    and piecewise graphs) reuse the compiled kernels: a
    compile stalls every request for seconds (seen as 2-3 s TTFT tails on two H200s when the
    prefill kernel specialized on the batch size). The llama3-8b shape (one layer, bf16) also
    runs its LM head through the skinny GEMM (a vocabulary of 128256: `DISAGG_LINEAR=auto`),
    with up to 64 sequences, so every row tile of that kernel is needed."""
    import dataclasses

    import torch

    from disagg.engine import ColocatedEngine, EngineOptions
    from disagg.kernels import append, copy, decode, fused, linear, prefill, rope_append
    from disagg.kernels.dispatch import compiled_variants
    from disagg.model import load_model
    from disagg.model.llama import Model
    from disagg.model.presets import preset_config
    from disagg.model.weights import random_weights

    if shape == "smollm2":
        model, max_num_seqs, waves = load_model(SOURCE, dtype=torch.bfloat16, device="cuda"), 16, []
    else:
        config = dataclasses.replace(preset_config("llama3-8b"), num_layers=1)
        cuda = torch.device("cuda")
        model = Model(config, random_weights(config, torch.bfloat16, cuda), dtype=torch.bfloat16,
                      device=cuda)
        max_num_seqs, waves = 64, [[3] * 40, [5] * 21]
    engine = ColocatedEngine(model, num_pages=1024, page_size=16, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=512,
                             options=EngineOptions(use_cuda_graphs=True))  # whole mixed graphs too
    engine.warmup(max_kv_len=1024)
    used = [prefill.paged_prefill_kernel, decode.paged_decode_kernel, rope_append.rope_append_kernel,
            fused.add_rms_norm_kernel, fused.silu_mul_kernel]
    if shape != "smollm2":
        used.append(linear.linear_kernel)
    kernels = used + [append.append_kv_kernel, copy.copy_slots_kernel, fused.apply_rope_kernel]
    before = [compiled_variants(k) for k in kernels]
    assert min(before[:len(used)]) >= 1, f"kernels of the default path ran: {before}"
    for wave, lengths in enumerate([[5], [64, 17], [1, 300, 33], [16, 48, 80, 127, 2], [7] * 9] + waves):
        for i, n in enumerate(lengths):
            engine.add(f"w{wave}-{i}", [(13 * i + 7 * j) % 40000 + 5 for j in range(n)],
                       SamplingParams(max_tokens=3 + 5 * (i % 4), ignore_eos=True))
        drain(engine)
    assert_all_free(engine)
    assert engine.stats()["num_mixed_graph_replays"] > 0
    assert [compiled_variants(k) for k in kernels] == before


class _OnePEHeap:
    """Plain device memory and host signal words: a decode engine whose doorbells the test rings
    (no transfer here; the KV pages hold zeros, the same for both runs compared)."""

    backend = "shm"  # its engine's KV connector: the symmetric heaps' (`disagg.transfer.registry`)

    def __init__(self, device, num_signals: int = 64) -> None:
        import numpy as np

        self.rank, self.world_size, self.device, self.num_signals = 0, 1, device, num_signals
        self.signals = np.zeros(num_signals, dtype=np.int64)

    def alloc(self, shape, dtype):
        import torch

        return torch.zeros(shape, dtype=dtype, device=self.device)

    def read_signal(self, index: int) -> int:
        return int(self.signals[index])

    def read_signals(self):
        return self.signals.copy()


@pytest.mark.gpu
def test_async_scheduling_equals_sync_with_cuda_graphs():
    """Decode steps launched ahead (CUDA graphs, device input ids, seeded and stop-id requests)
    give the tokens of the synchronous engine, and every page comes back."""
    import torch

    from disagg.engine import DecodeEngine, EngineOptions
    from disagg.model import load_model

    model = load_model(SOURCE, dtype=torch.float32, device="cuda")
    params = {f"r{i}": SamplingParams(max_tokens=8 + 5 * i, ignore_eos=True,
                                      **(dict(temperature=0.8, top_k=40, seed=i) if i % 2 else {}))
              for i in range(6)}

    def tokens(async_scheduling: bool) -> tuple[dict, dict]:
        heap = _OnePEHeap(model.device)
        engine = DecodeEngine(model, heap, num_pages=256, page_size=16, max_num_seqs=8,
                              options=EngineOptions(async_scheduling=async_scheduling))
        engine.warmup(max_kv_len=512)
        out = {}
        for i, (rid, p) in enumerate(params.items()):
            dest = engine.reserve(rid, 20 + 17 * i, p)
            heap.signals[dest.ticket.index] = dest.ticket.epoch  # "the push landed"
            engine.start(rid, 100 + i)
        for _ in range(500):
            if not engine.has_work():
                break
            for o in engine.step():
                out.setdefault(o.request_id, []).append(o.token_id)
        stats = engine.stats()
        assert stats["free_pages"] == stats["total_pages"], stats
        return out, stats

    sync, sync_stats = tokens(False)
    ahead, ahead_stats = tokens(True)
    assert ahead_stats["num_steps_ahead"] > 0 and sync_stats["num_steps_ahead"] == 0
    assert ahead_stats["num_graph_replays"] > 10
    assert ahead == sync
    assert [len(sync[rid]) for rid in params] == [p.max_tokens - 1 for p in params.values()]


@pytest.mark.gpu
@pytest.mark.parametrize("linear", ["auto", "cublas", "triton"])
def test_layer_pdl_and_skinny_gemm_in_graphs_equal_eager(linear):
    """bf16 (the skinny GEMM runs for 16-bit models only): with `kernels.linear` as given, the
    layer kernels under PDL (`layer_pdl: true`) give the tokens they give without it, eager and
    from graphs, bit for bit (the same kernels run; PDL only moves their launches). Graphs vs
    eager is not compared here: in bf16 their other split counts may round a near tie apart.
    Then with RoPE and the append in one launch (`rope_append: true`): the same tokens again."""
    import torch

    from disagg.model import load_model
    from disagg.settings import Settings

    # two launches for RoPE and the append first, one at the end
    model = load_model(SOURCE, dtype=torch.bfloat16, device="cuda",
                       settings=Settings(linear=linear, rope_append=False, layer_pdl=False))
    eager, _ = _colocated_tokens(model, use_cuda_graphs=False)
    plain, _ = _colocated_tokens(model, use_cuda_graphs=True)
    model.settings = model.settings.model_copy(update={"layer_pdl": True})
    pdl_eager, _ = _colocated_tokens(model, use_cuda_graphs=False)
    pdl, stats = _colocated_tokens(model, use_cuda_graphs=True)
    assert stats["num_graph_replays"] > 10
    assert pdl_eager == eager
    assert pdl == plain
    model.settings = model.settings.model_copy(update={"rope_append": True})  # one launch: the same bits
    fused_eager, _ = _colocated_tokens(model, use_cuda_graphs=False)
    fused_graphs, _ = _colocated_tokens(model, use_cuda_graphs=True)
    assert fused_eager == eager
    assert fused_graphs == plain


@pytest.mark.gpu
def test_async_chunked_prompts_report_each_forwards_own_gpu_span():
    """Under async scheduling a prompt chunk that ends no prompt samples nothing, so its step's
    call returns before the forward ends and the call that reads the prompt's token waits for
    every chunk (two H200s, long-prompt: 17-35 ms for 8192-token chunks, the last one the whole
    prompt). `ForwardTimer` reports every forward once, in launch order, with its own span on the
    GPU: no chunk near zero, the last one not the sum."""
    import time

    import torch

    from disagg.engine import ColocatedEngine, EngineOptions
    from disagg.model import load_model

    model = load_model(SOURCE, dtype=torch.float32, device="cuda")
    engine = ColocatedEngine(model, num_pages=1024, page_size=16, max_num_seqs=4, max_num_batched_tokens=1024,
                             options=EngineOptions(async_scheduling=True))
    engine.warmup(prompt_len=1024, max_kv_len=8192)
    assert engine.timer.enabled
    launched = engine.runner.num_forwards
    engine.add("long", [(13 * j) % 49000 + 5 for j in range(7 * 1024)], SamplingParams(max_tokens=4, ignore_eos=True))
    forwards, steps, start = [], 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
        forwards += engine.last_step_forwards
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    forwards += engine.timer.done()
    chunks = [f for f in forwards if f.shape.num_prefill_tokens]
    assert [f.shape.num_prefill_tokens for f in chunks] == [1024] * 7
    assert len(forwards) == engine.runner.num_forwards - launched >= 7 + 3  # each forward once
    spans = [f.seconds for f in chunks]
    assert sum(f.seconds for f in forwards) <= wall and min(spans) > 0, (spans, wall)
    # Chunk k attends k x 1024 keys more than the first, so spans grow, but never 3x the next one's
    # (the call timing gave ~0 and then the whole prompt).
    assert all(b < 3 * a for a, b in zip(spans, spans[1:])), spans
    assert spans[-1] < 0.5 * sum(spans), spans
    # Between two forwards the GPU's idle time (the first's may count from warm-up's last): with
    # the spans it fits in the wall time of the run.
    idles = [f.idle_before for f in forwards[1:]]
    assert all(i is not None and i >= 0 for i in idles), idles
    assert sum(idles) + sum(f.seconds for f in forwards) <= wall, (idles, wall)
