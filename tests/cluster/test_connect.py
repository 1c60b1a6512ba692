"""How the launching process reaches Ray (`disagg.cluster.launch.connect`), on CPU.

An unreachable ``cluster.address`` fails within ``cluster.connect_timeout_s`` with one line naming
it, in process and through `disagg check`; ``address: null`` starts an embedded head whatever
RAY_ADDRESS says, with token authentication on and every listening socket on loopback; a head on
loopback can be joined by its address; the actors' config dict holds no API key; and the Ray
version requirement is the first with token authentication.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

from disagg.cluster.cli import app as cli  # noqa: E402
from disagg.cluster.cli.common import EXIT_RUNTIME  # noqa: E402
from disagg.cluster.launch import bootstrap  # noqa: E402
from disagg.cluster.launch.connect import MIN_RAY_VERSION, check_ray_version, connect, enable_token_auth  # noqa: E402
from disagg.config import Config  # noqa: E402
from disagg.errors import ClusterError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-1p1d.yaml"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny(**overrides) -> Config:
    return Config.from_yaml(TINY).override(overrides)


def finishes(fn, limit_s: float = 120.0):
    """fn() run in a thread; fail (rather than hang the suite) when it has not returned in limit_s."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as err:
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still running after {limit_s} s: the call hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch):
    """No Ray in this process and no RAY_ADDRESS or RAY_AUTH_MODE; afterwards Ray is shut down, the
    environment restored and Ray's cached settings re-read from it."""
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process (run this file on its own)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    yield monkeypatch
    ray.shutdown()
    monkeypatch.undo()
    ray._raylet.Config.initialize("")


# ------------------------------------------------------------------ an unreachable address
def test_closed_port_fails_with_the_address_and_timeout(no_ray):
    port = closed_port()
    config = tiny(**{"cluster.address": f"127.0.0.1:{port}", "cluster.connect_timeout_s": 5.0})
    with pytest.raises(ClusterError) as caught:
        finishes(lambda: connect(config))
    message = str(caught.value)
    assert f"cluster.address '127.0.0.1:{port}' within 5 s (cluster.connect_timeout_s)" in message
    assert "connection refused" in message and "ray start --head" in message and "\n" not in message
    assert not ray.is_initialized()


def test_silent_listener_fails_within_the_timeout(no_ray):
    """Something accepts TCP there but never answers: bounded by the timeout, not Ray's retries."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        config = tiny(**{"cluster.address": address, "cluster.connect_timeout_s": 1.0})
        with pytest.raises(ClusterError, match=re.escape(f"'{address}' within 1 s")) as caught:
            finishes(lambda: connect(config))
    assert "no answer within the timeout" in str(caught.value)
    assert not ray.is_initialized()


def test_disagg_check_on_a_closed_port_exits_1_with_one_line(no_ray):
    port = closed_port()
    result = finishes(lambda: CliRunner().invoke(cli.app, [
        "check", str(TINY), "--set", f"cluster.address=127.0.0.1:{port}", "--set", "cluster.connect_timeout_s=5"]))
    assert result.exit_code == EXIT_RUNTIME, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"{TINY}: ClusterError: cannot join the Ray cluster")
    assert f"127.0.0.1:{port}" in lines[0] and "Traceback" not in result.output


def test_disagg_check_on_a_non_routable_address_exits_1_without_traceback():
    """10.255.255.1 routes nowhere (or, behind an intercepting proxy, answers as no GCS does):
    the real command stops within the timeout, its last line the error, no traceback."""
    address = "10.255.255.1:6379"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "disagg.cluster.cli.app", "check", str(TINY), "--set", f"cluster.address={address}",
         "--set", "cluster.connect_timeout_s=1"], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 1, done.stderr
    # Ray's C++ client may still log its retries ("[2026-... W ...] gcs_client.cc: ...") while the
    # process exits; ours is the last line of our own.
    ours = [line for line in done.stderr.strip().splitlines() if not re.match(r"\[\d{4}-\d\d-\d\d [\d:,]+ [DIWEF] ", line)]
    last = ours[-1]
    assert last.startswith(f"{TINY}: ClusterError: cannot join the Ray cluster at cluster.address '{address}' "
                           "within 1 s"), done.stderr
    assert "Traceback" not in done.stderr and "preflight OK" not in done.stdout


# ------------------------------------------------------------------ the embedded head
def test_null_address_ignores_ray_address_and_binds_loopback(no_ray, caplog):
    no_ray.setenv("RAY_ADDRESS", "garbage-host:not-a-port")
    with caplog.at_level(logging.WARNING, logger="disagg.cluster.launch.connect"):
        # In this thread: Ray's head processes die with the thread that started them (PR_SET_PDEATHSIG).
        assert connect(tiny()) is True
    ignored = [r.getMessage() for r in caplog.records if "RAY_ADDRESS=garbage-host:not-a-port" in r.getMessage()]
    assert len(ignored) == 1 and "ignored" in ignored[0]

    assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert ray._raylet.get_authentication_mode() == ray._raylet.AuthenticationMode.TOKEN

    @ray.remote(num_cpus=0)
    def node_ip() -> str:
        return ray.util.get_node_ip_address()

    assert ray.get(node_ip.remote(), timeout=120) == "127.0.0.1"
    assert _listeners_of_this_head() and all(ip in ("127.0.0.1", "::ffff:127.0.0.1")
                                             for ip, _ in _listeners_of_this_head())


def _listeners_of_this_head() -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket of this process and the head's processes."""
    psutil = pytest.importorskip("psutil")
    session = ray._private.worker._global_node.get_session_dir_path()
    pids = {os.getpid()}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(session in arg for arg in (proc.info["cmdline"] or [])):
            pids.add(proc.info["pid"])
            pids.update(child.pid for child in proc.children(recursive=True))
    return [(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def test_a_loopback_head_is_joined_by_its_address(no_ray, tmp_path: Path):
    """Another process's embedded head on 127.0.0.1: joined through the probe and the bounded ray.init."""
    script = ("import sys, ray\n"
              "from disagg.cluster.launch.connect import enable_token_auth, start_embedded_head\n"
              "enable_token_auth()\n"
              "start_embedded_head('127.0.0.1', num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
              "print(ray.get_runtime_context().gcs_address, flush=True)\n"
              "sys.stdin.read()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    head = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = head.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), f"the head did not start (exit {head.poll()})"
        config = tiny(**{"cluster.address": address, "cluster.connect_timeout_s": 120.0,
                         "cluster.log_to_driver": False})
        assert finishes(lambda: connect(config), limit_s=180) is True
        assert ray.get_runtime_context().gcs_address == address
        assert ray.get(ray.remote(num_cpus=0)(lambda: 7).remote(), timeout=120) == 7
    finally:
        ray.shutdown()
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()


# ------------------------------------------------------------------ token authentication
def test_token_auth_is_turned_on_when_the_environment_names_no_mode(no_ray):
    enable_token_auth()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert ray._raylet.get_authentication_mode() == ray._raylet.AuthenticationMode.TOKEN


def test_an_explicit_opt_out_is_kept_and_said(no_ray, caplog):
    no_ray.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING, logger="disagg.cluster.launch.connect"):
        enable_token_auth()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert any("token authentication is off" in r.getMessage() for r in caplog.records)


def test_ray_requirement_is_the_first_with_token_auth():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\s*"ray>=2\.52",', text, re.MULTILINE), "pyproject.toml: ray must be >=2.52"
    assert MIN_RAY_VERSION == "2.52.0"
    check_ray_version(ray.__version__)  # the installed one qualifies
    with pytest.raises(ClusterError, match=r"Ray 2\.51\.0 has no token authentication.*ray>=2\.52\.0"):
        check_ray_version("2.51.0")


# ------------------------------------------------------------------ the actors' config
def test_actor_config_holds_no_api_key(monkeypatch: pytest.MonkeyPatch):
    config = tiny(**{"serve.api_key": "sk-very-secret"})
    sent = []

    class FakeActorClass:
        def options(self, **kwargs):
            return self

        def remote(self, role, name, config_dict):
            sent.append(config_dict)
            return object()

    class FakeGroup:
        def ready(self):
            return None

    monkeypatch.setattr(bootstrap, "placement_group", lambda bundles, strategy: FakeGroup())
    monkeypatch.setattr(bootstrap, "PlacementGroupSchedulingStrategy", lambda *args, **kwargs: None)
    monkeypatch.setattr(bootstrap.ray, "get", lambda *args, **kwargs: None)
    remoted = []
    monkeypatch.setattr(bootstrap.ray, "remote", lambda cls: remoted.append(cls) or FakeActorClass())
    monkeypatch.setattr(bootstrap, "ACTOR_CLASS", type("Sub", (bootstrap.InstanceActor,), {}))
    bootstrap._place(config, "cpu")
    assert remoted == [bootstrap.ACTOR_CLASS]  # the one seam that picks the actors' class
    assert len(sent) == config.instances.num_instances
    for config_dict in sent:
        assert "api_key" not in config_dict["serve"] and "sk-very-secret" not in repr(config_dict)
        assert Config.model_validate(config_dict).serve.api_key is None  # what the actor rebuilds
