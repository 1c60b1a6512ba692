"""Model test fixtures: kernel paths, CPU threads, the real SmolLM2 weights.

`reference_kernels` runs the kernel launchers' torch references (TRITON_INTERPRET=0; the variable
is read at call time) for real-size models, whose Triton-interpreter runs would take minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the helper module paged_runner


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU kernels run their torch references in this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """One intra-op thread: on a shared 2-core runner, torch's thread pool spin-waits behind
    other processes and small GEMMs take 5-50x longer."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory (converted once, cached outside the repo)."""
    from disagg.model.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except SmolLM2Unavailable as exc:
        pytest.skip(f"real-weights tests need the SmolLM2 GGUF: {exc}")
