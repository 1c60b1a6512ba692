"""`disagg serve CONFIG`: serve the OpenAI API over the cluster a YAML file describes.

`serve_config(config)` binds the HTTP port first (so /health answers 503 while the fleet
launches and runs its preflight), launches the cluster, attaches it to the app (/health turns
200), and serves until SIGINT/SIGTERM, then shuts the cluster down. `serve_command` is its typer
front (registered in `disagg.cluster.cli.app`), taking `vllm serve`'s option names where they mean
something here (vllm_options.py); `disagg launch` calls `serve_config` when the YAML has a `serve`
section. Runs in the launching process (the router's process).

Exit status of `disagg serve`: 0 after Ctrl-C/SIGTERM; 1 when the port cannot be bound
(`EXIT_BIND`: one line naming host:port) or the cluster fails to launch; 2 for an invalid YAML,
override or option (a refused vLLM option says what to use instead).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from disagg.cluster.cli.common import LogLevel, python_level
from disagg.cluster.serve.app import build_app
from disagg.cluster.serve.guards import resolve_api_key
from disagg.cluster.serve.server import LOOPBACK, BackgroundServer, BindError
from disagg.cluster.serve.vllm_options import add_vllm_options, yaml_overrides
from disagg.config import Config
from disagg.errors import ConfigError, DisaggError

logger = logging.getLogger(__name__)

EXIT_LAUNCH, EXIT_BIND, EXIT_USAGE = 1, 1, 2


def serve_config(config: Config, *, log_level: str = "info",
                 on_launch: Callable[[Any, str], None] | None = None, root_path: str = "",
                 allowed_origins: list[str] | None = None) -> None:
    """Bind the HTTP port, launch the cluster of `config`, serve until SIGINT/SIGTERM (blocking).

    Args:
        config: the deployment; its serve section says where to listen.
        log_level: uvicorn's log level.
        on_launch: called as ``on_launch(cluster, base_url)`` once the cluster serves (the CLI
            prints the fleet there).
        root_path: the path prefix a reverse proxy strips ("" for none).
        allowed_origins: CORS origins (see `build_app`); None: no CORS.

    Raises:
        BindError: serve.host:serve.port cannot be bound (nothing was launched).
        ClusterError / PreflightError: the cluster failed to launch (the port is closed again).
    """
    from disagg.cluster import Cluster

    host, port = config.serve.host, config.serve.port
    app = build_app(None, config, allowed_origins=allowed_origins)
    server = BackgroundServer(app, host, port, log_level=log_level, root_path=root_path)  # BindError here
    if host not in (LOOPBACK, "localhost", "::1"):
        logger.warning("serving on %s:%d: reachable from other machines (serve.host)%s", host, server.port,
                       "" if resolve_api_key(config.serve.api_key) else "; no API key is set (--api-key)")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with server:
            logger.info("http on %s (/health is 503 until the preflight passes); launching the cluster",
                        server.base_url)
            with Cluster.launch(config) as cluster:
                signal.signal(signal.SIGTERM, lambda *_: stop.set())  # ray.init put in its own sys.exit(15)
                app.state.server.attach(cluster)
                logger.info("serving %s on %s/v1", app.state.server.model_name, server.base_url)
                if on_launch is not None:
                    on_launch(cluster, server.base_url)
                while not stop.wait(1.0) and server.running:
                    pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@add_vllm_options
def serve_command(
    config: Annotated[Path, typer.Argument(help="deployment YAML (see configs/)", show_default=False)],
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="KEY=VALUE",
        help="override a field: section.key=value (value read as YAML), repeatable")] = None,
    log_level: Annotated[Optional[LogLevel], typer.Option(
        help="level of disagg's logs (here and in the actors), Ray's driver logs and uvicorn's; "
             "default $DISAGG_LOG, else info", show_default=False)] = None,
    uvicorn_log_level: Annotated[Optional[LogLevel], typer.Option(
        help="uvicorn's level alone; default --log-level", show_default=False)] = None,
    root_path: Annotated[str, typer.Option(help="path prefix a reverse proxy strips (FastAPI's root_path)")] = "",
    allowed_origins: Annotated[Optional[str], typer.Option(
        help='origins browsers may call from, as a JSON list: \'["https://app.example"]\' or \'["*"]\'; '
             "default: no CORS headers", show_default=False)] = None,
    disable_log_requests: Annotated[bool, typer.Option(
        "--disable-log-requests",
        help="accepted for vLLM's sake: disagg logs no request (the access log is off)")] = False,
    **vllm_options: Any,
) -> None:
    """Launch the fleet of CONFIG and serve the OpenAI API on serve.host:serve.port (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics) until Ctrl-C. The API key comes from
    --api-key, serve.api_key or DISAGG_API_KEY. vLLM's --host, --port, --api-key,
    --served-model-name, --max-model-len, ... override the YAML; its options with no counterpart
    here are refused with what to use instead. Exit status 1 when the port cannot be bound or the
    fleet fails to launch, 2 for an invalid YAML or option."""
    from disagg.cluster.cli.app import load_config  # the CLI imports this module: import it late

    deployment = load_config(config, set_)
    try:
        deployment = deployment.override(yaml_overrides(vllm_options))
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(EXIT_USAGE) from None
    origins = _origins(allowed_origins)
    level = configure_logging(log_level.value if log_level else None)
    try:
        serve_config(deployment, log_level=uvicorn_log_level.value if uvicorn_log_level else level,
                     root_path=root_path, allowed_origins=origins)
    except BindError as err:
        typer.echo(f"disagg serve: {err}", err=True)
        raise typer.Exit(EXIT_BIND) from None
    except DisaggError as err:
        typer.echo(f"{deployment.path or 'config'}: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(EXIT_LAUNCH) from None


def _origins(text: str | None) -> list[str] | None:
    if text is None:
        return None
    try:
        origins = json.loads(text)
    except json.JSONDecodeError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise typer.BadParameter(f'expected a JSON list of origins, e.g. \'["https://app.example"]\'; got {text!r}',
                                 param_hint="--allowed-origins")
    return origins


def configure_logging(level: str | None) -> str:
    """Set the level of disagg's logs; a level given also reaches the actors and Ray's driver logs.

    Args:
        level: a `LogLevel` value: disagg's loggers here, the actors' (DISAGG_LOG, passed on by
            the bootstrap), the handlers of Ray's driver logger and Ray's processes
            (RAY_LOGGER_LEVEL) take it. None: $DISAGG_LOG, else info, here only (the actors keep
            $DISAGG_LOG, else WARNING).

    Returns:
        the level as uvicorn names it (lower case).
    """
    given = level is not None
    level = (level or os.environ.get("DISAGG_LOG") or "info").lower()
    python_name = python_level(level)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("disagg").setLevel(python_name)
    if given:
        os.environ["DISAGG_LOG"] = python_name
        os.environ["RAY_LOGGER_LEVEL"] = python_name.lower()  # read by the Ray processes ray.init starts
        # ray.init sets the "ray" logger's own level; its handlers' levels are left to us.
        for handler in logging.getLogger("ray").handlers:
            handler.setLevel(python_name)
    return level
