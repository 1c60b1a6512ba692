"""Fixtures of the HTTP server tests: a server over a `FakeCluster` (for the HTTP layer alone).

The folder goes on sys.path so the tests import `fake_cluster` by name (importlib mode puts no
test folder there). Servers bind 127.0.0.1 on an ephemeral port and stop after each test: told to
at its end, while the next test runs (uvicorn exits on its next 0.1-s tick; waiting for it was
~0.15 s of each of ~60 tests), and every one is joined before the session ends.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_cluster import CharTokenizer, FakeCluster  # noqa: E402

from disagg.cluster.serve import BackgroundServer, build_app  # noqa: E402


@pytest.fixture(scope="session")
def stopping_servers():
    """Threads stopping the servers of finished tests; all joined at the end of the session."""
    threads: list[threading.Thread] = []
    yield threads
    for thread in threads:
        thread.join()


@pytest.fixture
def serve_fake(stopping_servers):
    """serve_fake(cluster=None, **build_app_kwargs) -> (BackgroundServer, FakeCluster); stopped afterwards."""
    servers = []

    def start(cluster: FakeCluster | None = None, **kwargs):
        cluster = cluster if cluster is not None else FakeCluster(tokenizer=CharTokenizer())
        server = BackgroundServer(build_app(cluster, **kwargs)).start()
        servers.append(server)
        return server, cluster

    yield start
    for server in servers:
        stopping_servers.append(threading.Thread(target=server.stop, name=f"stop-{server.port}"))
        stopping_servers[-1].start()
