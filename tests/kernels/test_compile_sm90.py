"""The layer kernels compile for sm_90 (H100/H200) on a CPU machine, and their PTX shows what the
GPU will run: the skinny GEMM streams weights with cp.async into wgmma (64 rows) or mma.sync (16),
split-K arrives through an acquire-release atomic, under PDL the weights' first lines are
prefetched into L2 before the wait, and `PDL=True` emits the grid-dependency wait
and trigger while `PDL=False` emits neither. Catches a kernel that would not build, or would
build into scalar loads, before GPU time is spent on it.

Compiling needs Triton's compiled mode, so `sm90_compile.py` runs in a subprocess with
`TRITON_INTERPRET=0` (ptxas ships in Triton's wheel; no GPU or driver is used).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=SCRIPT.parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_skinny_gemm_pipelines_weights_into_tensor_cores(rows):
    linear = [r for r in rows if r["kernel"] == "linear"]
    assert len(linear) == 3
    for r in linear:
        assert r["cp.async.cg"] > 0 and r["ld.global.b16"] == 0, r
        assert (r["wgmma.mma"] > 0) if r["block_m"] == 64 else (r["mma.sync"] > 0), r
        assert (r["atom.global"] > 0) == (r["split_k"] > 1), r
        assert (r["prefetch.global.L2"] > 0) == r["pdl"], f"weights prefetched while waiting: {r}"
        assert r["shared"] <= 114 * 1024, f"two programs must fit on an SM: {r}"


def test_pdl_flag_controls_the_grid_dependency_instructions(rows):
    for r in rows:
        assert r["ld.global.b16"] == 0, f"scalar 16-bit loads (not vectorized): {r}"
        want = 1 if r["pdl"] else 0
        assert (r["griddepcontrol.wait"], r["griddepcontrol.launch"]) == (want, want), r
    assert {r["kernel"] for r in rows if r["pdl"]} == {"linear", "add_rms_norm", "silu_mul", "apply_rope",
                                                         "rope_append"}
