"""The sweep and comparison plumbing (YAML -> launch -> workload -> sweep -> JSON + PNGs + table)
on a stand-in Cluster that streams scripted tokens. A unit test of the bench's wiring, not of
serving: the end-to-end comparison on the real cluster is test_bench_e2e.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from stand_in import TINY_1P1D, TINY_COLOCATED, StandInCluster, bench_app as _app
from typer.testing import CliRunner

from disagg.cluster.bench import compare as cmp
from disagg.cluster.bench.report import check_result, load_json
from disagg.cluster.bench.sweep import SweepOptions, bench_config, busy_fractions, compare_configs, host_cpu_fractions


def test_quick_compare_writes_results_and_plots(stand_in, tmp_path):
    summary = cmp.quick_compare(TINY_1P1D, TINY_COLOCATED, str(tmp_path), num_prompts=5, rates=(50.0, 200.0),
                                goodput={"ttft": 1000, "tpot": 1000}, input_len=8, output_len=4)
    assert [c.mode for c in stand_in.launched] == ["disaggregated", "colocated"]
    labels = [side["label"] for side in summary["sides"]]
    assert labels == ["tiny-1p1d", "tiny-colocated"]
    for run in summary["runs"]:
        assert len(run["result_files"]) == 2
        for path in run["result_files"]:
            result = load_json(path)
            check_result(result)
            assert result["completed"] == 5 and result["num_gpus"] == 2
            assert result["workload"]["vocab_size"] == 64 and result["config"]["instances"]
            assert set(result["busy_fraction"]) == {f"{result['config']['instances']['colocated'] and 'colocated' or 'disaggregated'}-{i}" for i in range(2)}
    assert summary["sides"][0]["attainment"] == [1.0, 1.0]
    assert summary["comparison"]["rows"][0]["ratio"] is None   # both hold every rate: no order, not 1.0
    assert {p.split("/")[-1] for p in summary["plots"]} >= {"attainment_vs_rate.png", "ttft_cdf.png"}
    assert json.loads((tmp_path / "compare.json").read_text())["slos_ms"] == {"ttft": 1000, "tpot": 1000}


def test_cli_compare_with_variants_and_calibrated_slos(stand_in, tmp_path):
    result = CliRunner().invoke(_app(), [
        "bench", TINY_1P1D, "--compare", TINY_COLOCATED, "--compare-variant",
        "scheduler.max_num_batched_tokens=64,128", "--num-prompts", "4", "--request-rate", "100,inf",
        "--random-input-len", "8", "--random-output-len", "3", "--slo-calibrate", "--slo-scales", "1,4",
        "--result-dir", str(tmp_path), "--disable-tqdm"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert [s["label"] for s in summary["sides"]] == [
        "tiny-1p1d", "tiny-colocated[max_num_batched_tokens=64]", "tiny-colocated[max_num_batched_tokens=128]"]
    assert [c.scheduler.max_num_batched_tokens for c in stand_in.launched] == [256, 64, 128]
    calibration = summary["runs"][0]["calibration"]
    assert calibration["slos_ms"]["tpot"] == pytest.approx(2.5 * calibration["isolated_tpot_ms"])
    assert summary["slos_ms"] == calibration["slos_ms"]
    assert [row["scale"] for row in summary["comparison"]["rows"]] == [1.0, 4.0]
    assert "Goodput per instance" in result.output        # a CPU fleet: per instance, not per GPU


def test_cli_single_config_saves_named_result(stand_in, tmp_path):
    result = CliRunner().invoke(_app(), [
        "bench", TINY_1P1D, "--no-compare", "--set", "serve.api_key=sekrit", "--num-prompts", "3", "--request-rate", "100",
        "--dataset-name", "decode-heavy", "--random-output-len", "3", "--random-input-len", "4",
        "--goodput", "ttft:500", "--goodput", "tpot:500", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "one.json", "--disable-tqdm"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    saved = load_json(tmp_path / "one.json")
    check_result(saved)
    assert saved["goodput"] == {"ttft": 500.0, "tpot": 500.0} and saved["workload"]["dataset_name"] == "decode-heavy"
    assert "Mean TTFT (ms)" in result.output
    assert "sekrit" not in (tmp_path / "one.json").read_text()  # the server's key never lands in results
    assert saved["placements"] == {"remote": 3, "local": 0, "kept": 0} or saved["placements"] is None


def test_busy_fractions_read_either_stats_shape():
    before = {"instances": [{"name": "prefill-0", "busy_s": 1.0}, {"name": "decode-0", "busy_s": 2.0}]}
    after = {"instances": [{"name": "prefill-0", "busy_s": 1.5}, {"name": "decode-0", "busy_s": 3.0}]}
    assert busy_fractions(before, after, 2.0) == {"prefill-0": 0.25, "decode-0": 0.5}
    nested = {"colocated-0": {"busy_s": 0.0}, "colocated-1": {"busy_s": 1.0}, "router": 3}
    later = {"colocated-0": {"busy_s": 1.0}, "colocated-1": {"busy_s": 1.0}, "router": 4}
    assert busy_fractions(nested, later, 1.0) == {"colocated-0": 1.0, "colocated-1": 0.0}
    assert busy_fractions({"instances": [{"name": "x"}]}, {"instances": [{"name": "x"}]}, 1.0) is None


def test_host_cpu_fractions_from_the_router_stats():
    before = {"instances": [], "router": {"cpu_s": {"router_thread": 1.0, "process": 2.0}}}
    after = {"instances": [], "router": {"cpu_s": {"router_thread": 2.5, "process": 5.0}}}
    assert host_cpu_fractions(before, after, 2.0) == {"router_thread": 0.75, "process": 1.5}
    assert host_cpu_fractions({"router": {}}, after, 2.0) is None       # a server over HTTP: no router stats
    assert host_cpu_fractions(before, after, 0.0) is None


def test_one_launch_serves_every_workload(stand_in, tmp_path):
    options = SweepOptions(num_prompts=4, rates=[100.0], datasets=["random", "decode-heavy"], input_len=6,
                           output_len=2, goodput_slos_ms={"ttft": 1000, "tpot": 1000}, show_progress=False)
    summary = compare_configs(TINY_1P1D, [TINY_COLOCATED], tmp_path, options)
    assert len(stand_in.launched) == 2                                   # one launch per deployment
    assert set(summary["datasets"]) == {"random", "decode-heavy"}
    for name in ("random", "decode-heavy"):
        one = json.loads((tmp_path / name / "compare.json").read_text())
        assert one["dataset"] == name and len(one["sides"]) == 2
        assert (tmp_path / name / "attainment_vs_rate.png").exists()
    assert (tmp_path / "compare.json").exists()


def test_run_seconds_and_early_stop(stand_in, tmp_path):
    options = SweepOptions(rates=[math.inf, 400.0, 100.0], run_seconds=0.05, min_prompts=3, early_stop=True)
    assert options.sweep_rates() == [100.0, 400.0, math.inf]
    assert [options.prompts_at(r, 30) for r in (100.0, 400.0, math.inf)] == [5, 20, 30]
    assert SweepOptions(min_prompts=3).prompts_at(1.0, 30) == 30     # without run_seconds: all of them
    # SLOs nothing can meet: the first rate collapses and the sweep stops there
    options = SweepOptions(num_prompts=6, rates=[200.0, 400.0], input_len=4, output_len=2, early_stop=True,
                           goodput_slos_ms={"ttft": 0.0001}, slo_scales=(1.0, 2.0), show_progress=False)
    (runs,) = bench_config(TINY_1P1D, options)
    assert [r["request_rate"] for r in runs.results] == [200.0]
    options.early_stop = False
    (runs,) = bench_config(TINY_1P1D, options)
    assert [r["request_rate"] for r in runs.results] == [200.0, 400.0]


def test_http_backend_against_the_serve_app(stand_in):
    """bench -> HTTP (in-process ASGI, so chunks arrive buffered: counts, not timings) -> serve app."""
    import httpx

    from disagg.cluster.bench.backends import HttpBackend
    from disagg.cluster.bench.runner import run
    from disagg.cluster.bench.workloads import WorkloadSpec, sample_requests
    from disagg.cluster.serve.app import build_app
    from disagg.config import Config

    config = Config.from_yaml(TINY_1P1D)
    cluster = StandInCluster(config)
    cluster.model_name, cluster.tokenizer, cluster.healthy = "tiny", None, True
    transport = httpx.ASGITransport(app=build_app(cluster, config))
    requests = sample_requests(WorkloadSpec("random", 3, vocab_size=64, input_len=5, output_len=4))
    result = run(HttpBackend("http://serve.test", transport=transport), requests, request_rate=math.inf)
    assert [o.error for o in result.outputs] == ["", "", ""]
    assert [o.output_len for o in result.outputs] == [4, 4, 4]
    assert all(len(o.itl) == 3 for o in result.outputs)      # one chunk per step, token ids counted


def test_cli_takes_compare_with_and_defaults_from_the_config(stand_in, tmp_path):
    config = tmp_path / "pair.yaml"
    config.write_text(Path(TINY_1P1D).read_text() + f"bench:\n  compare_with: {TINY_COLOCATED}\n  num_prompts: 3\n"
                      "  request_rates: [300]\n  input_len: 5\n  output_len: 2\n  goodput: {ttft: 900, tpot: 900}\n")
    result = CliRunner().invoke(_app(), ["bench", str(config), "--result-dir", str(tmp_path / "out"),
                                         "--disable-tqdm"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert [c.mode for c in stand_in.launched] == ["disaggregated", "colocated"]
    summary = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert summary["slos_ms"] == {"ttft": 900, "tpot": 900}
    assert all(len(run["result_files"]) == 1 for run in summary["runs"])
    assert load_json(summary["runs"][0]["result_files"][0])["num_prompts"] == 3


def test_split_sweeps_compared_from_stored_results(stand_in, tmp_path):
    """Each deployment swept alone (as a 10-minute GPU run allows), compared afterwards."""
    common = ["--no-compare", "--num-prompts", "3", "--request-rate", "150,300", "--random-input-len", "5",
              "--random-output-len", "2", "--save-result", "--disable-tqdm"]
    first = CliRunner().invoke(_app(), ["bench", TINY_1P1D, *common, "--slo-calibrate", "--result-dir",
                                        str(tmp_path / "a")], env={"COLUMNS": "250"})
    assert first.exit_code == 0, first.output
    assert "calibrated" in first.output
    second = CliRunner().invoke(_app(), ["bench", TINY_COLOCATED, *common, "--set", "scheduler.max_num_batched_tokens=64",
                                         "--goodput", "ttft:9", "--result-dir", str(tmp_path / "b")], env={"COLUMNS": "250"})
    assert second.exit_code == 0, second.output
    assert stand_in.launched[1].scheduler.max_num_batched_tokens == 64
    merged = CliRunner().invoke(_app(), ["bench", "--from-results", str(tmp_path / "a"), "--from-results",
                                         str(tmp_path / "b"), "--result-dir", str(tmp_path / "ab")], env={"COLUMNS": "250"})
    assert merged.exit_code == 0, merged.output
    summary = json.loads((tmp_path / "ab" / "compare.json").read_text())
    assert [side["label"] for side in summary["sides"]] == ["tiny-1p1d", "tiny-colocated[max_num_batched_tokens=64]"]
    calibrated = load_json(next((tmp_path / "a").glob("tiny-1p1d-150.0qps-*.json")))["calibration"]["slos_ms"]
    assert summary["slos_ms"] == calibrated                     # the first deployment's SLOs judge both
    assert summary["sides"][1]["rates"] == [150.0, 300.0]
    bad = CliRunner().invoke(_app(), ["bench", "--from-results", str(tmp_path / "nothing")], env={"COLUMNS": "250"})
    assert bad.exit_code == 2 and "--from-results" in bad.output
    bad_set = CliRunner().invoke(_app(), ["bench", TINY_1P1D, "--set", "scheduler.max_num_seq=3"], env={"COLUMNS": "250"})
    assert bad_set.exit_code == 2 and "max_num_seqs" in bad_set.output


def test_cli_base_url_path_saves_results(stand_in, monkeypatch, tmp_path):
    import httpx

    from disagg.cluster.bench import backends
    from disagg.cluster.serve.app import build_app
    from disagg.config import Config

    config = Config.from_yaml(TINY_1P1D)
    cluster = StandInCluster(config)
    cluster.model_name, cluster.tokenizer, cluster.healthy = "tiny", None, True
    transport = httpx.ASGITransport(app=build_app(cluster, config))
    real = backends.HttpBackend
    monkeypatch.setattr(backends, "HttpBackend", lambda url, **kw: real(url, transport=transport, **kw))
    result = CliRunner().invoke(_app(), [
        "bench", "--base-url", "http://serve.test", "--vocab-size", "64", "--num-prompts", "3",
        "--random-input-len", "4", "--random-output-len", "3", "--request-rate", "inf", "--goodput", "ttft:5000",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "http.json", "--disable-tqdm"],
        env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    saved = load_json(tmp_path / "http.json")
    check_result(saved)
    assert saved["completed"] == 3 and saved["output_lens"] == [3, 3, 3] and saved["base_url"] == "http://serve.test"
    assert saved["prefix_cache_reset"] and StandInCluster.num_resets == 1  # POST /reset_prefix_cache reached it


def test_summary_markdown_names_the_winner(stand_in, tmp_path):
    options = SweepOptions(num_prompts=4, rates=[100.0, 200.0], datasets=["random", "chat"], input_len=6,
                           output_len=2, goodput_slos_ms={"ttft": 1000, "tpot": 1000}, slo_scales=(1.0, 2.0),
                           show_progress=False)
    compare_configs(TINY_1P1D, [TINY_COLOCATED], tmp_path, options)
    text = (tmp_path / "summary.md").read_text()
    lines = text.splitlines()
    for fact in ("- date: 2", "commit: ", "- device: CPU only", "- model: dummy:tiny (float32)",
                 "- rates offered (req/s): 100, 200; prompts per run: 4", "- workload random: input 6 tokens",
                 "- workload chat: "):
        assert fact in text, fact
    head = lines.index("| workload | SLO scale | SLOs | under test | goodput | best other | goodput | ratio |")
    assert lines[head + 2] == ("| random | 1x | TTFT 1000 ms, TPOT 1000 ms | tiny-1p1d | 100.0+ | tiny-colocated "
                               "| 100.0+ | - |")   # both held every rate: the sweep cannot order them
    tails = lines.index("| workload | deployment | rate (req/s) | p99 TTFT (ms) | p99 TPOT (ms) | SLO attainment |")
    assert [line.split(" | ")[1:3] for line in lines[tails + 2:tails + 6]] == [
        ["tiny-1p1d", "200"], ["tiny-colocated", "200"], ["tiny-1p1d", "200"], ["tiny-colocated", "200"]]


def test_prefix_cache_of_one_run():
    from disagg.cluster.bench.sweep import prefix_cache_of

    def stats(pq, ph, dq, dh, pushed):
        return {"instances": [
            {"name": "prefill-0", "prefix_query_tokens": pq, "prefix_hit_tokens": ph, "pushed_bytes": pushed},
            {"name": "decode-0", "prefix_query_tokens": dq, "prefix_hit_tokens": dh}]}

    got = prefix_cache_of(stats(100, 10, 100, 0, 500), stats(300, 110, 300, 50, 1500))
    assert got == {"hit_rate": 150 / 400, "query_tokens": 400, "hit_tokens": 150, "pushed_bytes": 1000,
                   "instances": {"prefill-0": {"hit_rate": 0.5, "query_tokens": 200, "hit_tokens": 100},
                                 "decode-0": {"hit_rate": 0.25, "query_tokens": 200, "hit_tokens": 50}}}
    assert prefix_cache_of(None, stats(1, 1, 1, 1, 1)) is None
    assert prefix_cache_of({"instances": [{"name": "x"}]}, {"instances": [{"name": "x"}]}) is None
    idle = prefix_cache_of(stats(1, 0, 1, 0, 0), stats(1, 0, 1, 0, 0))
    assert idle["hit_rate"] is None and idle["instances"]["decode-0"]["hit_rate"] is None


def test_prefix_cache_of_counts_a_preempted_requests_lookups_apart():
    from disagg.cluster.bench.sweep import prefix_cache_of

    def stats(q, h, pq, ph):
        return {"instances": [{"name": f"colocated-{i}", "prefix_query_tokens": q, "prefix_hit_tokens": h,
                               "prefix_preempted_query_tokens": pq, "prefix_preempted_hit_tokens": ph}
                              for i in range(2)]}

    got = prefix_cache_of(stats(100, 0, 50, 10), stats(300, 0, 550, 110))
    assert (got["hit_rate"], got["query_tokens"], got["hit_tokens"]) == (0.0, 400, 0)
    assert got["preempted"] == {"query_tokens": 1000, "hit_tokens": 200}


@pytest.mark.parametrize("keep", [False, True])
def test_each_run_resets_the_prefix_cache_unless_kept(stand_in, tmp_path, keep):
    result = CliRunner().invoke(_app(), [
        "bench", TINY_COLOCATED, "--no-compare", "--num-prompts", "3", "--request-rate", "100,inf",
        "--random-input-len", "8", "--random-output-len", "2", "--result-dir", str(tmp_path), "--save-result",
        "--disable-tqdm"] + (["--keep-prefix-cache"] if keep else []), env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert stand_in.num_resets == (0 if keep else 2)
    results = [load_json(str(path)) for path in sorted(tmp_path.glob("**/*qps*.json"))]
    assert [r["prefix_cache_reset"] for r in results] == [not keep] * 2


def test_sweep_extends_to_a_limit_outside_the_rates_run(stand_in, tmp_path):
    """With extend_to_limit, a side that held every rate runs one more at twice the highest: its
    limit lands inside its own rates (upward only: the shorter run)."""
    from disagg.cluster.bench.report import build_result
    from disagg.cluster.bench.runner import RunResult
    from disagg.cluster.bench.metrics import RequestOutput
    from disagg.cluster.bench.sweep import limit_rate

    def at(rate, ttft):
        out = RequestOutput(True, 4, 3, ttft=ttft, itl=[0.01, 0.01], latency=ttft + 0.02, start_time=0.0,
                            expected_output_len=3)
        return build_result(RunResult([out], 1.0, rate, 1.0, None))
    slos = {"ttft": 100}
    assert limit_rate([at(1.0, 0.01), at(2.0, 0.01)], slos) == 4.0           # held both: above them
    assert limit_rate([at(2.0, 0.5), at(1.0, 0.5)], slos) is None            # missed both: not lower
    assert limit_rate([at(1.0, 0.01), at(2.0, 0.5)], slos) is None           # bracketed
    assert limit_rate([at(math.inf, 0.01)], slos) is None
    summary = cmp.quick_compare(TINY_1P1D, TINY_COLOCATED, str(tmp_path), num_prompts=4, rates=(100.0, 50.0),
                                goodput={"ttft": 5000, "tpot": 5000}, input_len=8, output_len=3,
                                extend_to_limit=1)
    for side, run in zip(summary["sides"], summary["runs"]):
        assert side["rates"] == [50.0, 100.0, 200.0] and len(run["result_files"]) == 3   # ascending
    again = cmp.quick_compare(TINY_1P1D, TINY_COLOCATED, str(tmp_path / "b"), num_prompts=4, rates=(100.0,),
                              goodput={"ttft": 5000, "tpot": 5000}, input_len=8, output_len=3)
    assert [side["rates"] for side in again["sides"]] == [[100.0], [100.0]]   # off by default


def test_a_launched_fleet_is_swept_and_the_caveat_replaces_the_goodput_table(stand_in, tmp_path, capsys):
    """`make demo`'s path: the fleet it streamed on is the first side (one launch fewer), and on
    one shared GPU a caveat stands in for the goodput table (printed, and in summary.md)."""
    from disagg.config import Config

    fleet = StandInCluster(Config.from_yaml(TINY_1P1D))
    caveat = "one GPU: both sides time-slice it, so their goodput cannot compare deployments"
    summary = cmp.quick_compare(TINY_1P1D, TINY_COLOCATED, str(tmp_path), num_prompts=3, rates=(100.0,),
                                goodput={"ttft": 5000, "tpot": 5000}, input_len=8, output_len=3,
                                launched=fleet, caveat=caveat)
    assert [c.mode for c in stand_in.launched] == ["colocated"]               # the 1P1D side was handed in
    assert summary["notes"] == [caveat]
    out = " ".join(capsys.readouterr().out.split())
    assert caveat in out and "Goodput per" not in out and "At a common rate: 100 req/s" in out
    assert f"- NOTE: {caveat}" in (tmp_path / "summary.md").read_text()
    with pytest.raises(ValueError, match="launched"):
        bench_config(TINY_1P1D, SweepOptions(num_prompts=1), overrides={"scheduler.max_num_seqs": 2},
                     launched=fleet)
