"""`disagg launch CONFIG` serves HTTP when CONFIG has a serve section (or --set names one): the
CLI in-process over a `FakeCluster` (fast: what decides to serve), then once as a subprocess on
the real tiny-1p1d cluster (a completion and /metrics over HTTP, Ctrl-C shuts it down)."""

from __future__ import annotations

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
import yaml
from fake_cluster import CharTokenizer, FakeCluster
from typer.testing import CliRunner

from disagg.cluster import Cluster


from disagg.cluster.cli import app as cli
pytestmark = pytest.mark.timeout(240)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-1p1d.yaml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_config(tmp_path: Path, serve: dict | None) -> Path:
    raw = yaml.safe_load(CONFIG.read_text())
    if serve is not None:
        raw["serve"] = serve
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("how", ["serve section", "--set serve.port", "disagg serve"])
def test_launch_serves_when_the_config_names_serve(tmp_path, monkeypatch, how):
    port = _free_port()
    path = _write_config(tmp_path, {"port": port, "api_key": "k"} if how == "serve section" else None)
    args = {"serve section": ["launch", str(path)],
            "--set serve.port": ["launch", str(path), "--set", f"serve.port={port}", "--set", "serve.api_key=k"],
            "disagg serve": ["serve", str(path), "--port", str(port), "--set", "serve.api_key=k"]}[how]
    fake = FakeCluster(tokenizer=CharTokenizer())
    monkeypatch.setattr(Cluster, "launch", staticmethod(lambda cfg: fake))
    monkeypatch.setattr(cli, "describe", lambda cluster: "the fleet")
    answers = []

    def client():
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        headers = {"Authorization": "Bearer k"}
        answers.append(httpx.post(url + "/v1/completions", json={"prompt": [66], "max_tokens": 2}, headers=headers))
        answers.append(httpx.post(url + "/v1/completions", json={"prompt": [66], "max_tokens": 2}))  # no key
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=client)
    thread.start()
    result = CliRunner().invoke(cli.app, args)
    thread.join(10)
    assert result.exit_code == 0, result.output
    assert len(answers) == 2 and answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == "BB"
    assert answers[1].status_code == 401  # serve.api_key, from the file or --set, is enforced
    assert fake.shut_down
    if how != "disagg serve":  # launch prints the fleet and where it serves (on 127.0.0.1 by default)
        assert f"serving the OpenAI API on http://127.0.0.1:{port}/v1" in result.output
        assert "shutting down" in result.output


def test_launch_with_a_serve_section_serves_the_real_cluster(tmp_path):
    path = _write_config(tmp_path, {"port": 0})  # an ephemeral port, printed once serving
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-c", "from disagg.cluster.cli.app import app; app()", "launch", str(path)]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, url, deadline = [], None, time.monotonic() + 180
    try:
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"serving the OpenAI API on (http://\S+)/v1", line)
            url = found.group(1) if found else None
        assert url is not None, "".join(lines)[-3000:]
        out = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
        assert "disagg:kv_pushed_bytes_total" in httpx.get(url + "/metrics", timeout=60).text
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    output = "".join(lines) + rest
    assert "deployment: disaggregated on cpu" in output and "shutting down" in output
    assert proc.returncode == 0, output[-2000:]
