"""`disagg bench` refuses bad arguments before anything launches, naming the flag and the value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from disagg.cluster.bench.command import BenchCommand, bench_command

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "tiny-1p1d.yaml")


def _app() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)          # keep `bench` a subcommand, as in disagg.cluster.cli.app
    app.command("bench", cls=BenchCommand)(bench_command)
    return app


def _invoke(*args: str):
    result = CliRunner().invoke(_app(), ["bench", *args], env={"COLUMNS": "250", "NO_COLOR": "1"})
    text = re.sub(r"[\s│╭╮╰╯─]+", " ", result.output)
    return result.exit_code, text


@pytest.mark.parametrize("args,expected", [
    (["--goodput", "tpot:abc"], ["--goodput", "tpot", "'abc'"]),
    (["--goodput", "ttft200"], ["--goodput", "NAME:MILLISECONDS"]),
    (["--goodput", "latency:3"], ["--goodput", "ttft", "tpot", "e2el"]),
    (["--request-rate", "-1"], ["--request-rate", "> 0", "'-1'"]),
    (["--request-rate", "1,x"], ["--request-rate", "'x'"]),
    (["--dataset-name", "sharegpt"], ["--dataset-name", "random", "'sharegpt'"]),
    (["--burstiness", "0"], ["--burstiness", "> 0"]),
    (["--random-range-ratio", "1.5"], ["--random-range-ratio", "[0, 1)"]),
    (["--slo-scales", "1,-2"], ["--slo-scales", "positive"]),
    (["--compare-variant", "scheduler.max_num_batched_tokens"], ["--compare-variant", "KEY=V1,V2"]),
    (["--num-prompts", "0"], ["--num-prompts"]),
])
def test_bad_arguments_are_clear(args, expected):
    code, text = _invoke(CONFIG, *args)
    assert code == 2, text
    for piece in expected:
        assert piece in text, (piece, text)


def test_needs_a_config_or_a_url():
    code, text = _invoke()
    assert code == 2 and "--base-url" in text


def test_bad_config_file_names_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {source: 'dummy:tiny'}\ninstances: {prefill: 1}\n")
    code, text = _invoke(str(bad))
    assert code == 2 and "bad.yaml" in text and "decode" in text


def test_base_url_needs_a_vocab_size():
    code, text = _invoke("--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--disable-tqdm")
    assert code == 2 and "--vocab-size" in text


def test_registered_on_the_disagg_cli():
    from disagg.cluster.cli.app import app

    result = CliRunner().invoke(app, ["bench", CONFIG, "--request-rate", "0"], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "--request-rate" in result.output
