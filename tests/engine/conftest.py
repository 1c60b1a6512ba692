"""Fixtures of the engine tests: the tiny dummy model, the torch reference path, a plain greedy
loop to compare against, and helpers that drive engines to completion.

The folder is put on sys.path so that spawned workers can import `engine_scenarios` by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model():
    """dummy:tiny in float32 on the CPU (seeded weights: the same in every process)."""
    import torch

    from disagg.model import load_model

    return load_model("dummy:tiny", dtype=torch.float32, device="cpu")


@pytest.fixture
def torch_reference(monkeypatch):
    """Run the kernels' torch references (not the Triton interpreter) for this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
