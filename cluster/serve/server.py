"""Running the app under uvicorn: in the foreground (`disagg serve`) or in a thread (tests, bench).

`run_server(app, host, port)` blocks until SIGINT/SIGTERM. `BackgroundServer` starts uvicorn in
a daemon thread on an already-bound socket (port 0 gives an ephemeral port, known before the
first request), waits until it accepts, and stops it on exit; it is what `disagg serve`, the tests
and `disagg bench` use. A port that cannot be bound raises `BindError` (one sentence naming
host:port and the likely fix), before anything else starts.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from disagg.errors import DisaggError

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_BIND_HINTS = {
    errno.EADDRINUSE: "another process listens there; stop it or choose another --port or serve.port",
    errno.EADDRNOTAVAIL: "not an address of this machine; use --host 127.0.0.1, 0.0.0.0 or one of its addresses",
    errno.EACCES: "ports below 1024 need privileges; choose a port >= 1024",
}


class BindError(DisaggError, OSError):
    """The HTTP port cannot be bound: in use, a host that is not this machine's, no permission.

    Attributes:
        host: the bind address asked for.
        port: the TCP port asked for.
    """

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        if isinstance(cause, socket.gaierror):
            hint = "unknown host; use --host 127.0.0.1, 0.0.0.0 or a name this machine resolves"
        else:
            hint = _BIND_HINTS.get(cause.errno, "")
        reason = cause.strerror or str(cause)
        super().__init__(f"cannot listen on {host}:{port}: {reason}" + (f" ({hint})" if hint else ""))
        self.host, self.port = host, port


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str, root_path: str = "") -> uvicorn.Config:
    # h11 (pure Python) keeps behaviour identical everywhere; the access log is off on the hot path.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, root_path=root_path,
                          http="h11", lifespan="off", timeout_graceful_shutdown=5)


def run_server(app: FastAPI, host: str = LOOPBACK, port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` until interrupted (blocking)."""
    if host not in (LOOPBACK, "localhost", "::1"):
        logger.warning("serving on %s:%d: reachable from other machines (serve.host); set serve.api_key", host, port)
    uvicorn.Server(_uvicorn_config(app, host, port, log_level)).run()


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not listening yet; uvicorn listens on it).

    Raises:
        BindError: the address is in use, not this machine's, unknown, or needs privileges.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, never a live one
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise BindError(host, port, err) from None
    return sock


class BackgroundServer:
    """uvicorn in a daemon thread, as a context manager.

    Args:
        app: the ASGI app.
        host: bind address (loopback by default).
        port: TCP port; 0 picks a free one.
        log_level: uvicorn's log level.
        root_path: the path prefix a reverse proxy strips (`--root-path`); "" for none.

    Attributes:
        port: the bound port.
        base_url: ``http://host:port``.

    Raises:
        BindError: host:port cannot be bound (raised by the constructor, before any thread starts).
    """

    def __init__(self, app: FastAPI, host: str = LOOPBACK, port: int = 0, log_level: str = "warning",
                 root_path: str = "") -> None:
        self.app = app
        self._sock = _bound_socket(host, port)
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        self._server = uvicorn.Server(_uvicorn_config(app, host, self.port, log_level, root_path))
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
