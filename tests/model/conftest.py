"""Model test fixtures: kernel paths and the real SmolLM2 weights.

`reference_kernels` runs the kernel launchers' torch references (TRITON_INTERPRET=0; the variable
is read at call time) for real-size models, whose Triton-interpreter runs would take minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helper module paged_runner


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU kernels run their torch references in this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
