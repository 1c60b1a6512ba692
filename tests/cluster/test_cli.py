"""The `disagg` command: help on every verb, config errors before launch, one streamed generate, a
prompt over max_model_len refused on a real fleet."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.cli.app import app

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


def _verbs() -> dict:
    import typer

    return typer.main.get_command(app).commands


@pytest.mark.parametrize("columns", ["60", "80"])
def test_top_level_help_gives_each_verb_one_whole_line(columns: str):
    """`disagg --help` at 80 columns wrapped each verb's docstring over several ragged lines."""
    result = runner.invoke(app, ["--help"], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    lines = re.sub("[│╭╮╰╯─]", " ", result.output).splitlines()  # (rich's boxes, were they back)
    start = next(i for i, line in enumerate(lines) if line.strip().rstrip(":") == "Commands") + 1
    listed = list(itertools.takewhile(str.strip, lines[start:]))
    assert [line.split()[0] for line in listed] == list(_verbs()), result.output
    from disagg.cluster.cli.app import VERBS

    assert list(VERBS) == list(_verbs())
    for line, (name, (summary, _)) in zip(listed, VERBS.items()):
        assert re.fullmatch(rf"  {name} +{re.escape(summary)}", line), (line, result.output)
        assert len(line) <= int(columns) - 2


@pytest.mark.parametrize("columns", ["60", "80"])
def test_help_cuts_no_word_and_prints_every_example_whole(columns: str):
    """At 80 columns rich's option table cut `--set scheduler.max_num_batched_tokens=2048` to
    `--set scheduler.max_num_batched_to…`: every word of every option's help, and every example
    line, is in the help whole."""
    helps = {name: runner.invoke(app, [name, "--help"], env={"COLUMNS": columns}) for name in _verbs()}
    for name, command in _verbs().items():
        output = helps[name].output
        assert helps[name].exit_code == 0 and "…" not in output, output
        for param in command.params:
            missing = [w for w in (getattr(param, "help", None) or "").split() if w not in output.split()]
            assert not missing, (name, param.name, missing, output)
    assert any("--set scheduler.max_num_batched_tokens=2048" in line for line in helps["bench"].output.splitlines())
    from disagg.cluster.cli.app import VERBS

    for name, (_, examples) in VERBS.items():
        output = helps[name].output
        lines = [line.strip() for example in examples for line in example.splitlines()]
        assert lines and not [e for e in lines if e not in map(str.strip, output.splitlines())], (name, output)
        assert output.index("Examples:") > output.index("Options:")


def test_every_help_example_parses_with_its_verb():
    """The examples are commands a user copies: each one's verb takes its flags and values, and
    the configs it names exist."""
    from disagg.cluster.cli.app import VERBS

    verbs = _verbs()
    for name, (_, examples) in VERBS.items():
        for example in examples:
            words = shlex.split(example.replace("\\\n", " "))
            assert words[:2] == ["disagg", name], example
            for word in words:
                assert not word.startswith("configs/") or (CONFIGS.parent / word).is_file(), (example, word)
            verbs[name].make_context(name, words[2:])  # raises on an unknown flag or a bad value


def test_invalid_config_exits_2_naming_the_field(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "tiny-1p1d.yaml").read_text().replace("page_size: 16", "page_sise: 16"))
    result = runner.invoke(app, ["check", str(bad)])
    assert result.exit_code == 2
    assert "cache.page_sise: unknown key; did you mean 'page_size'?" in result.output


def test_bad_override_exits_2(tmp_path: Path):
    result = runner.invoke(app, ["check", str(CONFIGS / "tiny-1p1d.yaml"), "--set", "instances.prefill=0"])
    assert result.exit_code == 2 and "prefill >= 1 and decode >= 1" in result.output


def test_check_names_a_missing_model_directory_without_starting_ray(tmp_path: Path, monkeypatch):
    from disagg.cluster.launch import bootstrap

    def connect(config):
        raise AssertionError("check connected to Ray before it looked at model.source")
    monkeypatch.setattr(bootstrap, "connect", connect)
    config = tmp_path / "typo.yaml"
    config.write_text((CONFIGS / "tiny-1p1d.yaml").read_text().replace('"dummy:tiny"', "models/llama"))
    result = runner.invoke(app, ["check", str(config)])
    assert result.exit_code == 1, result.output
    assert f"{config}: PreflightError: model.source 'models/llama': no such directory" in result.stderr


def test_check_of_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path):
    config = tmp_path / "broken.yaml"
    config.write_text("model:\n  source: dummy:tiny\ninstances:\n  prefill: 1\n   decode: 1\n")
    result = runner.invoke(app, ["check", str(config)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"{config}:5:10: not valid YAML: mapping values are not allowed here\n")


def test_generate_needs_a_prompt():
    result = runner.invoke(app, ["generate", str(CONFIGS / "tiny-1p1d.yaml")])
    assert result.exit_code == 2 and "give a prompt" in result.output


def test_launch_prints_status_until_ctrl_c(tmp_path: Path):
    import signal
    import time

    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-c", "from disagg.cluster.cli.app import app; app()", "launch",
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
    # In this process, on the test session's Ray (a subprocess with its own Ray takes 13 s).
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
