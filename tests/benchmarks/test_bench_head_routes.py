"""CPU check of benchmarks/bench_head_routes.py (Triton's interpreter, a small shape): every row's
pushed bytes are checked bit-exact before it is timed, and the JSON carries each routed row's
ratio to its same-TP baseline."""

from __future__ import annotations

import os

import pytest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU shape runs in Triton's interpreter")
def test_every_row_lands_bit_exact_and_carries_its_ratio(benchmark_script):
    bench = benchmark_script("bench_head_routes")
    result = bench.run("cpu", None, iters=1)
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == [r[0] for r in bench.ROWS]
    shape = bench.CPU_SHAPE
    per_head = shape["layers"] * 2 * shape["tokens"] * shape["dim"] * 4  # fp32 bytes of one head, every layer
    assert rows["tp1->tp2"]["bytes_pushed"] == rows["tp1->tp1"]["bytes_pushed"] == 8 * per_head
    assert rows["tp2->tp1"]["bytes_pushed"] == rows["tp2->tp2"]["bytes_pushed"] == 4 * per_head
    for name, baseline in (("tp1->tp2", "tp1->tp1"), ("tp2->tp1", "tp2->tp2"), ("tp1->tp1-routed", "tp1->tp1")):
        assert rows[name]["baseline"] == baseline
        assert rows[name]["ratio"] == pytest.approx(rows[name]["gb_per_s"] / rows[baseline]["gb_per_s"])
