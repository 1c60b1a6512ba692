"""`make demo` end to end on the CPU with the tiny model: launch 1P1D, stream, compare, report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_demo_streams_compares_and_says_where_results_went(tmp_path: Path):
    out = tmp_path / "results"
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, "-m", "disagg.cluster.cli.demo", "--config",
                             str(CONFIGS / "tiny-1p1d.yaml"), "--out", str(out)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = result.stdout
    assert "tiny-1p1d: disaggregated on cpu, heap shm" in text
    assert text.count("finish_reason length") == 3  # three prompts streamed to the end
    assert "tiny-colocated" in text  # the comparison ran against the colocated twin
    assert f"results in {out.resolve()}/" in text
    demo = json.loads((out / "demo.json").read_text())
    assert demo["kind"] == "tiny" and len(demo["streamed"]) == 3
    assert (out / "compare.json").is_file() and list(out.glob("*.png"))
    # the SLOs and rates came from the machine, and were said so; each side ran them all
    assert "measured on tiny-1p1d, 4 requests one at a time: TTFT " in text and "\nso: SLOs TTFT " in text
    rates = demo["sweep"]["rates"]
    assert len(rates) == 3 and rates[2] == 2 * rates[1] and demo["comparison"]["slos_ms"] == demo["sweep"]["slos_ms"]
    assert all(set(rates) <= set(side["rates"]) for side in demo["comparison"]["sides"])
    # runs of about one length: a higher rate sends more requests (a queue past capacity, not one burst)
    for run in demo["comparison"]["runs"]:
        sizes = sorted((r["request_rate"], r["num_prompts"]) for r in map(json.loads, map(
            lambda f: Path(f).read_text(), run["result_files"])))
        assert [n for _, n in sizes] == sorted(n for _, n in sizes) and sizes[0][1] < sizes[-1][1], sizes


def test_cpu_sweep_comes_from_the_machine():
    """SLOs by `--slo-calibrate`'s rule and rates 0.5, 1, 2 x what one request at a time sustains,
    from requests measured one at a time (so each side's limit falls inside the rates run), each
    run as long as the requests take one at a time (fewer of them at the lowest rate)."""
    from disagg.cluster.cli import demo

    calibration = {"isolated_ttft_ms": 200.0, "isolated_tpot_ms": 80.0, "num_requests": 4,
                   "slos_ms": {"ttft": 600.0001, "tpot": 200.0002}, "rule": "ttft = 3.0 x ..."}
    sweep = demo.sweep_from(calibration, output_len=11, run_requests=6)  # 0.2 s + 10 x 0.08 s = 1 s a request
    assert sweep["request_s"] == 1.0 and sweep["rates"] == (0.5, 1.0, 2.0) and sweep["run_seconds"] == 6.0
    assert sweep["slos_ms"] == {"ttft": 600.0, "tpot": 200.0}
    faster = demo.sweep_from(dict(calibration, isolated_ttft_ms=100.0), output_len=11, run_requests=6)
    assert faster["rates"] == (0.55, 1.1, 2.2)                            # 1 / 0.9 s, two digits, then x steps
    first, second, third = demo.describe_sweep(sweep, "smollm2-1p1d").splitlines()
    assert first == ("measured on smollm2-1p1d, 4 requests one at a time: TTFT 200 ms, decode step 80 ms, "
                     "1.00 s a request")
    assert second == ("so: SLOs TTFT 600 ms, TPOT 200 ms (3 x, 2.5 x those); rates 0.5, 1, 2 req/s (0.5, 1, 2 x "
                      "one request at a time; doubled for a side that holds them all), 6 s of requests each")
    assert third.startswith("a few requests a run: where each side's limit lies, not a measurement of it")
    assert demo.WORKLOADS["smollm2"]["rates"] is None and demo.WORKLOADS["tiny"]["rates"] is None


def test_each_kind_compares_as_it_can(monkeypatch):
    """On one GPU (both sides time-slicing it) the comparison gets the one-line reason its figures
    cannot compare deployments, and shows what they do; on the CPU it runs at the measured rates
    and SLOs, one rate more for a side whose limit lies outside them."""
    from disagg.cluster.cli import demo
    from disagg.cluster.bench import compare

    calls = []
    monkeypatch.setattr(compare, "quick_compare", lambda *args, **kwargs: calls.append(kwargs) or {})
    demo.compare("gpu-shared", CONFIGS / "llama3-8b-1gpu-1p1d.yaml", CONFIGS / "llama3-8b-1gpu-colocated.yaml",
                  Path("out"))
    assert calls[-1]["caveat"] == demo.SHARED_GPU_CAVEAT and calls[-1]["rates"] == (4.0,)
    assert "\n" not in demo.SHARED_GPU_CAVEAT and "time-slice" in demo.SHARED_GPU_CAVEAT
    assert "cannot compare deployments" in demo.SHARED_GPU_CAVEAT and "what the runs do show" in demo.SHARED_GPU_CAVEAT
    demo.compare("gpu", CONFIGS / "llama3-8b-1p1d.yaml", CONFIGS / "llama3-8b-colocated.yaml", Path("out"))
    assert calls[-1]["caveat"] is None and calls[-1]["goodput"] is None and calls[-1]["extend_to_limit"] == 0
    sweep = {"rates": (0.45, 0.9, 1.8), "slos_ms": {"ttft": 600.0, "tpot": 200.0}, "run_seconds": 6.7}
    demo.compare("smollm2", CONFIGS / "smollm2-1p1d.yaml", CONFIGS / "smollm2-colocated.yaml", Path("out"), sweep,
                 launched="fleet")
    assert calls[-1]["rates"] == (0.45, 0.9, 1.8) and calls[-1]["goodput"] == sweep["slos_ms"]
    assert calls[-1]["run_seconds"] == 6.7 and calls[-1]["min_prompts"] == demo.MIN_PROMPTS
    assert calls[-1]["extend_to_limit"] == demo.EXTEND_TO_LIMIT >= 1 and calls[-1]["launched"] == "fleet"
