"""End to end: a short disaggregated vs colocated comparison on the tiny CPU configs through the
real Cluster (Ray actors, /dev/shm heap, router), writing JSON that recomputes and the plots.

Every bench of tiny-1p1d.yaml here runs on one fleet launched for the module (`tiny_1p1d`): a
launch is ~6 s of actors starting, and the module's benches launched that config six times. Each
test gets the fleet with every prefix cache emptied; the rest a bench reports is a difference of
stats taken around its runs.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
from cluster_helpers import launch_config

import disagg.cluster
from disagg.cluster.bench.compare import quick_compare
from disagg.cluster.bench.report import check_result, load_json
from disagg.config import Config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"

pytestmark = [
    pytest.mark.usefixtures("ray_local", "tiny_1p1d"),  # every fleet of the module on one local Ray
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not hasattr(disagg.cluster, "Cluster"), reason="disagg.cluster.Cluster has not landed yet"),
]


@pytest.fixture(scope="module")
def tiny_1p1d_fleet(ray_local):
    """(config, fleet) of configs/tiny-1p1d.yaml, launched once for the module (actors on the torch
    reference kernels: `cluster_helpers.ACTOR_ENV`)."""
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml")
    with launch_config(config) as cluster:
        yield config, cluster


@pytest.fixture
def tiny_1p1d(tiny_1p1d_fleet, monkeypatch):
    """`Cluster.launch` of tiny-1p1d.yaml (unchanged) hands out the module's fleet, with every prefix
    cache emptied, and leaves it running at the end of the bench; any other config launches."""
    config, cluster = tiny_1p1d_fleet
    launch = disagg.cluster.Cluster.launch

    def shared_or_launch(wanted):
        return contextlib.nullcontext(cluster) if wanted == config else launch(wanted)
    monkeypatch.setattr(disagg.cluster.Cluster, "launch", staticmethod(shared_or_launch))
    cluster.reset_prefix_cache()
    return cluster


def test_tiny_1p1d_vs_colocated(tmp_path, monkeypatch):
    # The actors inherit it: torch reference kernels (the Triton interpreter made this test three
    # minutes of CI; the kernels are tested under it on their own).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    summary = quick_compare(str(CONFIGS / "tiny-1p1d.yaml"), str(CONFIGS / "tiny-colocated.yaml"), str(tmp_path),
                            num_prompts=6, rates=(4.0, 8.0), input_len=24, output_len=6,
                            goodput={"ttft": 20000, "tpot": 5000})
    assert [side["label"] for side in summary["sides"]] == ["tiny-1p1d", "tiny-colocated"]
    for run in summary["runs"]:
        assert run["num_gpus"] == 2 and len(run["result_files"]) == 2
        for path in run["result_files"]:
            result = load_json(path)
            check_result(result)
            assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
            assert result["output_lens"] == result["expected_output_lens"]     # EOS ignored, exact lengths
            assert result["mean_client_overhead_ms"] > 0                       # emit times came through
            busy = result["busy_fraction"]                                      # from the actors' busy_s
            assert len(busy) == 2 and all(0.0 <= value <= 1.05 for value in busy.values()), busy
            cpu = result["host_cpu"]                                            # the router's Router.snapshot cpu_s
            assert set(cpu) == {"router_thread", "process"} and 0.0 < cpu["router_thread"] <= cpu["process"], cpu
    assert (tmp_path / "compare.json").exists()
    for name in ("attainment_vs_rate.png", "ttft_cdf.png", "tpot_cdf.png", "throughput_vs_rate.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_shared_prefix_and_multi_turn_report_hit_rates(monkeypatch):
    from disagg.cluster.bench import prefix_workloads
    from disagg.cluster.bench.sweep import SweepOptions, bench_config
    from disagg.cluster.bench.tables import run_table

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the actors inherit it: torch reference kernels
    monkeypatch.setattr(prefix_workloads, "QUESTION_LEN", 8)  # short prompts, a quick test
    # Spaced arrivals (4 req/s): a shared prefix is cached once the first request of its group
    # computed it; sent all at once, a loaded machine can schedule a whole group in one step, which
    # shares nothing.
    options = SweepOptions(num_prompts=8, datasets=["shared-prefix", "multi-turn"], input_len=20, output_len=3,
                           rates=[4.0], show_progress=False, save_results=False, num_warmups=0)
    runs = bench_config(str(CONFIGS / "tiny-1p1d.yaml"), options, label="tiny")
    for one in runs:
        (result,) = one.results
        assert result["completed"] == 8, result["errors"]
        cache = result["prefix_cache"]
        assert set(cache["instances"]) == {"prefill-0", "decode-0"}
        assert cache["query_tokens"] == 2 * result["total_input_tokens"]  # looked up on both sides
        assert 0 < cache["hit_rate"] < 1 and cache["pushed_bytes"] > 0
        rows = {row for row in run_table(result).columns[0].cells}
        assert "Prefix cache hit rate" in rows


def test_a_random_workload_reuses_no_prompt_and_reports_recompute_hits_apart(monkeypatch):
    """Random prompts share nothing: the hit rate is 0. Under page pressure requests are preempted
    and, re-entering, find their own KV again: reported apart, as vLLM's preempted_hits are."""
    from disagg.cluster.bench.sweep import SweepOptions, bench_config
    from disagg.cluster.bench.tables import run_table

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    options = SweepOptions(num_prompts=24, dataset_name="random", input_len=256, output_len=64, rates=[math.inf],
                           show_progress=False, save_results=False, num_warmups=1)
    # 12 requests of 320 tokens at once on each instance of 1024 tokens, their prompts in chunks of 128
    overrides = {"cache.num_pages": 64, "scheduler.max_num_batched_tokens": 128}
    (runs,) = bench_config(str(CONFIGS / "tiny-colocated.yaml"), options, label="tiny", overrides=overrides)
    (result,) = runs.results
    assert result["completed"] == 24, result["errors"]
    cache = result["prefix_cache"]
    assert (cache["hit_rate"], cache["hit_tokens"], cache["query_tokens"]) == (0.0, 0, result["total_input_tokens"])
    assert sum(inst["num_preemptions"] for inst in result["cluster_stats"]["instances"]) > 0
    assert cache["preempted"]["hit_tokens"] > 0
    assert "Recompute hits after preemption" in run_table(result).columns[0].cells


@pytest.mark.parametrize("reset", [True, False])
def test_each_run_of_a_sweep_starts_with_no_cached_prefix(monkeypatch, reset):
    """Every run of a sweep sends the same prompts: without the reset before each run, the second
    run hits on the first one's prefixes (and its warm-ups') and measures a warmer cache."""
    from disagg.cluster.bench import prefix_workloads
    from disagg.cluster.bench.sweep import SweepOptions, bench_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(prefix_workloads, "QUESTION_LEN", 8)
    options = SweepOptions(num_prompts=6, dataset_name="shared-prefix", input_len=40, output_len=2,
                           rates=[math.inf, math.inf], max_concurrency=1, show_progress=False,
                           save_results=False, num_warmups=1, reset_prefix_cache=reset)
    (runs,) = bench_config(str(CONFIGS / "tiny-1p1d.yaml"), options, label="tiny")
    first, second = (result["prefix_cache"] for result in runs.results)
    assert [result["prefix_cache_reset"] for result in runs.results] == [reset, reset]
    assert first["query_tokens"] == second["query_tokens"] > 0
    if reset:  # one request at a time: the prefill side misses the first request's system prompt, then hits it
        assert first["hit_tokens"] == second["hit_tokens"]
        assert second["instances"]["prefill-0"]["hit_tokens"] == (6 - 1) * 40
    else:
        assert second["hit_tokens"] > first["hit_tokens"]


@pytest.mark.parametrize("reset", [True, False])
def test_the_slo_calibration_times_uncached_prompts(monkeypatch, reset):
    """The calibration's warm-ups send the very prompts it then times one at a time: without the
    prefix-cache reset between them its isolated TTFT is a cached prompt's (two H100s, long-prompt:
    49 ms for prompts of 8k-32k tokens, an SLO no run could hold)."""
    from disagg.cluster.bench.sweep import SweepOptions, bench_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    options = SweepOptions(num_prompts=3, dataset_name="random", input_len=40, output_len=3, rates=[math.inf],
                           max_concurrency=1, show_progress=False, save_results=False, num_warmups=3,
                           calibrate_slos=True, reset_prefix_cache=reset)
    (runs,) = bench_config(str(CONFIGS / "tiny-1p1d.yaml"), options, label="tiny")
    calibration = runs.info["calibration"]
    cache = calibration["prefix_cache"]
    assert calibration["prefix_cache_reset"] is reset and cache["query_tokens"] > 0
    assert (cache["hit_tokens"] == 0) is reset, cache
