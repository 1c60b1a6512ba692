"""Fixtures of the bench tests. The folder goes on sys.path so the tests import `stand_in` by name
(importlib mode puts no test folder there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import disagg.cluster  # noqa: E402
from stand_in import StandInCluster  # noqa: E402


@pytest.fixture
def stand_in(monkeypatch):
    """`disagg.cluster.Cluster` replaced by StandInCluster for the test; its launches recorded."""
    StandInCluster.launched = []
    StandInCluster.num_resets = 0
    monkeypatch.setattr(disagg.cluster, "Cluster", StandInCluster, raising=False)
    return StandInCluster
