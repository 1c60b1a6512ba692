"""Metric functions against hand-computed examples (vLLM's rules: one-token outputs have no
TPOT, failed requests add no latency, percentiles interpolate linearly, ties included)."""

from __future__ import annotations

import math

import pytest

from disagg.cluster.bench.metrics import (
    RequestOutput, compute_metrics, meets_slos, parse_goodput, slo_attainment, summarize)


def _outputs() -> list[RequestOutput]:
    return [
        RequestOutput(True, 10, 3, ttft=0.1, itl=[0.05, 0.05], latency=0.2),       # tpot 0.05
        RequestOutput(True, 20, 1, ttft=0.3, itl=[], latency=0.3),                 # one token: no tpot
        RequestOutput(False, 5, 0, error="RuntimeError: boom"),                    # failed
        RequestOutput(True, 10, 5, ttft=0.2, itl=[0.1] * 4, latency=0.6),          # tpot 0.1
    ]


def test_counts_and_throughputs():
    m = compute_metrics(_outputs(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(24.5)
    assert m["request_goodput"] is None and m["slo_attainment"] is None


def test_latency_statistics_by_hand():
    m = compute_metrics(_outputs(), duration_s=2.0)
    # ttft: [100, 300, 200] ms (the failed request adds nothing)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(0.02 / 3) * 1000)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)   # 200 + 0.8 * (300 - 200)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # tpot: the one-token request is excluded -> [50, 100] ms
    assert m["mean_tpot_ms"] == pytest.approx(75.0)
    assert m["p90_tpot_ms"] == pytest.approx(95.0)
    # itl: every gap of every successful request
    assert m["mean_itl_ms"] == pytest.approx(500.0 / 6)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(1100.0 / 3)
    assert m["median_e2el_ms"] == pytest.approx(300.0)


def test_tpot_property():
    assert RequestOutput(True, 1, 1, ttft=0.1, latency=0.1).tpot is None
    assert RequestOutput(False, 1, 3, ttft=0.1, latency=0.3).tpot is None
    assert RequestOutput(True, 1, 3, ttft=0.1, latency=0.3).tpot == pytest.approx(0.1)


def test_goodput_and_attainment():
    outs = _outputs()
    m = compute_metrics(outs, 2.0, {"ttft": 250, "tpot": 60})
    assert m["request_goodput"] == pytest.approx(0.5)      # only the first request
    assert m["slo_attainment"] == pytest.approx(0.25)      # 1 of 4; the failed one is a miss
    # a one-token request counts as TPOT 0 under a TPOT SLO (vLLM's rule)
    assert compute_metrics(outs, 2.0, {"tpot": 60})["request_goodput"] == pytest.approx(1.0)
    assert slo_attainment(outs, {"tpot": 60}) == pytest.approx(0.5)
    assert slo_attainment(outs, {"e2el": 300}) == pytest.approx(0.5)
    assert slo_attainment([], {"ttft": 1}) == 0.0


def test_slo_boundary_is_inside():
    out = RequestOutput(True, 1, 2, ttft=0.1, itl=[0.05], latency=0.15)
    assert meets_slos(out, {"ttft": 100.0, "tpot": 50.0})
    assert not meets_slos(out, {"ttft": 99.999})


def test_ties_at_a_percentile():
    stats = summarize([0.001, 0.002, 0.002, 0.002, 0.003], "x")
    assert stats["p50_x_ms"] == pytest.approx(2.0)
    assert stats["median_x_ms"] == pytest.approx(2.0)
    assert stats["p90_x_ms"] == pytest.approx(2.6)    # index 3.6: 2 + 0.6 * (3 - 2)
    flat = summarize([0.004] * 4, "y", percentiles=(50, 99, 99.9))
    assert flat["p50_y_ms"] == flat["p99_y_ms"] == flat["p99.9_y_ms"] == pytest.approx(4.0)
    assert flat["std_y_ms"] == 0.0


def test_all_failed_gives_zeros():
    m = compute_metrics([RequestOutput(False, 3, 0, error="x")] * 2, 1.0, {"ttft": 10})
    assert m["completed"] == 0 and m["failed"] == 2
    assert m["mean_ttft_ms"] == 0.0 and m["p99_tpot_ms"] == 0.0
    assert m["request_goodput"] == 0.0 and m["slo_attainment"] == 0.0


def test_client_overhead_statistics():
    out = RequestOutput(True, 1, 2, ttft=0.1, itl=[0.1], latency=0.2, client_overheads=[0.001, 0.003])
    m = compute_metrics([out], 1.0)
    assert m["mean_client_overhead_ms"] == pytest.approx(2.0)
    assert m["p99_client_overhead_ms"] == pytest.approx(2.98)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_duration_must_be_positive(bad):
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics(_outputs(), bad)


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    assert parse_goodput(["ttft:200 tpot:50,e2el:1000"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    with pytest.raises(ValueError, match="tpot expects a number of milliseconds, got 'abc'"):
        parse_goodput(["tpot:abc"])
    with pytest.raises(ValueError, match="must be one of"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="NAME:MILLISECONDS"):
        parse_goodput(["ttft200"])
    with pytest.raises(ValueError, match=">= 0"):
        parse_goodput(["ttft:-1"])


def test_peaks_by_hand():
    outs = [RequestOutput(True, 1, 3, ttft=0.2, itl=[0.5, 0.5], latency=1.2, start_time=10.0),   # tokens 10.2 10.7 11.2
            RequestOutput(True, 1, 2, ttft=0.1, itl=[0.1], latency=0.2, start_time=10.5),        # tokens 10.6 10.7
            RequestOutput(True, 1, 1, ttft=0.1, latency=0.1, start_time=11.2),                  # opens as #1 closes
            RequestOutput(False, 1, 0, start_time=10.0, error="x")]
    m = compute_metrics(outs, 2.0)
    assert m["max_output_tokens_per_s"] == 4.0      # bucket [10, 11): 10.2, 10.6, 10.7, 10.7
    assert m["max_concurrent_requests"] == 2        # [10, 11.2) and [10.5, 10.7) overlap; 11.2 is half-open
