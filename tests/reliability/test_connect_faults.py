"""Replay of the ways a launch can fail to reach Ray, with counts, on CPU.

1. Unreachable or wrong ``cluster.address`` values, joined in process with a 1 s
   ``cluster.connect_timeout_s``: closed ports (IPv4, localhost, ray://), a host that does not
   resolve, a non-routable and a silent address, local listeners that are silent, hang up, or
   answer without gRPC, and a real gRPC greeting followed by a `ray.init` that hangs, raises a
   multi-line error, or refuses the token. Every one fails with one line naming the address and
   the timeout; none leaves Ray initialized; only the three behind a greeting reach `ray.init`.
2. ``cluster.address: null`` under hostile RAY_ADDRESS values: each starts an embedded head
   (`ray.init(address="local")` on 127.0.0.1), never joins, and says once that it ignored it.
3. Malformed addresses and bind hosts through `disagg check`: exit 2 naming the field, no launch.
`ray.init` is replaced by a recorder (real heads are started in tests/cluster/test_connect.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

from disagg.cluster.cli import app as cli  # noqa: E402
from disagg.cluster.launch import connect as connect_module  # noqa: E402
from disagg.config import Config  # noqa: E402
from disagg.errors import ClusterError  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-1p1d.yaml"
GRPC_SETTINGS = bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])  # what a gRPC server sends first


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _listener(behaviour: str):
    """A loopback TCP server: "silent" accepts and says nothing, "hangup" closes at once, "http"
    answers HTTP/1.1, "grpc" sends a gRPC (HTTP/2 SETTINGS) greeting. Yields its host:port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()
    accepted = []

    def serve():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)
            if behaviour == "hangup":
                conn.close()
            elif behaviour == "http":
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            elif behaviour == "grpc":
                conn.sendall(GRPC_SETTINGS)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


class RayInit:
    """Stands in for ray.init: records each call, then hangs, raises, or returns as told."""

    def __init__(self, then: str = "return"):
        self.then, self.calls, self.release = then, [], threading.Event()

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.then == "hang":
            self.release.wait(60)  # Ray's own retry loop, minutes long
        elif self.then == "raise":
            raise ConnectionError("Failed to connect to GCS at 127.0.0.1:6379.\n"
                                  "Traceback (most recent call last):\n  File ...")
        elif self.then == "refuse token":
            raise ray.exceptions.AuthenticationError("RPC error: InvalidAuthToken: Authentication token is "
                                                     "missing or incorrect.\nMore lines")


# name -> (address or listener behaviour, what ray.init does, text the message must hold)
UNREACHABLE = {
    "closed port": ("closed", "return", "connection refused"),
    "closed port by name": ("closed localhost", "return", "connection refused"),
    "closed ray client port": ("closed ray://", "return", "connection refused"),
    "unresolvable host": ("no-such-host.invalid:6379", "return", "does not resolve"),
    "non-routable host": ("10.255.255.1:6379", "hang", ""),  # no route, or a proxy that answers
    "silent host": ("192.0.2.77:6379", "hang", ""),
    "silent listener": ("silent", "return", "no answer within the timeout"),
    "hang-up listener": ("hangup", "return", "closed this one without a gRPC greeting"),
    "HTTP/1 listener": ("http", "return", "not as a gRPC server"),
    "ray.init hangs": ("grpc", "hang", "ray.init did not return"),
    "ray.init raises": ("grpc", "raise", "ray.init failed: ConnectionError: Failed to connect to GCS"),
    "token refused": ("grpc", "refuse token", "RAY_AUTH_TOKEN"),
}


@contextlib.contextmanager
def _address(spec: str):
    if spec in ("silent", "hangup", "http", "grpc"):
        with _listener(spec) as address:
            yield address
    elif spec.startswith("closed"):
        host = "localhost" if "localhost" in spec else "127.0.0.1"
        yield f"{'ray://' if 'ray://' in spec else ''}{host}:{_closed_port()}"
    else:
        yield spec


def test_every_unreachable_address_fails_within_the_timeout(monkeypatch: pytest.MonkeyPatch):
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    monkeypatch.setattr(connect_module, "enable_token_auth", lambda: None)  # tested in test_connect.py
    counts = {"tried": 0, "ClusterError": 0, "named": 0, "one line": 0, "reached ray.init": 0,
              "left Ray initialized": 0}
    wrong = []
    for name, (spec, then, expected) in UNREACHABLE.items():
        init = RayInit(then)
        monkeypatch.setattr(connect_module.ray, "init", init)
        with _address(spec) as address:
            config = Config.from_yaml(TINY).override({"cluster.address": address, "cluster.connect_timeout_s": 1.0})
            counts["tried"] += 1
            try:
                connect_module.connect(config)
                message = None
            except ClusterError as err:
                message = str(err)
            finally:
                init.release.set()
        counts["ClusterError"] += message is not None
        named = message is not None and f"'{address}' within 1 s (cluster.connect_timeout_s)" in message \
            and expected in message
        counts["named"] += named
        counts["one line"] += message is not None and "\n" not in message
        counts["reached ray.init"] += bool(init.calls)
        counts["left Ray initialized"] += ray.is_initialized()
        if not named:
            wrong.append(f"{name}: {message!r}")
    behind_greeting = sum(spec == "grpc" for spec, _, _ in UNREACHABLE.values())
    reached = counts.pop("reached ray.init")
    assert counts == {"tried": len(UNREACHABLE), "ClusterError": len(UNREACHABLE), "named": len(UNREACHABLE),
                      "one line": len(UNREACHABLE), "left Ray initialized": 0}, "\n".join(wrong)
    # the two real remote addresses reach ray.init only where a proxy answers for them
    assert behind_greeting <= reached <= behind_greeting + 2


HOSTILE_RAY_ADDRESS = ["garbage-host:not-a-port", "auto", "127.0.0.1:1", "10.255.255.1:6379",
                       "ray://10.255.255.1:10001", "local", ""]


def test_null_address_starts_an_embedded_head_whatever_ray_address_says(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture):
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    monkeypatch.setattr(connect_module, "enable_token_auth", lambda: None)  # tested in test_connect.py
    counts = {"tried": 0, "embedded": 0, "on loopback": 0, "joined": 0, "said ignored": 0}
    for value in HOSTILE_RAY_ADDRESS:
        monkeypatch.setenv("RAY_ADDRESS", value)
        init = RayInit()
        monkeypatch.setattr(connect_module.ray, "init", init)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="disagg.cluster.launch.connect"):
            started = connect_module.connect(Config.from_yaml(TINY))
        counts["tried"] += 1
        (kwargs,) = init.calls
        counts["embedded"] += started and kwargs["address"] == "local"
        counts["on loopback"] += kwargs.get("_node_ip_address") == "127.0.0.1"
        counts["joined"] += kwargs["address"] != "local"
        counts["said ignored"] += sum(f"RAY_ADDRESS={value} in the environment is ignored" in r.getMessage()
                                      for r in caplog.records)
    said = sum(bool(value) for value in HOSTILE_RAY_ADDRESS)
    assert counts == {"tried": len(HOSTILE_RAY_ADDRESS), "embedded": len(HOSTILE_RAY_ADDRESS),
                      "on loopback": len(HOSTILE_RAY_ADDRESS), "joined": 0, "said ignored": said}


MALFORMED = {
    "port not a number": ("cluster.address", "10.0.0.5:port", "cluster.address: expected host:port"),
    "port zero": ("cluster.address", "10.0.0.5:0", "cluster.address: expected a port in 1-65535"),
    "port too large": ("cluster.address", "10.0.0.5:99999", "cluster.address: expected host:port"),
    "no host": ("cluster.address", ":6379", "cluster.address: expected host:port"),
    "empty ray client": ("cluster.address", "ray://", "cluster.address: expected host:port"),
    "blank": ("cluster.address", "  ", "cluster.address: expected a Ray address"),
    "a path": ("cluster.address", "10.0.0.5:6379/x", "cluster.address: expected host:port"),
    "timeout zero": ("cluster.connect_timeout_s", 0, "cluster.connect_timeout_s: Input should be greater than 0"),
    "bind to a name": ("cluster.bind_host", "localhost", "cluster.bind_host: expected an IP address"),
    "bind to garbage": ("cluster.bind_host", "not-an-ip", "cluster.bind_host: expected an IP address"),
}


def test_malformed_cluster_fields_exit_2_before_launch(monkeypatch: pytest.MonkeyPatch):
    launched = []

    def recorder(config):
        launched.append(config.path)
        raise cli.typer.Exit(99)

    monkeypatch.setattr(cli, "_launch", recorder)  # nothing may get this far
    runner = CliRunner()
    counts = {"tried": 0, "exit_2": 0, "named": 0, "tracebacks": 0}
    wrong = []
    for name, (field, value, expected) in MALFORMED.items():
        result = runner.invoke(cli.app, ["check", str(TINY), "--set", f"{field}={value!r}"])
        counts["tried"] += 1
        counts["exit_2"] += result.exit_code == 2
        counts["named"] += expected in result.output
        counts["tracebacks"] += "Traceback" in result.output
        if result.exit_code != 2 or expected not in result.output:
            wrong.append(f"{name}: exit {result.exit_code}, {result.output.strip()!r}")
    assert counts == {"tried": len(MALFORMED), "exit_2": len(MALFORMED), "named": len(MALFORMED),
                      "tracebacks": 0}, "\n".join(wrong)
    assert launched == []
