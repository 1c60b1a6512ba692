"""`disagg serve CONFIG`: serve the OpenAI API over the cluster a YAML file describes.

`serve_config(config)` binds the HTTP port first (so /health answers 503 while the fleet
launches and runs its preflight), launches the cluster, attaches it to the app (/health turns
200), and serves until SIGINT/SIGTERM, then shuts the cluster down. `serve_command` is its typer
front (registered in `disagg.cluster.cli`); `disagg launch` calls `serve_config` when the YAML has
a `serve` section. Runs in the launching process (the router's process).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from disagg.cluster.serve.app import build_app
from disagg.cluster.serve.server import LOOPBACK, BackgroundServer
from disagg.config import Config
from disagg.errors import DisaggError

logger = logging.getLogger(__name__)


def serve_config(config: Config, *, log_level: str = "info",
                 on_launch: Callable[[Any, str], None] | None = None) -> None:
    """Bind the HTTP port, launch the cluster of `config`, serve until SIGINT/SIGTERM (blocking).

    Args:
        config: the deployment; its serve section says where to listen.
        log_level: uvicorn's log level.
        on_launch: called as ``on_launch(cluster, base_url)`` once the cluster serves (the CLI
            prints the fleet there).

    Raises:
        ClusterError / PreflightError: the cluster failed to launch (the port is closed again).
    """
    from disagg.cluster import Cluster

    host, port = config.serve.host, config.serve.port
    if host not in (LOOPBACK, "localhost", "::1"):
        logger.warning("serving on %s:%d: reachable from other machines (serve.host)%s", host, port,
                       "" if config.serve.api_key else "; no serve.api_key is set")
    app = build_app(None, config)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with BackgroundServer(app, host, port, log_level=log_level) as server:
            logger.info("http on %s (/health is 503 until the preflight passes); launching the cluster",
                        server.base_url)
            with Cluster.launch(config) as cluster:
                app.state.server.attach(cluster)
                logger.info("serving %s on %s/v1", app.state.server.model_name, server.base_url)
                if on_launch is not None:
                    on_launch(cluster, server.base_url)
                while not stop.wait(1.0) and server.running:
                    pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_command(
    config: Annotated[Path, typer.Argument(help="deployment YAML (see configs/)", show_default=False)],
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", help="override a field: section.key=value (value read as YAML), repeatable")] = None,
    host: Annotated[Optional[str], typer.Option(help="bind address; overrides serve.host (default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port; overrides serve.port")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Launch the fleet of CONFIG and serve the OpenAI API on serve.host:serve.port (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics) until Ctrl-C. The API key comes from
    serve.api_key or DISAGG_API_KEY."""
    from disagg.cluster.cli import load_config  # the CLI imports this module: import it late

    overrides = list(set_ or [])
    overrides += [f"serve.{key}={value}" for key, value in (("host", host), ("port", port)) if value is not None]
    deployment = load_config(config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve_config(deployment, log_level=log_level)
    except DisaggError as err:
        typer.echo(f"{deployment.path or 'config'}: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(1) from None
