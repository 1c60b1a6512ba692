"""Running the app under uvicorn: in the foreground (`disagg serve`) or in a thread (tests, bench).

`run_server(app, host, port)` blocks until SIGINT/SIGTERM. `BackgroundServer` starts uvicorn in
a daemon thread on an already-bound socket (port 0 gives an ephemeral port, known before the
first request), waits until it accepts, and stops it on exit; it is what the tests and
`disagg bench` use to talk HTTP to a cluster in the same process.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    # h11 (pure Python) keeps behaviour identical everywhere; the access log is off on the hot path.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          http="h11", lifespan="off", timeout_graceful_shutdown=5)


def run_server(app: FastAPI, host: str = LOOPBACK, port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` until interrupted (blocking)."""
    if host not in (LOOPBACK, "localhost", "::1"):
        logger.warning("serving on %s:%d: reachable from other machines (serve.host); set serve.api_key", host, port)
    uvicorn.Server(_uvicorn_config(app, host, port, log_level)).run()


class BackgroundServer:
    """uvicorn in a daemon thread, as a context manager.

    Args:
        app: the ASGI app.
        host: bind address (loopback by default).
        port: TCP port; 0 picks a free one.

    Attributes:
        port: the bound port.
        base_url: ``http://host:port``.
    """

    def __init__(self, app: FastAPI, host: str = LOOPBACK, port: int = 0, log_level: str = "warning") -> None:
        self.app = app
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        self._server = uvicorn.Server(_uvicorn_config(app, host, self.port, log_level))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.base_url} within {timeout_s} s")
            time.sleep(0.02)
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
