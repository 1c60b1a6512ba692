"""SLO attainment, DistServe's per-GPU goodput read off a rate sweep, SLO-scale sweeps, result
JSON that recomputes from its own per-request lists, and the plots."""

from __future__ import annotations

import math

import pytest

from disagg.cluster.bench import compare as cmp
from disagg.cluster.bench import plots
from disagg.cluster.bench.metrics import RequestOutput
from disagg.cluster.bench.report import build_result, check_result, load_json, recompute_metrics, save_json
from disagg.cluster.bench.runner import RunResult


def test_goodput_interpolates_the_crossing():
    got = cmp.per_gpu_goodput([1, 2, 4], [1.0, 0.95, 0.5], num_gpus=2)
    rate = 2 + (0.95 - 0.9) * (4 - 2) / (0.95 - 0.5)
    assert got["bound"] == "interpolated"
    assert got["rate"] == pytest.approx(rate)
    assert got["per_gpu_goodput"] == pytest.approx(rate / 2)


def test_goodput_edges():
    # unsorted input, inf ignored, exactly 90% holds
    got = cmp.per_gpu_goodput([4, math.inf, 1, 2], [0.9, 0.0, 1.0, 0.95], 1)
    assert got == {"per_gpu_goodput": 4.0, "rate": 4.0, "bound": "at_least"}
    assert cmp.per_gpu_goodput([1, 2], [0.5, 0.2], 2) == {"per_gpu_goodput": 0.0, "rate": 0.0, "bound": "below_range"}
    assert cmp.per_gpu_goodput([math.inf], [1.0], 2)["bound"] == "no_data"
    # the first crossing counts, even if a noisy later point climbs back
    assert cmp.per_gpu_goodput([1, 2, 3], [1.0, 0.8, 0.95], 1)["rate"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="equal lengths"):
        cmp.per_gpu_goodput([1, 2], [1.0], 1)
    with pytest.raises(ValueError, match="num_gpus"):
        cmp.per_gpu_goodput([1], [1.0], 0)


def _run(rate: float, ttfts: list[float], tpot: float, failed: int = 0) -> RunResult:
    outs = [RequestOutput(True, 8, 3, ttft=t, itl=[tpot, tpot], latency=t + 2 * tpot, start_time=i,
                          expected_output_len=3, client_overheads=[0.001, 0.002, 0.001])
            for i, t in enumerate(ttfts)]
    outs += [RequestOutput(False, 8, 0, start_time=9, expected_output_len=3, error="boom")] * failed
    return RunResult(outs, duration_s=len(outs) / rate if math.isfinite(rate) else 1.0, request_rate=rate,
                     burstiness=1.0, max_concurrency=None)


def _sweep(label: str, degrade: float) -> list[dict]:
    results = []
    for rate in (1.0, 2.0, 4.0, math.inf):
        slow = min(10, int(rate * degrade)) if math.isfinite(rate) else 10
        ttfts = [0.05] * (10 - slow) + [0.5] * slow
        results.append(build_result(_run(rate, ttfts, 0.02), goodput_slos_ms={"ttft": 100, "tpot": 30},
                                    label=label, workload={"dataset_name": "random"}, config={"x": 1}))
    return results


def test_result_json_recomputes_from_its_lists(tmp_path):
    result = build_result(_run(2.0, [0.1, 0.2, 0.4], 0.03, failed=1), goodput_slos_ms={"ttft": 250, "tpot": 40},
                          label="a", workload={"dataset_name": "random"}, config={"model": "m"})
    path = save_json(result, tmp_path / "r.json")
    loaded = load_json(path)
    check_result(loaded)
    assert loaded["request_rate"] == 2.0 and loaded["completed"] == 3 and loaded["failed"] == 1
    assert loaded["slo_attainment"] == pytest.approx(0.5)
    for key in ("git_commit", "device", "workload", "config", "ttfts", "itls", "output_lens", "errors"):
        assert key in loaded
    # judged again under other SLOs without the run
    assert recompute_metrics(loaded, {"ttft": 150})["slo_attainment"] == pytest.approx(0.25)
    loaded["p99_ttft_ms"] += 1.0
    with pytest.raises(ValueError, match="p99_ttft_ms"):
        check_result(loaded)
    inf_result = build_result(_run(math.inf, [0.1], 0.01))
    assert inf_result["request_rate"] == "inf"
    check_result(load_json(save_json(inf_result, tmp_path / "inf.json")))


def test_side_summary_and_comparison():
    slos = {"ttft": 100, "tpot": 30}
    good, bad = _sweep("disagg", degrade=0.5), _sweep("colocated", degrade=2.0)
    sides = [cmp.side_summary("disagg", good, 2, slos, (1.0, 10.0)),
             cmp.side_summary("colocated", bad, 2, slos, (1.0, 10.0))]
    # disagg: 1 slow of 10 at rate 2 (0.9 holds), 2 at rate 4 -> crossing at 4; colocated: 2 at rate 1
    assert sides[0]["attainment"][:3] == pytest.approx([1.0, 0.9, 0.8])
    assert sides[0]["rate"] == pytest.approx(2.0) and sides[0]["per_gpu_goodput"] == pytest.approx(1.0)
    assert sides[1]["bound"] == "below_range"
    summary = cmp.compare_sides(sides, slos)
    strict, loose = summary["rows"]
    # colocated below its lowest rate (1 req/s on 2 GPUs: < 0.5 per GPU): the ratio is a lower bound
    assert strict["best_other"] == "colocated" and strict["ratio_bound"] == "at_least"
    assert strict["ratio"] == pytest.approx(1.0 / 0.5)
    assert loose["per_gpu_goodput"]["colocated"] == pytest.approx(2.0)        # 10x SLOs: every rate holds
    assert loose["ratio"] is None and loose["ratio_bound"] is None             # both at least 2: no order
    curve = cmp.slo_scale_curve(good[2], slos, (1.0, 10.0))
    assert curve == [(1.0, pytest.approx(0.8)), (10.0, pytest.approx(1.0))]
    with pytest.raises(ValueError, match="--slo-scales"):
        cmp.scale_slos(slos, 0.0)


def test_each_side_is_judged_at_its_best_variant():
    """Variants of the config under test ("[...]" labels, e.g. a prefill budget set with --set)
    compete among themselves as the compared config's do: the ratio is best own / best other."""
    slos = {"ttft": 100, "tpot": 30}
    sweeps = {"1p1d[max_num_batched_tokens=8192]": 2.0, "1p1d[max_num_batched_tokens=2048]": 0.25,
              "colocated[max_num_batched_tokens=512]": 2.0, "colocated[max_num_batched_tokens=2048]": 0.5}
    sides = [cmp.side_summary(label, _sweep(label, degrade), 2, slos, (1.0,)) for label, degrade in sweeps.items()]
    goodput = {side["label"]: side["per_gpu_goodput"] for side in sides}
    (row,) = cmp.compare_sides(sides, slos)["rows"]
    assert row["best_own"] == "1p1d[max_num_batched_tokens=2048]"
    assert row["best_other"] == "colocated[max_num_batched_tokens=2048]"
    assert goodput[row["best_own"]] > goodput["1p1d[max_num_batched_tokens=8192]"]
    assert row["ratio"] == pytest.approx(goodput[row["best_own"]] / goodput[row["best_other"]])
    assert row["ratio"] > 1.0 and row["ratio_bound"] == "at_least"   # 2048 held every rate: >= 2.0 per GPU
    # One variant under test: the side under test itself.
    (row,) = cmp.compare_sides(sides[:1] + sides[2:], slos)["rows"]
    assert row["best_own"] == "1p1d[max_num_batched_tokens=8192]"  # below range: < 0.5 per GPU
    assert row["ratio_bound"] == "at_most" and row["ratio"] == pytest.approx(0.5 / goodput[row["best_other"]])
    assert cmp.family("llama3-8b-colocated[max_num_batched_tokens=2048]") == "llama3-8b-colocated"


def test_plots_are_written(tmp_path):
    slos = {"ttft": 100, "tpot": 30}
    by_label = {"disagg": _sweep("disagg", 0.5), "colocated": _sweep("colocated", 2.0)}
    sides = [cmp.side_summary(label, results, 2, slos, (0.5, 1.0, 2.0)) for label, results in by_label.items()]
    summary = {"sides": sides, "comparison": cmp.compare_sides(sides, slos), "slos_ms": slos,
               "slo_scales": [0.5, 1.0, 2.0]}
    files = plots.write_all(by_label, summary, tmp_path)
    names = sorted(p.split("/")[-1] for p in files)
    assert names == ["attainment_vs_rate.png", "attainment_vs_slo_scale.png", "throughput_vs_rate.png",
                     "tpot_cdf.png", "ttft_cdf.png"]
    for path in files:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert summary["at_common_rate"]["rate"] == 2.0     # colocated holds 60% at 2, 20% at 4
    assert plots.common_rate({"a": by_label["disagg"]}, slos) == 4.0


def test_gpu_utilization_parsing_and_cpu_host(monkeypatch):
    from disagg.cluster.bench import utilization

    lines = ["0, 80", "1, 20", "0, 100", "1, [N/A]", "index, utilization.gpu", "1, 40", "0, 9"]
    assert utilization.mean_utilization(lines) == {"gpu0": pytest.approx(189 / 300), "gpu1": pytest.approx(0.3)}
    assert utilization.mean_utilization(["garbage"]) is None
    monkeypatch.setattr(utilization.shutil, "which", lambda name: None)
    with utilization.sample_gpus() as holder:
        pass
    assert holder["gpu_utilization"] is None


def test_ratio_is_a_bound_when_a_goodput_is_and_none_when_the_sweep_cannot_order_them():
    """A side that held every rate is at least its top rate, one that missed the lowest is below
    it: the ratio is then a bound, and two sides open the same way have no ratio (not 1.0)."""
    exact, at_least, below = "interpolated", "at_least", "below_range"
    assert cmp.bounded_ratio((2.0, exact, 1.0), (1.0, exact, 0.5)) == (2.0, "exact")
    assert cmp.bounded_ratio((4.0, at_least, 1.0), (2.0, exact, 1.0)) == (2.0, "at_least")
    assert cmp.bounded_ratio((2.0, exact, 1.0), (4.0, at_least, 1.0)) == (0.5, "at_most")
    assert cmp.bounded_ratio((4.0, at_least, 1.0), (0.0, below, 1.0)) == (4.0, "at_least")   # other < 1
    assert cmp.bounded_ratio((0.0, below, 1.0), (2.0, exact, 0.5)) == (0.5, "at_most")       # mine < 1
    assert cmp.bounded_ratio((4.0, at_least, 1.0), (4.0, at_least, 1.0)) == (None, None)
    assert cmp.bounded_ratio((0.0, below, 1.0), (0.0, below, 2.0)) == (None, None)
    assert cmp.bounded_ratio((None, "no_data", None), (1.0, exact, 1.0)) == (None, None)
    # one GPU's time-sliced pair held the one rate run: "4.000+" both, and no ratio rather than 1.000
    slos = {"ttft": 100, "tpot": 30}
    held = [build_result(_run(4.0, [0.05] * 10, 0.02), goodput_slos_ms=slos, label=label) for label in "ab"]
    sides = [cmp.side_summary(label, [result], 1, slos, (1.0,)) for label, result in zip("ab", held)]
    (row,) = cmp.compare_sides(sides, slos)["rows"]
    assert row["bound"] == {"a": "at_least", "b": "at_least"} and row["ratio"] is None


def _summary(degrade: float, folder) -> dict:
    """A comparison of `_sweep`s (colocated degrading twice as fast), its common rate filled in."""
    slos = {"ttft": 100, "tpot": 30}
    by_label = {"disagg": _sweep("disagg", degrade), "colocated": _sweep("colocated", 2 * degrade)}
    sides = [cmp.side_summary(label, results, 2, slos, (1.0,)) for label, results in by_label.items()]
    summary = {"dataset": "random", "sides": sides, "comparison": cmp.compare_sides(sides, slos),
               "slos_ms": slos, "slo_scales": [1.0], "context": {}}
    plots.write_all(by_label, summary, folder)
    return summary


def test_summary_md_common_rate_heading_says_what_its_rows_are(tmp_path):
    """The common-rate section's heading claims ">= 50% attainment" only where its rows held it;
    a rate no deployment held 50% at is named as the fallback it is (the lowest rate run)."""
    from disagg.cluster.bench.markdown import comparison_summary

    collapsed = _summary(degrade=20.0, folder=tmp_path / "a")      # every request misses at every rate
    assert collapsed["at_common_rate"]["rate"] == 1.0 and collapsed["at_common_rate"]["disagg"]["attainment"] == 0
    text = comparison_summary({"random": collapsed})
    heading = next(line for line in text.splitlines() if line.startswith("At a common rate"))
    assert "the lowest rate every deployment ran" in heading and "did each hold >= 50%" in heading, heading
    assert "highest rate" not in heading, heading
    held = _summary(degrade=0.5, folder=tmp_path / "b")            # 80% and 60% at 4: held
    heading = next(line for line in comparison_summary({"random": held}).splitlines()
                   if line.startswith("At a common rate"))
    assert "the highest rate every deployment ran at while each held >= 50%" in heading, heading
    both = comparison_summary({"random": held, "chat": collapsed})   # one of each: the fallback starred
    assert "where none did (rate marked '*'), the lowest rate they all ran" in both
    assert "| chat | disagg | 1* |" in both and "| random | disagg | 4 |" in both


def test_summary_md_names_each_goodput(tmp_path):
    """summary.md tells the comparison's goodput (per GPU at 90% attainment, interpolated) from a
    run's request goodput (requests meeting the SLOs per second of that run)."""
    from disagg.cluster.bench.markdown import comparison_summary

    text = comparison_summary({"random": _summary(degrade=0.5, folder=tmp_path)})
    assert "Goodput: the highest offered rate per GPU at which >= 90% of the requests meet every SLO, " \
           "interpolated between the last rate run that held and the first that missed" in text
    assert "not a run's request goodput: the requests of one run that met every SLO, per second of that " \
           "run, at its offered rate" in text
