"""disagg.cluster.serve: the OpenAI-compatible HTTP front end of a cluster (`disagg serve`).

`build_app(cluster, config)` returns the FastAPI app (/v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics); `run_server` serves it in the foreground, `BackgroundServer` in
a thread; `serve_command` (in `command.py`, imported by the CLI) launches a cluster from a YAML
file and serves it, taking `vllm serve`'s option names (`vllm_options.py`). FastAPI, uvicorn and prometheus_client are imported only in this package.
"""

from disagg.cluster.serve.app import build_app
from disagg.cluster.serve.server import BackgroundServer, run_server

__all__ = ["BackgroundServer", "build_app", "run_server"]
