"""Replay of bad command lines through `disagg generate`, in process (typer's CliRunner).

Every case must end with exit status 2, a message naming what is wrong, no Python traceback, and
no prompt sent to the fleet. The classes: --set values that are not YAML or not key=value; prompt
ids that are not integers, empty, negative or outside the vocabulary; no prompt at all, or an
unreadable / empty --prompt-file; sampling options out of range; an unknown --log-level; a
prompt (alone or with --max-tokens) over max_model_len; a text prompt for a model without
tokenizer; a chat template that fails. The launcher is replaced by a fake fleet that records
what reaches it: "launched" counts cases that got past the pre-launch checks (those needing the
tokenizer or max_model_len must), "streamed" counts prompts sent (none may be).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.cli import generate as gen
from disagg.cluster.cli.app import app

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-1p1d.yaml")
LONG = ",".join(["5"] * 40)


class CharTokenizer:
    """One token per character (id = code point % 90 + 3); a chat template that may fail."""

    eos_token_ids = (2,)

    def __init__(self, template: str | None = None) -> None:
        self.chat_template = template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 90 + 3 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        raise ValueError("template error: raise_exception('Conversation roles must alternate')")


class FakeFleet:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.max_model_len, self.vocab_size, self.model_name = tokenizer, 32, 100, "fake"
        self.streamed = 0

    async def stream(self, prompt, params):
        self.streamed += 1
        raise AssertionError("no bad case may reach the stream")
        yield  # an async generator

    def shutdown(self) -> None:
        pass


# name -> (arguments after CONFIG, tokenizer kind, text the message holds, launched, one line of ours)
CASES = {
    "set value not YAML (open list)": (["--prompt", "a", "--set", "router.lease_s=[1, 2"],
                                       "plain", "the value is not valid YAML", False, True),
    "set value not YAML (open map)": (["--prompt", "a", "--set", "model.dtype={"], "plain",
                                      "the value is not valid YAML", False, True),
    "set value not YAML (reserved @)": (["--prompt", "a", "--set", "cache.page_size=@16"], "plain",
                                        "the value is not valid YAML", False, True),
    "set without =": (["--prompt", "a", "--set", "router.lease_s: 5"], "plain",
                      "expected section.key=value", False, True),
    "set without key": (["--prompt", "a", "--set", "=5"], "plain", "expected section.key=value", False, True),
    "set of an unknown key": (["--prompt", "a", "--set", "router.lease=5"], "plain",
                              "router.lease: unknown key; did you mean 'lease_s'?", False, False),
    "no prompt": ([], "plain", "give a prompt", False, False),
    "ids not integers": (["--prompt-ids", "1,a"], "plain", "expected integers separated by commas", False, False),
    "ids with semicolons": (["--prompt-ids", "1;2"], "plain", "expected integers separated by commas", False, False),
    "prompt file missing": (["--prompt-file", "/nonexistent/prompts.txt"], "plain", "cannot read /nonexistent",
                            False, False),
    "prompt file blank": (["--prompt-file", "{blank}"], "plain", "give a prompt", False, False),
    "temperature negative": (["--prompt", "a", "--temperature", "-1"], "plain", "temperature", False, False),
    "top_p zero": (["--prompt", "a", "--top-p", "0"], "plain", "top_p", False, False),
    "top_k negative": (["--prompt", "a", "--top-k", "-1"], "plain", "top_k", False, False),
    "max_tokens zero": (["--prompt", "a", "--max-tokens", "0"], "plain", "max_tokens", False, False),
    "max_tokens not a number": (["--prompt", "a", "--max-tokens", "many"], "plain", "--max-tokens",
                                False, False),
    "unknown log level": (["--prompt", "a", "--log-level", "loud"], "plain", "--log-level", False, False),
    "ids over max_model_len": (["--prompt-ids", LONG], "plain", "no room for an output token", True, True),
    "text over max_model_len": (["--prompt", "x" * 40, "--raw"], "plain", "the prompt is 40 tokens", True, True),
    "ids + max_tokens over": (["--prompt-ids", "1,2,3", "--max-tokens", "30"], "plain",
                              "lower --max-tokens to <= 29", True, True),
    "second prompt over": (["--prompt-ids", "1", "--prompt-ids", LONG, "--max-tokens", "1"], "plain",
                           "prompt 2 is 40 tokens", True, True),
    "id outside the vocabulary": (["--prompt-ids", "1,100"], "plain", "token id 100 is outside the vocabulary",
                                  True, True),
    "negative id": (["--prompt-ids", "-1,2"], "plain", "token id -1 is outside the vocabulary", True, True),
    "empty ids": (["--prompt-ids", ","], "plain", "the prompt is empty", True, True),
    "empty raw text": (["--prompt", "", "--raw"], "plain", "the prompt is empty", True, True),
    "text without tokenizer": (["--prompt", "hello"], "none", "has no tokenizer", True, True),
    "chat template fails": (["--prompt", "hello"], "failing", "the chat template of fake failed", True, True),
}


def _tokenizer(kind: str):
    return {"plain": CharTokenizer(), "none": None, "failing": CharTokenizer(template="{{ raise_exception() }}")}[kind]


def test_every_bad_command_line_exits_2_with_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in ("DISAGG_LOG", "RAY_LOGGER_LEVEL"):  # setup_logging sets them; give them back
        monkeypatch.setenv(name, "WARNING")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    runner = CliRunner()
    counts = {"tried": 0, "exit_2": 0, "named": 0, "one_line": 0, "tracebacks": 0, "launched": 0, "streamed": 0}
    wrong = []
    for name, (args, kind, expected, should_launch, ours) in CASES.items():
        fleets = []

        def launcher(config, kind=kind, fleets=fleets):
            fleets.append(FakeFleet(_tokenizer(kind)))
            return fleets[-1]
        monkeypatch.setattr(gen, "launch_or_exit", launcher)
        args = [str(blank) if a == "{blank}" else a for a in args]
        result = runner.invoke(app, ["generate", CONFIG, *args], env={"COLUMNS": "250"})
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        checks = {"exit_2": result.exit_code == 2, "named": expected in result.output,
                  "one_line": not ours or len(lines) == 1}
        traceback = "Traceback" in result.output or result.exc_info is not None and not isinstance(
            result.exc_info[1], SystemExit)
        counts["tried"] += 1
        counts["tracebacks"] += traceback
        counts["launched"] += bool(fleets)
        counts["streamed"] += sum(f.streamed for f in fleets)
        for key, ok in checks.items():
            counts[key] += ok
        if not all(checks.values()) or traceback or bool(fleets) != should_launch or any(f.streamed for f in fleets):
            wrong.append(f"{name}: exit {result.exit_code}, launched {bool(fleets)}: {result.output[-600:]!r}")
    print("\nbad command lines replayed:", counts)
    assert not wrong, "\n".join(wrong)
    num_launching = sum(case[3] for case in CASES.values())
    assert counts == {"tried": len(CASES), "exit_2": len(CASES), "named": len(CASES), "one_line": len(CASES),
                      "tracebacks": 0, "launched": num_launching, "streamed": 0}


def test_the_base_command_line_runs():
    """The replay breaks one thing at a time: the command it starts from passes its checks."""
    fleet = FakeFleet(CharTokenizer())
    ids = gen.encode_prompts(fleet, ["hello", [1, 2, 3]], chat=True, max_tokens=8)
    assert ids == [CharTokenizer().encode("hello"), [1, 2, 3]]
