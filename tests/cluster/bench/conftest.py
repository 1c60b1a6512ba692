"""Fixtures of the bench tests. The folder goes on sys.path so the tests import `stand_in` by name
(importlib mode puts no test folder there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import disagg.cluster  # noqa: E402
from stand_in import StandInCluster  # noqa: E402


def stand_in_for_cluster(monkeypatch: pytest.MonkeyPatch) -> type[StandInCluster]:
    """`disagg.cluster.Cluster` replaced by StandInCluster through ``monkeypatch``; its launches
    recorded from now on."""
    StandInCluster.launched = []
    StandInCluster.num_resets = 0
    monkeypatch.setattr(disagg.cluster, "Cluster", StandInCluster, raising=False)
    return StandInCluster


@pytest.fixture
def stand_in(monkeypatch):
    """`stand_in_for_cluster` for the test."""
    return stand_in_for_cluster(monkeypatch)


@pytest.fixture(scope="module")
def stand_in_module():
    """`stand_in_for_cluster` for a module-scoped fixture (what it builds the module's tests only read)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield stand_in_for_cluster(monkeypatch)
