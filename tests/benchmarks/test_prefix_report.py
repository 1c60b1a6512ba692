"""`benchmarks/prefix_report.py` (the prefix cache's figures from `run_prefix.sh`): per-rate median TTFT
ratios of uncached to cached runs, and 1P1D's pushed bytes per request beside 1 - the decode hit."""

from __future__ import annotations

import json
from pathlib import Path


def _result(folder: Path, label: str, rate: float, ttft: float, hits: dict | None, pushed: int, n: int = 10) -> None:
    instances = {name: {"hit_rate": h, "query_tokens": 100, "hit_tokens": int(100 * h)} for name, h in (hits or {}).items()}
    body = {"label": label, "request_rate": rate, "completed": n, "git_commit": "abc", "median_ttft_ms": ttft,
            "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": 8.0, "request_throughput": rate,
            "prefix_cache": {"hit_rate": sum((hits or {0: 0}).values()) / max(1, len(hits or {0: 0})),
                             "instances": instances, "pushed_bytes": pushed}}
    (folder / label).mkdir(parents=True, exist_ok=True)
    (folder / label / f"{label}-{rate}qps-x.json").write_text(json.dumps(body))


def test_ratios_per_rate_and_pushed_bytes_against_the_decode_hit(tmp_path, capsys, monkeypatch, benchmark_script):
    _result(tmp_path, "colocated-prefix-true", 4.0, 35.0, {"colocated-0": 0.88}, 0)
    _result(tmp_path, "colocated-prefix-false", 4.0, 70.0, {"colocated-0": 0.0}, 0)
    _result(tmp_path, "colocated-prefix-true", 12.0, 33.0, {"colocated-0": 0.88}, 0)
    _result(tmp_path, "colocated-prefix-false", 12.0, 114.0, {"colocated-0": 0.0}, 0)
    _result(tmp_path, "1p1d-prefix-true", 4.0, 40.0, {"prefill-0": 0.8, "decode-0": 0.75}, 250)
    _result(tmp_path, "1p1d-prefix-false", 4.0, 120.0, {"prefill-0": 0.0, "decode-0": 0.0}, 1000)
    module = benchmark_script("prefix_report")
    monkeypatch.setattr("sys.argv", ["prefix_report", str(tmp_path)])
    module.main()
    report = json.loads((tmp_path / "prefix_report.json").read_text())
    pairs = {(p["kind"], p["rate"]): p for p in report["pairs"]}
    assert pairs["colocated", 4.0]["median_ttft_ratio"] == 2.0
    assert round(pairs["colocated", 12.0]["median_ttft_ratio"], 3) == round(114 / 33, 3)
    assert pairs["1p1d", 4.0]["pushed_ratio"] == 0.25 and pairs["1p1d", 4.0]["one_minus_decode_hit"] == 0.25
    assert "pushed_ratio" not in pairs["colocated", 4.0]  # a colocated run pushes nothing
    assert "1p1d-prefix-true" in capsys.readouterr().out
