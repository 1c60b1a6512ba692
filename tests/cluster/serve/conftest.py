"""Fixtures of the HTTP server tests: a server over a `FakeCluster` (for the HTTP layer alone).

The folder goes on sys.path so the tests import `fake_cluster` by name (importlib mode puts no
test folder there). Servers bind 127.0.0.1 on an ephemeral port and stop after each test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_cluster import CharTokenizer, FakeCluster  # noqa: E402

from disagg.cluster.serve import BackgroundServer, build_app  # noqa: E402


@pytest.fixture
def serve_fake():
    """serve_fake(cluster=None, **build_app_kwargs) -> (BackgroundServer, FakeCluster); stopped afterwards."""
    servers = []

    def start(cluster: FakeCluster | None = None, **kwargs):
        cluster = cluster if cluster is not None else FakeCluster(tokenizer=CharTokenizer())
        server = BackgroundServer(build_app(cluster, **kwargs)).start()
        servers.append(server)
        return server, cluster

    yield start
    for server in servers:
        server.stop()
