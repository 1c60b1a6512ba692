"""`disagg simulate` with the prefix cache: the engines' own cache on the bench's token ids.

The expected hits are computed here from the prompts alone (each prompt's longest common prefix
with the prompts before it, whole pages on the decode side), not through the simulator's cache;
the slow test runs the real tiny engine beside a simulated instance (the same `EngineCore` with
the simulated runner) and compares every forward and counter.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.bench.workloads import sample_requests
from disagg.cluster.cli.app import app
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.instance import SimInstance
from disagg.cluster.simulate.run import simulate_run, simulated_result, workload_spec
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.config import Config
from disagg.engine.options import EngineOptions
from disagg.engine.steps import prompt_pairs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAGE = 16
PROFILE = {  # the tiny model's shape (tests/cluster/test_simulate.py), a vocabulary and context to
    # hold shared-prefix's 2176-token prompts
    "kind": "disagg-profile", "version": 1, "date": "20261128-000000", "model": "dummy:tiny", "commit": None,
    "device": {"host": "test", "gpus": [], "torch_device": "cpu"},
    "engine": {"num_pages": 256, "page_size": PAGE, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "max_model_len": 4096, "kv_bytes_per_token": 512, "vocab_size": 32000, "eos_token_ids": [2]},
    "fit": {"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8], "error": 0.1}, "samples": [],
}
ROOMY = {"cache.num_pages": 2048}  # every prompt stays cached: no eviction


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_hits(prompts: list[list[int]], whole_pages: bool) -> list[int]:
    """Each prompt's hit when every prompt before it is cached: its longest common prefix with any
    of them, at least one page (a match starts with a full page), one token short of the prompt,
    cut to whole pages where ``whole_pages`` (a decode reservation)."""
    hits = []
    for j, prompt in enumerate(prompts):
        hit = min(max((_lcp(prompt, p) for p in prompts[:j]), default=0), len(prompt) - 1)
        hit = 0 if hit < PAGE else hit
        hits.append(hit - hit % PAGE if whole_pages else hit)
    return hits


def sim_instance(*, max_model_len: int, clock=lambda: 0.0, **options) -> SimInstance:
    """A simulated instance alone (no fleet), on ``clock``, with the `EngineOptions` ``options``."""
    return SimInstance(StepTimeModel(), EngineOptions(use_cuda_graphs=False, **options), max_model_len=max_model_len,
                       vocab_size=32000, clock=clock, pe=0, bytes_per_token=512.0, link_bytes_per_s=1e9)


def fleet_of(path: str, overrides: dict, step_log: bool = False) -> tuple[Config, SimFleet]:
    config = Config.from_yaml(CONFIGS / path).override(overrides)
    fleet = SimFleet(config, copy.deepcopy(PROFILE))
    if step_log:
        for inst in fleet.instances:
            inst.actor.step_log = []
    return config, fleet


def one_at_a_time(config: Config, fleet: SimFleet, spec):
    """Every request sent after the one before ended (max_concurrency 1): all earlier prompts are cached."""
    return simulate_run(config, PROFILE, spec, request_rate=math.inf, max_concurrency=1, seed=0, fleet=fleet)


def spec_of(num_prompts: int = 48, seed: int = 0, **lengths):
    return workload_spec(PROFILE, 4096, dataset_name="shared-prefix", num_prompts=num_prompts, seed=seed, **lengths)


@pytest.mark.parametrize("input_len", [2048, 2040])
def test_shared_prefix_hits_pushes_and_prefill_work_are_the_prompts_own(input_len: int):
    """1P1D on shared-prefix, one request at a time: the prefill instance finds each prompt's
    longest common prefix with those before it (mid page too), the decode instance the whole pages
    of it; the prefill instance computes, and is timed for, only the rest (the cached prefix still
    the chunk's attention context), and pushes only what follows the decode side's hit. A system
    prompt of 2040 tokens ends mid page: there the two sides' hits differ."""
    config, fleet = fleet_of("tiny-1p1d.yaml", ROOMY, step_log=True)
    spec = spec_of(input_len=input_len)
    sim = one_at_a_time(config, fleet, spec)
    assert all(out.success for out in sim.run.outputs)
    prompts = [r.prompt_token_ids for r in sample_requests(spec)]
    total = sum(len(p) for p in prompts)
    prefill_hits, decode_hits = expected_hits(prompts, False), expected_hits(prompts, True)
    if input_len == 2048:  # the group structure: the first of each of the 3 groups misses, the rest hit the system prompt
        assert sum(h == 0 for h in prefill_hits) == 3 and all(h in (0, 2048) for h in decode_hits)
        assert all(h == 0 or 2048 <= h < 2176 for h in prefill_hits)
    else:
        assert sum(prefill_hits) > sum(decode_hits)  # mid-page hits: the sides differ

    cache = simulated_result(sim, config, PROFILE, label="x", config_path=None)["prefix_cache"]
    assert cache["instances"] == {
        "prefill-0": {"hit_rate": sum(prefill_hits) / total, "query_tokens": total, "hit_tokens": sum(prefill_hits)},
        "decode-0": {"hit_rate": sum(decode_hits) / total, "query_tokens": total, "hit_tokens": sum(decode_hits)}}
    assert cache["hit_rate"] == pytest.approx((sum(prefill_hits) + sum(decode_hits)) / (2 * total))

    prefill, decode = (inst.actor for inst in fleet.instances)
    assert sum(s.num_prefill_tokens for s in prefill.step_log) == total - sum(prefill_hits)
    budget = config.scheduler.max_num_batched_tokens
    pairs = sum(prompt_pairs(start, min(budget, len(p) - start))
                for p, hit in zip(prompts, prefill_hits) for start in range(hit, len(p), budget))
    assert sum(s.num_prompt_pairs for s in prefill.step_log) == pairs  # the cached prefix is attended to
    assert sum(s.num_prefill_tokens for s in decode.step_log) == 0
    assert prefill.num_pushed_tokens == total - sum(decode_hits)
    assert cache["pushed_bytes"] == (total - sum(decode_hits)) * PROFILE["engine"]["kv_bytes_per_token"]


def test_the_cache_cuts_the_prefill_instances_busy_time_and_the_ttft():
    runs = {}
    for caching in (True, False):
        config, fleet = fleet_of("tiny-1p1d.yaml", {**ROOMY, "cache.prefix_caching": caching})
        runs[caching] = one_at_a_time(config, fleet, spec_of())
    busy = {k: sim.fleet.instances[0].actor.busy_s for k, sim in runs.items()}
    ttft = {k: sum(out.ttft for out in sim.run.outputs) for k, sim in runs.items()}
    assert busy[True] < 0.5 * busy[False] and ttft[True] < 0.5 * ttft[False]


def test_without_the_prefix_cache_nothing_is_looked_up_and_the_ids_do_not_matter():
    """``cache.prefix_caching: false``: no lookup, every prompt token computed and pushed, and the
    run is the one of prompts given as lengths alone (the simulator before it modelled the cache)."""
    config, fleet = fleet_of("tiny-1p1d.yaml", {**ROOMY, "cache.prefix_caching": False}, step_log=True)
    spec = spec_of()
    sim = simulate_run(config, PROFILE, spec, request_rate=20.0, seed=0, fleet=fleet)
    prompts = [r.prompt_token_ids for r in sample_requests(spec)]
    total = sum(len(p) for p in prompts)
    result = simulated_result(sim, config, PROFILE, label="x", config_path=None)
    assert result["prefix_cache"]["hit_rate"] is None and result["prefix_cache"]["query_tokens"] == 0
    assert fleet.placer.affinity is None
    prefill = fleet.instances[0].actor
    assert sum(s.num_prefill_tokens for s in prefill.step_log) == prefill.num_pushed_tokens == total
    _, with_ids = fleet_of("tiny-1p1d.yaml", {**ROOMY, "cache.prefix_caching": False})
    for i, (prompt, out) in enumerate(zip(prompts, sim.run.outputs)):  # the same sends, with their ids
        with_ids.submit_at(out.start_time, f"shared-prefix-{i}", prompt, out.expected_output_len)
    with_ids.run()
    assert [t.token_times for t in with_ids.timelines.values()] == [t.token_times for t in fleet.timelines.values()]


def test_same_seed_same_hits_and_another_seed_another():
    results = []
    for seed in (3, 3, 4):
        config, fleet = fleet_of("tiny-2p2d.yaml", {**ROOMY, "model.max_model_len": 4096,
                                                    "router.placement": "adaptive"})
        sim = simulate_run(config, PROFILE, spec_of(64, seed), request_rate=30.0, seed=seed, fleet=fleet)
        results.append(simulated_result(sim, config, PROFILE, label="x", config_path=None))
    for key in ("ttfts", "itls", "prefix_cache", "placements"):
        assert results[0][key] == results[1][key]
    assert results[0]["completed"] == 64 and results[0]["prefix_cache"]["hit_rate"] > 0.5
    assert results[0]["prefix_cache"] != results[2]["prefix_cache"] and results[0]["ttfts"] != results[2]["ttfts"]


def test_the_router_s_prefix_affinity_keeps_each_group_on_one_instance():
    """Two colocated instances, one request at a time: the router's affinity (least loaded with
    prefix credit, `affinity.prefix_affinity`) sends each group where its system prompt is cached,
    so the fleet hits as one cache would; round robin (no affinity) misses each group on both."""
    spec = spec_of()
    prompts = [r.prompt_token_ids for r in sample_requests(spec)]
    hits = {}
    for policy in ("least_loaded", "round_robin"):
        config, fleet = fleet_of("tiny-colocated.yaml", {**ROOMY, "router.policy": policy})
        sim = one_at_a_time(config, fleet, spec)
        hits[policy] = simulated_result(sim, config, PROFILE, label="x", config_path=None)["prefix_cache"]["hit_tokens"]
        assert (fleet.placer.affinity is not None) == (policy == "least_loaded")
        if policy == "least_loaded":
            assert fleet.placer.affinity_hits == len(prompts) - 3  # all but the first of each group
    assert hits["least_loaded"] == sum(expected_hits(prompts, False)) > hits["round_robin"]


def test_short_pages_evict_the_least_recently_used_and_every_page_comes_back():
    """The tiny instances' 256 pages hold one shared-prefix request at a time: cached prefixes are
    evicted (least recently used first) as the pages run short; every request still ends, every
    cache stays consistent, and all its pages are free (or cached, so free) at the end."""
    config, fleet = fleet_of("tiny-1p1d.yaml", {})
    sim = simulate_run(config, PROFILE, spec_of(64), request_rate=20.0, seed=0, fleet=fleet)
    assert all(out.success for out in sim.run.outputs)
    stats = fleet.prefix_stats()
    assert all(s["prefix_hit_tokens"] > 0 for s in stats.values())
    for inst in fleet.instances:
        cache = inst.actor.cache
        cache.check_integrity()
        assert cache.prefix_stats()["prefix_evicted_pages"] > 0 and cache.num_free_pages == cache.num_pages


def test_a_push_carries_what_follows_the_decode_side_s_hit():
    """A simulated instance: the decode side's reservation forks its cached whole pages; the
    prefill side computes what its own cache lacks and pushes from the decode side's hit on (what
    it found in its own cache past that point goes too, page to page, in its first forward)."""
    now = [0.0]
    sizes = dict(num_pages=64, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=4096,
                 prefix_caching=True, async_scheduling=False, clock=lambda: now[0])
    shared, prompt = list(range(1, 41)), list(range(1, 41)) + list(range(500, 560))  # 100 tokens

    def run(engine: SimInstance) -> None:  # every step, the clock at each one's end
        for _ in range(100):
            if not engine.has_work():
                return
            step = engine.begin_step()  # None: the pushes' pages were freed (no forward to run)
            if step is not None:
                now[0] = step.end_times[-1]
                engine.finish_step()
        raise AssertionError("the instance never ran out of work")

    def decode_side(warm: bool) -> SimInstance:
        engine = sim_instance(**sizes)
        if warm:  # ``shared`` computed and cached there
            engine.add("warm", shared + [7, 7], 1)
            run(engine)
        return engine

    assert decode_side(False).reserve("r", prompt, 4).num_cached_tokens == 0
    assert decode_side(True).reserve("r", prompt, 4).num_cached_tokens == 32  # 40 cached: its 2 whole pages
    for prefill_warm, decode_warm, computed, pushed in ((False, True, 100, 68), (True, False, 60, 100),
                                                        (True, True, 60, 68)):
        prefill = decode_side(prefill_warm)  # warm: 40 cached, a mid-page hit, its partial page copied
        prefill.step_log = []
        prefill.add("r", prompt, 4, dest=decode_side(decode_warm).reserve("r", prompt, 4))
        run(prefill)
        assert sum(s.num_prefill_tokens for s in prefill.step_log) == computed
        assert prefill.num_pushed_tokens == pushed, (prefill_warm, decode_warm)


def test_cli_reports_the_hits_as_the_bench_does(tmp_path: Path):
    """`disagg simulate`'s result holds ``prefix_cache`` in `disagg bench`'s shape; its run table and
    `disagg bench --from-results`' common-rate table show the hit rate."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    runner = CliRunner()
    for config, out in (("tiny-1p1d.yaml", "a"), ("tiny-colocated.yaml", "b")):
        result = runner.invoke(app, ["simulate", str(CONFIGS / config), "--profile", str(profile), "--set",
                                     "cache.num_pages=2048", "--dataset-name", "shared-prefix", "--num-prompts", "32",
                                     "--request-rate", "4", "--goodput", "ttft:500", "tpot:50",
                                     "--result-dir", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
        assert "Prefix cache hit rate" in result.output
    stored = json.loads(next((tmp_path / "a").glob("*.json")).read_text())
    cache = stored["prefix_cache"]
    assert set(cache) == {"hit_rate", "query_tokens", "hit_tokens", "instances", "pushed_bytes"}
    assert set(cache["instances"]) == {"prefill-0", "decode-0"} and 0.5 < cache["hit_rate"] < 1
    assert stored["prefix_cache_reset"] is True and stored["simulation"]["prefix_caching"] is True
    result = runner.invoke(app, ["bench", "--from-results", str(tmp_path / "a"), "--from-results", str(tmp_path / "b"),
                                 "--result-dir", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    assert "prefix hits" in result.output and f"{100 * cache['hit_rate']:.1f}%" in result.output


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("first_max_tokens", [(8, 6), (30, 20)])
def test_simulated_engine_hits_evicts_and_preempts_as_the_real_engine(first_max_tokens: tuple[int, int],
                                                                      async_scheduling: bool, monkeypatch):
    """Given the same arrivals per step, the real colocated engine with its prefix cache and the
    simulated one run the same forwards and count the same lookups, hits and evictions: prompts
    that share a prefix (mid page too), pages short enough to evict, and (the first two answers
    long) to preempt. With short ones, the mid-page hit of step 9 pins the last free page
    (tests/disagg/test_prefix_cache_fork_cost.py: both engines raised OutOfPages there)."""
    from disagg.cluster.launch import engines
    from disagg.engine import ColocatedEngine, EngineOptions
    from disagg.sampling import SamplingParams

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: the shapes are the scheduler's
    sizes = dict(num_pages=8, page_size=PAGE, max_num_seqs=3, max_num_batched_tokens=32)
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml").override({"model.num_layers": 1})
    real = ColocatedEngine(engines.load(config, "cpu"), **sizes, options=EngineOptions(
        async_scheduling=async_scheduling, prefix_caching=True))
    sim = sim_instance(max_model_len=real.max_model_len, async_scheduling=async_scheduling, prefix_caching=True,
                       **sizes)
    sim.step_log = []
    system, other = list(range(10, 50)), list(range(60, 96))  # 40 and 36 tokens: hits end mid page

    def question(i: int, n: int) -> list[int]:  # its own first token: no two prompts share more
        return [100 + i] + [200 + i] * (n - 1)

    first, second = first_max_tokens
    arrivals = {0: [(system + question(0, 6), first)], 1: [(system + question(1, 12), second)],
                3: [(system + question(2, 3), 10), (other + question(3, 4), 7)], 9: [(system + question(4, 20), 5)],
                16: [(other + question(5, 2), 9)], 21: [(system[:35] + question(6, 3), 4)],
                24: [(system + question(7, 9), 6)]}
    real_shapes = []
    for k in range(80):
        for i, (prompt, max_tokens) in enumerate(arrivals.get(k, [])):
            real.add(f"r{k}-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            sim.add(f"r{k}-{i}", prompt, max_tokens)
        real.step()
        if real.last_step_shape is not None:
            real_shapes.append(real.last_step_shape)
        if sim.begin_step() is not None:
            sim.finish_step()
        if k > 24 and not real.has_work():
            break
    assert sim.step_log == real_shapes and not sim.has_work()
    counters = ("prefix_query_tokens", "prefix_hit_tokens", "prefix_evicted_pages")
    real_stats, sim_stats = real.stats(), sim.stats()
    assert {k: sim_stats[k] for k in counters} == {k: real_stats[k] for k in counters}
    assert real_stats["prefix_hit_tokens"] > 0 and real_stats["prefix_evicted_pages"] > 0  # the cases that matter
    assert sim.core.scheduler.num_preemptions == real.scheduler.num_preemptions
    assert (real.scheduler.num_preemptions > 0) == (first > 8)
