"""`benchmarks/summarize_runs.py`: every stored run of a results tree in one row each, judged at
the SLOs the run stored and at twice them, merged comparisons left out."""

from __future__ import annotations

import json
from pathlib import Path


def _result(folder: Path, label: str, rate: float, ttfts: list[float], tpot_s: float) -> None:
    """A stored run of requests of 5 tokens: ``ttfts`` seconds to their first, then ``tpot_s`` apart."""
    n = len(ttfts)
    body = {"label": label, "request_rate": rate, "completed": n, "git_commit": "abc", "simulated": False,
            "workload": {"dataset_name": "chat"}, "goodput": {"ttft": 100.0, "tpot": 10.0},
            "median_ttft_ms": 1e3 * sorted(ttfts)[n // 2], "p99_ttft_ms": 1e3 * max(ttfts), "mean_tpot_ms": 1e3 * tpot_s,
            "p99_tpot_ms": 1e3 * tpot_s, "placements": {"remote": n, "local": 0, "kept": 0},
            "busy_fraction": {"prefill-0": 0.25, "decode-0": 0.5}, "host_cpu": {"router_thread": 0.4, "process": 1.2},
            "successes": [True] * n, "input_lens": [8] * n, "output_lens": [5] * n, "expected_output_lens": [5] * n,
            "ttfts": ttfts, "itls": [[tpot_s] * 4] * n, "latencies": [t + 4 * tpot_s for t in ttfts],
            "start_times": [0.0] * n, "errors": [""] * n, "client_overheads": [[]] * n}
    (folder / label).mkdir(parents=True, exist_ok=True)
    (folder / label / f"{label}-{rate}qps-x.json").write_text(json.dumps(body))


def test_each_run_judged_at_its_slos_and_twice_them(tmp_path, capsys, monkeypatch, benchmark_script):
    root = tmp_path / "chat"
    _result(root, "adaptive", 21.0, [0.05, 0.05, 0.15, 0.25], 0.008)   # 1x: 2 of 4 in; 2x: 3 of 4
    _result(root, "colocated-8192", 24.0, [0.05] * 4, 0.015)           # 1x: TPOT misses; 2x: all in
    _result(root, "merged", 21.0, [0.05] * 4, 0.001)                   # a comparison's copy: left out
    module = benchmark_script("summarize_runs")
    rows = {r["deployment"]: r for r in module.rows(str(root))}
    assert set(rows) == {"adaptive", "colocated-8192"}
    assert (rows["adaptive"]["attainment_1x"], rows["adaptive"]["attainment_2x"]) == (0.5, 0.75)
    assert (rows["colocated-8192"]["attainment_1x"], rows["colocated-8192"]["attainment_2x"]) == (0.0, 1.0)
    assert rows["adaptive"]["source"] == "chat/adaptive" and rows["adaptive"]["placements"]["remote"] == 4
    monkeypatch.setattr("sys.argv", ["summarize_runs", "--table", str(root)])
    module.main()
    out = capsys.readouterr().out
    assert "| chat/adaptive | chat | adaptive | 21 | 50.0% | 75.0% | 150 / 250 | 8.0 | 4 / 0 / 0 | 0.25 / 0.50 | 0.40 / 1.20 |" in out
