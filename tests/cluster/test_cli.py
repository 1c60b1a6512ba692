"""The `disagg` command: help on every verb, config errors before launch, one streamed generate, a
prompt over max_model_len refused on a real fleet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.cli import app

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
runner = CliRunner()


@pytest.mark.parametrize("verb", ["launch", "check", "generate"])
def test_every_verb_has_help(verb: str):
    result = runner.invoke(app, [verb, "--help"])
    assert result.exit_code == 0 and "CONFIG" in result.output.upper()


def test_top_level_help_lists_the_verbs():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert all(verb in result.output for verb in ("launch", "check", "generate"))


def test_invalid_config_exits_2_naming_the_field(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "tiny-1p1d.yaml").read_text().replace("page_size: 16", "page_sise: 16"))
    result = runner.invoke(app, ["check", str(bad)])
    assert result.exit_code == 2
    assert "cache.page_sise: unknown key; did you mean 'page_size'?" in result.output


def test_bad_override_exits_2(tmp_path: Path):
    result = runner.invoke(app, ["check", str(CONFIGS / "tiny-1p1d.yaml"), "--set", "instances.prefill=0"])
    assert result.exit_code == 2 and "prefill >= 1 and decode >= 1" in result.output


def test_generate_needs_a_prompt():
    result = runner.invoke(app, ["generate", str(CONFIGS / "tiny-1p1d.yaml")])
    assert result.exit_code == 2 and "give a prompt" in result.output


def test_launch_prints_status_until_ctrl_c(tmp_path: Path):
    import signal
    import time

    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-c", "from disagg.cluster.cli import app; app()", "launch",
               str(CONFIGS / "tiny-colocated.yaml"), "--status-every-s", "0.5"]
    # SIG_DFL in the child: under a suite started in the background SIGINT arrives ignored.
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, deadline = [], time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if sum(" | colocated-0 run " in seen for seen in lines) >= 2:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    output = "".join(lines) + rest
    assert "tiny-colocated: colocated on cpu" in output
    assert sum(" | colocated-0 run 0 wait 0 free 256/256 " in line for line in lines) >= 2, output[-2000:]
    assert "shutting down" in output and proc.returncode == 0, output[-2000:]


# The tests on the module's Ray come last, in a row: between them a test without it would stop
# Ray, and the next start it again (~5 s).
def test_generate_streams_token_ids_over_segment_puts(ray_local, monkeypatch):
    from cluster_helpers import reference_tokens

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # in this process, on the module's Ray
    result = runner.invoke(app, ["generate", str(CONFIGS / "tiny-1p1d.yaml"), "--prompt-ids", "5,6,7,8",
                                 "--max-tokens", "6", "--ignore-eos", "--set", "transfer.force_segment_puts=true"])
    assert result.exit_code == 0, result.output
    assert "[6 tokens, finish_reason length, TTFT" in result.stdout
    ids = [int(t) for t in result.stdout.split("[6 tokens")[0].split()]
    assert ids == reference_tokens([[5, 6, 7, 8]], [6])[0]  # the host-initiated path lands the same KV


def test_check_exits_1_with_the_preflight_reason(ray_local, monkeypatch):
    # In this process, on the session's Ray (a subprocess with its own Ray took 13 s).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    result = runner.invoke(app, ["check", str(CONFIGS / "tiny-colocated.yaml"), "--set", "model.max_model_len=5000",
                                 "--set", "cache.num_pages=null"])
    assert result.exit_code == 1, result.output
    assert "PreflightError: model.max_model_len (5000 tokens) exceeds the model's max_position_embeddings (4096)" \
        in result.stderr


@pytest.mark.slow
def test_a_prompt_over_max_model_len_on_a_real_fleet(ray_local, monkeypatch):
    # `disagg generate` (tests/cluster/test_generate_command.py) on the real max_model_len, here
    # on the module's Ray: alone in its module it started one of its own (~8 s).
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the actors inherit it: torch reference kernels
    for name in ("DISAGG_LOG", "RAY_LOGGER_LEVEL"):  # setup_logging sets them; give them back
        monkeypatch.setenv(name, "WARNING")
    result = runner.invoke(app, ["generate", str(CONFIGS / "tiny-1p1d.yaml"), "--prompt-ids", ",".join(["5"] * 300),
                                 "--set", "model.max_model_len=256"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        "disagg generate: the prompt is 300 tokens, and max_model_len is 256: no room for an output token; "
        "shorten it or raise model.max_model_len (--set model.max_model_len=N)"]
