"""`disagg serve` as vLLM users type it: a port in use or an unknown host is one line on stderr and
exit status 1 (no traceback, nothing launched); vLLM's option names override the YAML (typed:
an API key of digits stays a string); vLLM options with no counterpart exit 2 saying what to use
instead; --log-level sets disagg's level here and in the actors. In-process runs launch a
`FakeCluster` (what the command does with the options is under test, not the fleet)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fake_cluster import CharTokenizer, FakeCluster
from typer.testing import CliRunner

from disagg.cluster import Cluster


from disagg.cluster.cli import app as cli
pytestmark = pytest.mark.timeout(120)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-1p1d.yaml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _flat(text: str) -> str:
    """typer's boxed error output as one line of words."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())


def test_bind_errors_are_one_line_and_exit_1():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        runs = {f"127.0.0.1:{port}": ["serve", str(CONFIG), "--port", str(port)],
                "no-such-host.invalid:8000": ["serve", str(CONFIG), "--host", "no-such-host.invalid", "--port", "8000"],
                f"127.0.0.1:{port} ": ["launch", str(CONFIG), "--set", f"serve.port={port}"]}
        command = [sys.executable, "-c", "from disagg.cluster.cli.app import app; app()"]
        procs = {where: subprocess.Popen(command + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         env=dict(os.environ, TRITON_INTERPRET="0"))
                 for where, args in runs.items()}
        outputs = {where: proc.communicate(timeout=100) for where, proc in procs.items()}
    for where, (out, err) in outputs.items():
        lines = err.strip().splitlines()
        assert procs[where].returncode == 1, err[-2000:]
        assert len(lines) == 1 and f"cannot listen on {where.strip()}" in lines[0], err[-2000:]
        assert "Traceback" not in out + err and "launch" not in out.lower()


def _serve_in_process(args: list[str], monkeypatch, port: int, api_key: str) -> tuple:
    """Run `disagg serve ARGS` over a FakeCluster; a client asks /v1/models with and without the key."""
    launched, answers = [], []
    fake = FakeCluster(tokenizer=CharTokenizer())
    monkeypatch.setattr(Cluster, "launch", staticmethod(lambda cfg: launched.append(cfg) or fake))

    def client():
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        answers.append(httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}))
        answers.append(httpx.get(url + "/v1/models"))
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=client)
    thread.start()
    result = CliRunner().invoke(cli.app, args)
    thread.join(10)
    return result, launched, answers


def test_vllm_options_override_the_yaml(monkeypatch):
    port = _free_port()
    args = ["serve", str(CONFIG), "--host", "127.0.0.1", "--port", str(port), "--api-key", "0123",
            "--served-model-name", "my-model", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "128", "--block-size", "32", "--gpu-memory-utilization", "0.5",
            "--dtype", "float32", "--disable-log-requests", "--uvicorn-log-level", "warning",
            "--set", "serve.port=1"]  # the named option wins over --set
    result, launched, answers = _serve_in_process(args, monkeypatch, port, "0123")
    assert result.exit_code == 0, result.output
    config = launched[0]
    assert (config.serve.host, config.serve.port, config.serve.api_key) == ("127.0.0.1", port, "0123")
    assert (config.serve.served_model_name, config.model.max_model_len, config.model.dtype) == ("my-model", 1024,
                                                                                                 "float32")
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 128)
    assert (config.cache.page_size, config.cache.gpu_memory_fraction) == (32, 0.5)
    assert answers[0].status_code == 200 and answers[0].json()["data"][0]["id"] == "my-model"
    assert answers[1].status_code == 401


def test_log_level_sets_disagg_and_the_actors(monkeypatch):
    monkeypatch.delenv("DISAGG_LOG", raising=False)
    monkeypatch.delenv("RAY_LOGGER_LEVEL", raising=False)
    disagg_logger, ray_handlers = logging.getLogger("disagg"), logging.getLogger("ray").handlers
    before = (disagg_logger.level, [h.level for h in ray_handlers])
    port = _free_port()
    try:
        result, _, answers = _serve_in_process(["serve", str(CONFIG), "--port", str(port), "--log-level", "error"],
                                               monkeypatch, port, "none")
        assert result.exit_code == 0, result.output
        assert disagg_logger.level == logging.ERROR and os.environ["DISAGG_LOG"] == "ERROR"
        assert all(handler.level == logging.ERROR for handler in ray_handlers)
        assert answers[0].status_code == 200
    finally:
        disagg_logger.setLevel(before[0])
        for handler, level in zip(ray_handlers, before[1]):
            handler.setLevel(level)


@pytest.mark.parametrize("args, words", [
    (["--model", "Qwen/Qwen3-8B"], "set model.source"),  # refused before "Missing argument 'CONFIG'"
    ([str(CONFIG), "--tensor-parallel-size", "2"], "disagg has no tensor parallelism"),
    ([str(CONFIG), "-tp", "2"], "disagg has no tensor parallelism"),
    ([str(CONFIG), "--pipeline-parallel-size", "2"], "no pipeline parallelism"),
    ([str(CONFIG), "--data-parallel-size", "2"], "instances.prefill and instances.decode"),
    ([str(CONFIG), "--trust-remote-code", "--port", "8000"], "its own Llama-family model code"),
    ([str(CONFIG), "--quantization", "fp8"], "--kv-cache-dtype fp8_e4m3"),
    ([str(CONFIG), "--no-such-flag"], "No such option"),
    ([str(CONFIG), "--allowed-origins", "*"], "JSON list"),
    ([str(CONFIG), "--kv-cache-dtype", "fp8"], "cache.kv_dtype"),  # validated as the YAML field
])
def test_vllm_options_without_a_counterpart_exit_2_with_a_hint(monkeypatch, args, words):
    launched = []
    monkeypatch.setattr(Cluster, "launch", staticmethod(lambda cfg: launched.append(cfg)))
    result = CliRunner().invoke(cli.app, ["serve", *args])
    assert result.exit_code == 2 and words in _flat(result.output), result.output
    assert not launched and "Traceback" not in result.output
