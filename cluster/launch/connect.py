"""How the launching process reaches Ray: it joins ``cluster.address``, or starts an embedded head.

`connect(config)` is called once per launch by `disagg.cluster.launch.bootstrap.start_fleet`, in the
launching process. First it requires a Ray with token authentication and turns that on
(RAY_AUTH_MODE=token, inherited by every Ray process started from here). An address is probed
before `ray.init` (a TCP connect, then the HTTP/2 greeting every gRPC server sends at once), and
`ray.init` itself runs under the same deadline, ``cluster.connect_timeout_s``: an address that is
unreachable, or reachable but silent, fails with one `ClusterError` naming it, never a hang.
``cluster.address: null`` always starts an embedded head, whatever RAY_ADDRESS says (ignored,
with one warning), bound to ``cluster.bind_host`` (127.0.0.1 by default: nothing listens beyond
this machine).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Iterator

import ray
from packaging.version import Version

from disagg.config import Config, parse_ray_address
from disagg.errors import ClusterError

logger = logging.getLogger(__name__)

MIN_RAY_VERSION = "2.52.0"  # the first Ray with token authentication (RAY_AUTH_MODE=token)
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# Client connection preface (RFC 9113 §3.4) and an empty SETTINGS frame; a gRPC server answers
# with its own SETTINGS frame (9-byte header, type 0x4), and Ray's GCS sends it without waiting.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])
HTTP2_SETTINGS = 0x4


def connect(config: Config) -> bool:
    """Join ``cluster.address`` or start an embedded head; True when this call started Ray.

    Raises:
        ClusterError: Ray is too old for token authentication; the address cannot be reached or
            joined within ``cluster.connect_timeout_s``; or the embedded head failed to start.
            The message is one line: the address, the timeout, what went wrong and what to check.
    """
    if ray.is_initialized():
        return False
    check_ray_version(ray.__version__)
    enable_token_auth()
    section = config.cluster
    if section.address is None:
        num_cpus = section.num_cpus or max(os.cpu_count() or 1, int(
            config.instances.num_ranks * config.instances.cpus_per_instance + 1))
        start_embedded_head(section.bind_host, num_cpus=num_cpus, include_dashboard=section.dashboard,
                            log_to_driver=section.log_to_driver)
    else:
        join_cluster(section.address, section.connect_timeout_s, log_to_driver=section.log_to_driver)
    return True


def check_ray_version(version: str) -> None:
    """Raise ClusterError when Ray ``version`` predates token authentication."""
    if Version(version) < Version(MIN_RAY_VERSION):
        raise ClusterError(f"Ray {version} has no token authentication (RAY_AUTH_MODE=token), which every "
                           f"disagg cluster turns on; install ray>={MIN_RAY_VERSION} "
                           f"(pip install -U 'ray>={MIN_RAY_VERSION}')")


def enable_token_auth() -> None:
    """RAY_AUTH_MODE=token unless the environment already names a mode (then said when it is not token).

    Ray reads its settings once, at import, so they are re-read after the variable is set; the
    Ray processes started from here inherit it. Joining a cluster then needs its token
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); an embedded head makes one.
    """
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        logger.warning("%s=%s in the environment: Ray's token authentication is off, so anyone who reaches "
                       "the cluster's ports can run code in it", AUTH_MODE_ENV, mode)
        return
    os.environ[AUTH_MODE_ENV] = "token"
    ray._raylet.Config.initialize("")


def start_embedded_head(bind_host: str | None, **init_kwargs) -> None:
    """Start a Ray head in this process that advertises and listens on ``bind_host``.

    Args:
        bind_host: an IP of this host (127.0.0.1: loopback only), or None for Ray's own choice.
        init_kwargs: further `ray.init` arguments (num_cpus, include_dashboard, log_to_driver;
            namespace, "disagg" by default).

    Raises:
        ClusterError: Ray could not start the head (one line: its first line of error).
    """
    ignored = os.environ.get("RAY_ADDRESS")
    if ignored:
        logger.warning("cluster.address is null: starting an embedded Ray head; RAY_ADDRESS=%s in the "
                       "environment is ignored (set cluster.address to join that cluster)", ignored)
    node_ip = {} if bind_host is None else {"_node_ip_address": bind_host}
    try:
        with _keep_loopback(bind_host):
            # "local" is the one address Ray never replaces by RAY_ADDRESS.
            ray.init(**{"address": "local", "namespace": "disagg", **node_ip, **init_kwargs})
    except Exception as err:
        raise ClusterError(f"starting the embedded Ray head (cluster.bind_host {bind_host}) failed: "
                           f"{_first_line(err)}") from err


def join_cluster(address: str, timeout_s: float, *, log_to_driver: bool = True) -> None:
    """Probe ``address`` and join it, all within ``timeout_s``.

    Raises:
        ClusterError: nothing answers there, something that is not a gRPC server does, `ray.init`
            failed or did not return in time; the message names the address and the timeout.
    """
    deadline = time.monotonic() + timeout_s
    target = parse_ray_address(address)
    ray_address = address.strip()
    if target is not None:
        host, port = target
        hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        ray_address = f"ray://{hostport}" if ray_address.startswith("ray://") else hostport
        why = try_grpc_greeting(host, port, timeout_s)
        if why is not None:
            raise ClusterError(_unreachable(address, timeout_s, why))
    outcome: dict = {}

    def init() -> None:
        try:
            with _keep_loopback(target[0] if target else None):
                ray.init(address=ray_address, log_to_driver=log_to_driver, namespace="disagg")
        except BaseException as err:  # handed to the caller's thread below
            outcome["error"] = err

    # ray.init retries a silent GCS for minutes and cannot be interrupted: it runs in a thread
    # the launch stops waiting for (a daemon, so it never keeps the process alive). Joining starts
    # no Ray process here; a head must not be started this way, its processes die with the thread
    # that started them (PR_SET_PDEATHSIG), so `start_embedded_head` runs in the caller's.
    thread = threading.Thread(target=init, name="disagg-ray-init", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if thread.is_alive():
        raise ClusterError(_unreachable(address, timeout_s, "ray.init did not return"))
    if "error" in outcome:
        err = outcome["error"]
        raise ClusterError(_unreachable(address, timeout_s, f"ray.init failed: {_explain(err)}")) from err


def try_grpc_greeting(host: str, port: int, timeout_s: float) -> str | None:
    """None when a gRPC server answers at host:port within ``timeout_s``, else why not."""
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as err:
        return f"the host {host!r} does not resolve ({err.strerror})"
    except ConnectionRefusedError:
        return f"connection refused: nothing listens on port {port}"
    except (TimeoutError, socket.timeout):
        return "no answer within the timeout (a firewall, a host that is down, or not a Ray port)"
    except OSError as err:
        return f"cannot connect: {err.strerror or err}"
    with sock:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(HTTP2_PREFACE)
            header = _read(sock, 9, deadline)
        except (TimeoutError, socket.timeout):
            return "no answer within the timeout: it accepts TCP connections but sent no gRPC greeting"
        except (ConnectionResetError, BrokenPipeError):
            header = b""
    if len(header) < 9:
        return "it accepts TCP connections but closed this one without a gRPC greeting: not a Ray port"
    if header[3] != HTTP2_SETTINGS:
        return f"it answered, but not as a gRPC server (first bytes {header[:9]!r}): not a Ray port"
    return None


def _read(sock: socket.socket, num_bytes: int, deadline: float) -> bytes:
    data = b""
    while len(data) < num_bytes:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(num_bytes - len(data))
        if not chunk:
            break
        data += chunk
    return data


@contextlib.contextmanager
def _keep_loopback(host: str | None) -> Iterator[None]:
    """While ray.init resolves this node's IP, keep a loopback ``host`` as it is.

    Ray replaces a loopback node IP by the host's routable one wherever multi-node clusters are
    enabled (`ray_constants.ENABLE_RAY_CLUSTER`, off only on macOS and Windows), and then its GCS,
    raylet and workers listen on every interface. With the flag off for the call they advertise
    and listen on 127.0.0.1 alone, as Ray does on a laptop.
    """
    if not _is_loopback(host):
        yield
        return
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _unreachable(address: str, timeout_s: float, why: str) -> str:
    return (f"cannot join the Ray cluster at cluster.address {address!r} within {timeout_s:g} s "
            f"(cluster.connect_timeout_s): {why}; check that its head runs (`ray status` on it), that host "
            f"and port are right (`ray start --head` listens on 6379, a Ray Client server on ray://host:10001) "
            f"and that no firewall blocks the port, or set cluster.address: null for an embedded head")


def _explain(err: BaseException) -> str:
    text = _first_line(err)
    if type(err).__name__ == "AuthenticationError" or "token" in text.lower():
        return (f"{text} [Ray's token authentication is on: give this process the cluster's token through "
                "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (`ray get-auth-token` on the head)]")
    return text


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")
