"""CPU check of benchmarks/bench_tensor_parallel.py (`bench_engine.py --tensor-parallel N`): two
rank processes over gloo time a tiny model's decode step and prefill at TP=2 against TP=1, and
the JSON carries both and their ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("bench_tensor_parallel")


def test_tp2_over_gloo_reports_both_sides_and_their_ratios(bench, benchmark_script, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: the path is checked, not them
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import the scripts by name
    out = tmp_path / "tp.json"
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", "--tensor-parallel", "2", "--model", "dummy:tiny",
                                      "--device", "cpu", "--batches", "2", "--contexts", "32", "--out", str(out)])
    benchmark_script("bench_engine").main()  # its flag hands over to bench_tensor_parallel
    result = json.loads(out.read_text())
    assert (result["tensor_parallel"], result["backend"], result["model"]) == (2, "gloo", "dummy:tiny")
    decode, prefill = result["rows"]
    assert decode["name"] == "decode_B2_ctx32_tp2" and prefill["name"] == "prefill_2x32_tp2"
    assert decode["ratio"] == pytest.approx(decode["ours_us"] / decode["anchor_us"])
    assert prefill["ratio"] == pytest.approx(prefill["ours_tokens_per_s"] / prefill["anchor_tokens_per_s"])


def test_fewer_than_two_ranks_is_refused(bench):
    with pytest.raises(ValueError, match="at least 2 ranks"):
        bench.run(1, model="dummy:tiny", device="cpu")
