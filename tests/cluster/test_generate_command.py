"""`disagg generate` and the CLI's surface: chat template by default, --raw, several prompts, tokens/s,
bad input as one line and exit 2, --version, readable help, SIGTERM to `disagg launch`.

Most tests run the command in process with the launcher replaced by a `FakeCluster` (the real
SmolLM2 tokenizer, a stream that records the prompt ids it gets): the command's own work, no Ray.
The slow ones launch real fleets in a subprocess: SmolLM2 answering a question, and `disagg
launch` stopped by SIGTERM. The tiny model refusing a prompt over max_model_len on a real fleet
is in tests/cluster/test_cli.py, on that module's Ray.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.cli import generate as gen
from disagg.cluster.cli.app import app
from disagg.cluster.outputs import StreamDelta

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMOLLM2 = str(CONFIGS / "smollm2-1p1d.yaml")
TINY = str(CONFIGS / "tiny-1p1d.yaml")
CLI = [sys.executable, "-c", "from disagg.cluster.cli.app import app; app()"]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from disagg.model.smollm2 import SmolLM2Unavailable, ensure_smollm2
    from disagg.model.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(ensure_smollm2())
    except SmolLM2Unavailable as exc:
        pytest.skip(f"needs the SmolLM2 GGUF: {exc}")


class FakeCluster:
    """What generate_command uses of a `Cluster`; every stream yields three tokens 10 ms apart."""

    def __init__(self, tokenizer, max_model_len: int = 4096, vocab_size: int | None = 49152) -> None:
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size
        self.model_name = "fake"
        self.prompts: list[list[int]] = []
        self.closed = False

    async def stream(self, prompt, params):
        self.prompts.append(list(prompt))
        now = time.time()
        yield StreamDelta("r", [self.tokenizer.encode("Hi", add_special_tokens=False)[0]] if self.tokenizer else [7],
                          [now + 0.01])
        yield StreamDelta("r", [8, 9], [now + 0.02, now + 0.03], finished=True, finish_reason="length")

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch):
    """run(fake, *args) -> (result, fake): `disagg generate` in process with `fake` as the fleet."""
    for name in ("DISAGG_LOG", "RAY_LOGGER_LEVEL"):  # setup_logging sets them; give them back
        monkeypatch.setenv(name, "WARNING")

    def invoke(fake, *args: str, config: str = SMOLLM2):
        monkeypatch.setattr(gen, "launch_or_exit", lambda cfg: fake)
        return CliRunner().invoke(app, ["generate", config, *args]), fake
    return invoke


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def test_chat_template_is_applied_by_default(run, smollm2_tokenizer):
    result, fake = run(FakeCluster(smollm2_tokenizer), "--prompt", "Name three prime numbers.")
    assert result.exit_code == 0, result.output
    assert fake.prompts == [_chat_ids(smollm2_tokenizer, "Name three prime numbers.")]
    sent = smollm2_tokenizer.decode(fake.prompts[0], skip_special_tokens=False)
    assert "<|im_start|>user\nName three prime numbers.<|im_end|>" in sent
    assert sent.endswith("<|im_start|>assistant\n") and fake.closed


def test_raw_sends_the_plain_prompt(run, smollm2_tokenizer):
    result, fake = run(FakeCluster(smollm2_tokenizer), "--prompt", "Name three prime numbers.", "--raw")
    assert result.exit_code == 0, result.output
    assert fake.prompts == [smollm2_tokenizer.encode("Name three prime numbers.")]


def test_a_tokenizer_without_template_sends_the_plain_prompt(run, smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(smollm2_tokenizer, "chat_template", None)
    result, fake = run(FakeCluster(smollm2_tokenizer), "--prompt", "2 + 2 =")
    assert result.exit_code == 0 and fake.prompts == [smollm2_tokenizer.encode("2 + 2 =")]


def test_several_prompts_run_in_order(run, smollm2_tokenizer, tmp_path: Path):
    listing = tmp_path / "prompts.txt"
    listing.write_text("third\n\n  \nfourth\n")
    result, fake = run(FakeCluster(smollm2_tokenizer), "--prompt", "first", "--prompt", "second",
                       "--prompt-file", str(listing), "--prompt-ids", "5,6,7", "--raw")
    assert result.exit_code == 0, result.output
    assert fake.prompts == [smollm2_tokenizer.encode(t) for t in ("first", "second", "third", "fourth")] + [[5, 6, 7]]
    headers = [line for line in result.stdout.splitlines() if line.startswith(">>> ")]
    assert headers == [">>> first", ">>> second", ">>> third", ">>> fourth", ">>> 3 token ids [5, 6, 7]"]
    assert result.stdout.count("tokens/s]") == 5


def test_the_summary_line_gives_ttft_and_tokens_per_second(run, smollm2_tokenizer):
    result, _ = run(FakeCluster(smollm2_tokenizer), "--prompt-ids", "1,2,3")
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("[3 tokens, finish_reason length, TTFT ") and last.endswith(" tokens/s]"), last
    rate = float(last.split(", ")[-1].split()[0])
    assert rate == pytest.approx(100, abs=1)  # two tokens after the first, 20 ms after it: 100 tokens/s


def test_summary_line_units():
    assert gen.summary_line(3, "stop", 100.0, [100.5, 101.0, 101.5]) == \
        "[3 tokens, finish_reason stop, TTFT 500.0 ms, 2.0 tokens/s]"
    assert gen.summary_line(1, "length", 1.0, [1.25]) == "[1 tokens, finish_reason length, TTFT 250.0 ms, - tokens/s]"
    assert gen.summary_line(0, "error", 1.0, [], "boom") == \
        "[0 tokens, finish_reason error, TTFT -, - tokens/s, error: boom]"


def _one_line_exit_2(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_prompt_over_max_model_len_is_one_line_and_exit_2(run, smollm2_tokenizer):
    result, fake = run(FakeCluster(smollm2_tokenizer, max_model_len=16), "--prompt-ids", ",".join(["5"] * 16))
    line = _one_line_exit_2(result)
    assert line == ("disagg generate: the prompt is 16 tokens, and max_model_len is 16: no room for an output "
                    "token; shorten it or raise model.max_model_len (--set model.max_model_len=N)")
    assert fake.prompts == [] and fake.closed


def test_prompt_plus_max_tokens_over_max_model_len_names_the_room(run, smollm2_tokenizer):
    result, fake = run(FakeCluster(smollm2_tokenizer, max_model_len=16), "--prompt-ids", "1,2,3",
                       "--prompt-ids", ",".join(["5"] * 10), "--max-tokens", "8")
    assert "prompt 2 is 10 tokens; with --max-tokens 8 that exceeds max_model_len (16); lower --max-tokens " \
           "to <= 6" in _one_line_exit_2(result)
    assert fake.prompts == []  # checked before the first prompt runs


def test_set_value_that_is_not_yaml_is_one_line_and_exit_2(run, smollm2_tokenizer):
    result, _ = run(FakeCluster(smollm2_tokenizer), "--prompt", "hi", "--set", "router.lease_s=[1, 2")
    assert "--set 'router.lease_s=[1, 2': the value is not valid YAML" in _one_line_exit_2(result)


def test_version():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == (f"disagg {version('disagg')} (torch {version('torch')}, "
                                     f"triton {version('triton')}, ray {version('ray')})")


@pytest.mark.parametrize("verb", ["launch", "check", "generate", "bench", "serve"])
def test_help_metavars_are_readable(verb: str):
    result = CliRunner().invoke(app, [verb, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    for unreadable in ("{config}", "{CONFIG}", "--no-ignore-eos", "--no-verbose", "--no-serve", "--no-raw"):
        assert unreadable not in result.output, (unreadable, result.output)
    python_types = re.findall(r"<[a-z]+(?:\[[A-Za-z]+\])?>", result.output)  # typer's <list[str]>, <bool>
    assert not python_types, (python_types, result.output)
    assert "KEY=VALUE" in result.output or verb in ("bench", "serve")


@pytest.mark.slow
def test_smollm2_answers_through_its_chat_template(smollm2_tokenizer, tmp_path: Path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run(CLI + ["generate", SMOLLM2, "--prompt", "What is the capital of France?",
                                   "--max-tokens", "16"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Paris" in result.stdout and "tokens/s]" in result.stdout, result.stdout
    assert "Started a local Ray instance" not in result.stderr and "Token authentication" not in result.stderr


@pytest.mark.slow
def test_sigterm_stops_launch_with_exit_0(tmp_path: Path):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(CLI + ["launch", TINY, "--status-every-s", "0.5"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if " | prefill-0 run " in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-2000:]
    assert "SIGTERM: shutting down" in output and "Traceback" not in output, output[-2000:]
    assert "SIGTERM received" not in output  # Ray's C++ handler did not get it
