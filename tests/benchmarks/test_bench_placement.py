"""CPU check of benchmarks/bench_placement.py: it times both ways on a small fleet, over a ledger
whose sums it checks against the live requests', and refuses a malformed shape."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("bench_placement")


def test_a_small_shape_reports_both_ways_and_the_moves(bench):
    row = bench.shape(4, 60, repeats=2)
    assert (row["instances"], row["live"]) == (4, 60)
    assert all(row[key] > 0 for key in ("summed_ms", "ledger_ms", "touch_us", "advance_us", "audit_ms"))


def test_the_cli_writes_json_and_refuses_a_bad_shape(bench, tmp_path, monkeypatch, capsys):
    out = tmp_path / "placement.json"
    monkeypatch.setattr(sys, "argv", ["bench_placement.py", "--shapes", "2:10", "--repeats", "1", "--out", str(out)])
    bench.main()
    assert [r["live"] for r in json.loads(out.read_text())["rows"]] == [10]
    monkeypatch.setattr(sys, "argv", ["bench_placement.py", "--shapes", "1:10"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "expected INSTANCES >= 2" in capsys.readouterr().err
