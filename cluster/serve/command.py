"""`disagg serve CONFIG`: launch the cluster a YAML file describes, then serve it over HTTP.

`serve_command` is the typer command (registered in `disagg.cluster.cli`); `serve_forever(cluster,
config)` is the part `disagg launch` reuses when its config has a `serve` section: it builds the
app over an already launched cluster and blocks in uvicorn until SIGINT/SIGTERM. Runs in the
launching process (the router's process).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from disagg.cluster.serve.app import build_app
from disagg.cluster.serve.server import run_server
from disagg.config import Config
from disagg.errors import ConfigError

logger = logging.getLogger(__name__)


def serve_forever(cluster: Any, config: Config, *, log_level: str = "info") -> None:
    """Serve a launched cluster on `config.serve.host:port` until interrupted (blocking)."""
    app = build_app(cluster, config)
    logger.info("serving %s on http://%s:%d/v1", app.state.server.model_name, config.serve.host, config.serve.port)
    run_server(app, config.serve.host, config.serve.port, log_level=log_level)


def serve_command(
    config: Annotated[Path, typer.Argument(help="deployment YAML (configs/*.yaml)", exists=True, dir_okay=False)],
    host: Annotated[Optional[str], typer.Option(help="bind address; overrides serve.host (default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port; overrides serve.port")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Launch the cluster of CONFIG and serve the OpenAI API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics). The API key comes from serve.api_key or DISAGG_API_KEY."""
    from disagg.cluster import Cluster

    overrides = {key: value for key, value in (("serve.host", host), ("serve.port", port)) if value is not None}
    try:
        deployment = Config.from_yaml(config)
        if overrides:
            deployment = deployment.override(overrides)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    with Cluster.launch(deployment) as cluster:
        serve_forever(cluster, deployment, log_level=log_level)
