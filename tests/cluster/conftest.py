"""Fixtures of the cluster tests: one local Ray per test module, sized for the CPU actors.

The folder goes on sys.path so the tests import `cluster_helpers` by name (importlib mode puts
no test folder there). Actors run the kernels' torch reference path (TRITON_INTERPRET=0): the
Triton interpreter is exercised by the kernel and model tests, not through four processes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for the whole module (4 logical CPUs; started once, ~10 s)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="disagg-tests")
    yield ray
    ray.shutdown()
