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
    result = subprocess.run([sys.executable, "-m", "disagg.cluster.demo", "--config",
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
