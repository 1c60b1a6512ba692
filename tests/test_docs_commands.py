"""Every command README.md and docs/*.md show runs or parses, checked in process (no Ray, no fleet).

Shell lines come from fenced ``bash``/``sh``/``shell``/``console`` blocks (``$ `` lines only in
``console``), and from untyped fences and indented blocks that hold at least one known command
(diagrams and tables do not). Each line is split on ``&&``, ``||``, ``;``, ``|`` and checked by its
first word (after ``VAR=value`` prefixes; ``.venv/bin/x`` counts as ``x``):

- ``disagg VERB ...``: the verb exists and every ``--flag`` it names is an option the verb's
  ``--help`` shows (read from its click parameters; a hidden one is a refused vLLM option), the
  group's for ``disagg --version``; each ``configs/...`` file it names exists;
- ``make TARGET``: the Makefile has the target;
- ``python -m MODULE``: importable (``importlib.util.find_spec``); ``python -c CODE`` compiles;
  ``python path.py`` / ``bash path.sh`` / ``path/to/script``: the file exists;
- ``SKIPPED`` first words are not checked; any other first word fails, so a new kind of command
  gets a decision (a checker or a place in ``SKIPPED``).
Inline code spans of prose that start with ``disagg``, ``make`` or ``python -m`` get the same
checks; ``python`` fences compile; every verb named answers ``--help``.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh", "shell-session"}
PYTHON_LANGS = {"python", "py", "python3", "pycon"}
# Commands that are someone else's tools (or shell built-ins): shown, not checked.
SKIPPED = {"pip", "pip3", "pytest", "curl", "ray", "export", "cd", "source", "git", "nvidia-smi", "echo"}
CHECKED = {"disagg", "make", "python", "python3", "bash", "sh"}
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", "<<", ">&", "&>"}
PLACEHOLDER = "PLACEHOLDER"


@dataclass
class Block:
    lang: str  # the fence's info word; "" for an untyped fence, "indented" for an indented block
    line: int  # 1-based line of its first line of content
    lines: list[str]


def code_blocks(text: str) -> list[Block]:
    """Fenced (```/~~~, any indent) and indented (4 spaces after a blank line) blocks of markdown."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^( *)(`{3,}|~{3,})\s*([\w+.-]*)", lines[i])
        if fence:
            indent, marker = len(fence.group(1)), fence.group(2)
            closing = re.compile(re.escape(marker[0]) + "{%d,}\\s*" % len(marker))
            j = i + 1
            while j < len(lines) and not closing.fullmatch(lines[j].strip()):
                j += 1
            body = [line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[i + 1:j]]
            blocks.append(Block(fence.group(3).lower(), i + 2, body))
            i = j + 1
        elif lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [line[4:] for line in lines[i:j]]
            while not body[-1].strip():
                body.pop()
            blocks.append(Block("indented", i + 1, body))
            i = j
        else:
            i += 1
    return blocks


def _strip_comment(line: str) -> str:
    """The line up to a `#` that starts a word outside quotes (a shell comment)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line


def split_shell(line: str) -> list[list[str]]:
    """The simple commands of a shell line, each as its words (assignments, redirections dropped).

    Raises:
        ValueError: the line does not parse as shell (an unclosed quote).
    """
    line = re.sub(r"<[^<>\s]+>", PLACEHOLDER, _strip_comment(line))  # `<config>`: a placeholder
    line = re.sub(r"\$\([^()]*\)|`[^`]*`", PLACEHOLDER, line)  # `$(nvidia-smi -L | wc -l)`: a value
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    tokens, commands, words = list(lexer), [], []
    for index, token in enumerate(tokens):
        following = tokens[index + 1] if index + 1 < len(tokens) else ""
        if token == "|" and following.startswith(("-", "[")):  # a synopsis' alternatives: `--a X | --b Y`
            continue
        if token in OPERATORS:
            commands.append(words)
            words = []
        else:
            words.append(token)
    commands.append(words)
    simple = []
    for words in commands:
        kept, skip_next = [], False
        for index, word in enumerate(words):
            if skip_next:
                skip_next = False
            elif word in REDIRECTS:
                skip_next = True
            elif word.isdigit() and index + 1 < len(words) and words[index + 1] in REDIRECTS:
                continue  # the 2 of `2> file`
            elif not kept and re.fullmatch(r"[A-Za-z_]\w*=.*", word):
                continue  # VAR=value before the command
            else:
                kept.append(word)
        if kept:
            simple.append(kept)
    return simple


def shell_lines(block: Block) -> list[tuple[int, str]] | None:
    """(line, command) of a block's commands, `\\` continuations joined; None: not a shell block."""
    if block.lang not in SHELL_LANGS | {"", "indented"}:
        return None
    joined, continuing = [], False
    for offset, raw in enumerate(block.lines):
        text = raw.strip()
        if continuing:
            joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + text)
        elif block.lang == "console" and not text.startswith("$ "):
            continue  # output
        else:
            joined.append((block.line + offset, text[2:] if text.startswith("$ ") else text))
        continuing = joined[-1][1].endswith("\\") if joined else False
    commands = [(line, text) for line, text in joined if _strip_comment(text).strip()]
    if block.lang in ("", "indented") and not any(_first_word(text) in CHECKED | SKIPPED for _, text in commands):
        return None  # a diagram, a table, prose in a list
    return commands


def _safe_split(text: str) -> list[list[str]]:
    try:
        return split_shell(text)
    except ValueError:
        return []


def _first_word(text: str) -> str:
    commands = _safe_split(text)
    return Path(commands[0][0]).name if commands else ""


@lru_cache(maxsize=1)
def _cli():
    import typer

    from disagg.cluster.cli.app import app
    return typer.main.get_command(app)


def _options(command, hidden: bool) -> set[str]:
    """The command's option names: those `--help` shows, or (hidden=True) the refused vLLM ones it hides."""
    shown = {"--help"} if not hidden else set()
    return shown | {opt for param in command.params if getattr(param, "hidden", False) == hidden
                    for opt in (*param.opts, *param.secondary_opts) if opt.startswith("-")}


def _flags(args: list[str]) -> list[str]:
    flags = []
    for arg in args:
        if arg == "--":
            break
        word = arg.strip("[](){},")
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", word):
            flags.append(word.split("=")[0])
    return flags


def check_disagg(args: list[str]) -> list[str]:
    group = _cli()
    if not args or args[0].startswith("-"):
        command, name = group, "disagg"
    elif not re.fullmatch(r"[a-z][a-z-]*", args[0]):
        return []  # `disagg VERB`, `disagg ...`: a placeholder
    elif args[0] not in group.commands:
        return [f"`disagg {args[0]}`: no such verb (the verbs: {', '.join(group.commands)})"]
    else:
        command, name = group.commands[args[0]], f"disagg {args[0]}"
    known, refused = _options(command, hidden=False), _options(command, hidden=True)
    problems = [f"`{name}` refuses `{flag}` (a vLLM option it does not support): name the option alone"
                if flag in refused else f"`{name}` has no option `{flag}` (see `{name} --help`)"
                for flag in _flags(args) if flag not in known]
    for arg in args:
        if arg.startswith("configs/") and not re.search(rf"[*{{}}]|{PLACEHOLDER}", arg) and not (ROOT / arg).is_file():
            problems.append(f"`{name}`: {arg} does not exist (the files: `ls configs/`)")
    return problems


@lru_cache(maxsize=1)
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(target for match in re.finditer(r"^([^\s:#=][^:=#]*?)\s*::?(?!=)", text, re.M)
                     for target in match.group(1).split())


def check_make(args: list[str]) -> list[str]:
    if {"-C", "-f", "--file", "--directory"} & set(args):
        return []  # another Makefile
    targets = [arg for arg in args if not arg.startswith("-") and "=" not in arg and PLACEHOLDER not in arg]
    names = ", ".join(sorted(t for t in make_targets() if re.fullmatch(r"[\w-]+", t)))
    return [f"`make {target}`: the Makefile has no such target (it has {names})"
            for target in targets if target not in make_targets()]


def check_python(args: list[str]) -> list[str]:
    index = 0
    while index < len(args) and args[index].startswith("-") and args[index] not in ("-m", "-c"):
        index += 2 if args[index] in ("-X", "-W") else 1
    if index >= len(args):
        return []
    if args[index] == "-m" and index + 1 < len(args):
        module = args[index + 1]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return [] if found else [f"`python -m {module}`: no such module"]
    if args[index] == "-c" and index + 1 < len(args):
        try:
            compile(args[index + 1], "<python -c>", "exec")
        except SyntaxError as error:
            return [f"`python -c`: does not compile ({error})"]
        return []
    return _check_script(args[index])


def _check_script(path: str) -> list[str]:
    if PLACEHOLDER in path or path.startswith(("/", "~", "$")) or (ROOT / path).is_file():
        return []
    return [f"{path}: no such file in the repository"]


def check_command(line: str) -> list[str]:
    """What is wrong with one shell line of the docs: [] when every command in it checks out."""
    try:
        commands = split_shell(line)
    except ValueError as error:
        return [f"does not parse as a shell line ({error})"]
    problems = []
    for words in commands:
        name, args = Path(words[0]).name, words[1:]
        if name == "disagg":
            problems += check_disagg(args)
        elif name == "make":
            problems += check_make(args)
        elif re.fullmatch(r"python(3(\.\d+)?)?", name):
            problems += check_python(args)
        elif name in ("bash", "sh"):
            problems += _check_script(args[0]) if args and not args[0].startswith("-") else []
        elif name in SKIPPED:
            continue
        elif "/" in words[0] and not words[0].startswith((".venv/", "/", "~")):
            problems += _check_script(words[0])
        else:
            problems.append(f"`{name}`: no check for this command: give it a checker or add it to SKIPPED "
                            "in tests/test_docs_commands.py")
    return problems


def doc_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of every shell line the markdown shows in its code blocks."""
    return [command for block in code_blocks(text) for command in (shell_lines(block) or [])]


def inline_commands(text: str) -> list[tuple[int, str]]:
    """(line, span) of prose code spans that run `disagg`, `make` or `python -m`."""
    prose = re.sub(r"^ *(`{3,}|~{3,}).*?^ *\1[`~]*\s*$", lambda m: re.sub(r"[^\n]", " ", m.group(0)),
                   text, flags=re.S | re.M)
    return [(prose.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split()))
            for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose)
            if re.match(r"\s*(disagg\s|make\s|python3?\s+-m\s)", match.group(1))]


def _ids(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("doc", DOCS, ids=_ids)
def test_shell_commands_run_or_parse(doc):
    failures = [f"{_ids(doc)}:{line}: {problem}\n    {text}"
                for line, text in doc_commands(doc.read_text()) for problem in check_command(text)]
    assert not failures, "commands the docs show that would not run:\n" + "\n".join(failures)


@pytest.mark.parametrize("doc", DOCS, ids=_ids)
def test_inline_commands_name_real_verbs_and_flags(doc):
    failures = [f"{_ids(doc)}:{line}: {problem}\n    `{text}`"
                for line, text in inline_commands(doc.read_text()) for problem in check_command(text)]
    assert not failures, "commands named in the prose that would not run:\n" + "\n".join(failures)


@pytest.mark.parametrize("doc", DOCS, ids=_ids)
def test_python_snippets_compile(doc):
    failures = []
    for block in code_blocks(doc.read_text()):
        if block.lang not in PYTHON_LANGS:
            continue
        source = textwrap.dedent("\n".join(block.lines))
        if re.search(r"^>>> ", source, re.M):  # typed at the `>>>` prompt: its input lines
            source = "\n".join(line[4:] for line in source.splitlines() if line.startswith((">>> ", "... ")))
        try:
            compile(source, f"{_ids(doc)}:{block.line}", "exec")
        except SyntaxError as error:
            failures.append(f"{_ids(doc)}:{block.line + (error.lineno or 1) - 1}: {error.msg}")
    assert not failures, "python snippets that do not compile:\n" + "\n".join(failures)


def test_every_verb_named_answers_help():
    from typer.testing import CliRunner

    from disagg.cluster.cli.app import app
    texts = [doc.read_text() for doc in DOCS]
    named = {words[1] for text in texts for _, line in doc_commands(text) + inline_commands(text)
             for words in _safe_split(line) if Path(words[0]).name == "disagg" and len(words) > 1}
    verbs = sorted(named & set(_cli().commands))
    assert verbs, "the docs show no `disagg <verb>` command"
    runner = CliRunner()
    for verb in verbs:
        result = runner.invoke(app, [verb, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, f"`disagg {verb} --help` exited {result.exit_code}: {result.output[-500:]}"


def test_extraction_and_checks():
    markdown = textwrap.dedent("""\
        Intro.

        ```bash
        DISAGG_TRACE_DIR=x disagg bench configs/tiny-1p1d.yaml --num-prompts 4 \\
          --no-compare   # CPU
        make test && python -m disagg.cluster.cli.demo
        ```

        ```console
        $ disagg check configs/tiny-1p1d.yaml
        ok: the output, not a command
        ```

        ```
        router -> P -> D      (a diagram)
        ```

            disagg plan --profile p.json --gpus 8 --out best.yaml

        1. A list item

            continued in prose, not a command.
        """)
    assert doc_commands(markdown) == [
        (4, "DISAGG_TRACE_DIR=x disagg bench configs/tiny-1p1d.yaml --num-prompts 4  --no-compare   # CPU"),
        (6, "make test && python -m disagg.cluster.cli.demo"),
        (10, "disagg check configs/tiny-1p1d.yaml"),
        (18, "disagg plan --profile p.json --gpus 8 --out best.yaml")]
    assert all(not check_command(text) for _, text in doc_commands(markdown))
    assert inline_commands("Run `disagg bench` or `make demo`; `disagg.cluster` is a package.") == [
        (1, "disagg bench"), (1, "make demo")]
    for line in ("disagg launch CONFIG [--serve]", "disagg --version", "disagg VERB --help",
                 "disagg generate configs/tiny-1p1d.yaml --prompt TEXT [--prompt ...] | --prompt-file FILE",
                 "pip install -e '.[test]'", ".venv/bin/pytest -q tests", "python3 -c 'import disagg'",
                 "source .whl/gpu-env.sh && make test-gpu 2>/dev/null", "python3 -m venv .venv",
                 "ray start --address=<head-ip>:6379 --num-gpus=$(nvidia-smi -L | wc -l)"):
        assert check_command(line) == [], line
    for line, expected in (("disagg bench configs/tiny-1p1d.yaml --no-such-flag", "has no option `--no-such-flag`"),
                           ("disagg frobnicate x", "no such verb"),
                           ("disagg serve configs/tiny-1p1d.yaml --tensor-parallel-size 2", "refuses"),
                           ("disagg launch configs/nosuch.yaml", "configs/nosuch.yaml does not exist"),
                           ("make nosuch", "no such target"),
                           ("python -m disagg.nosuch", "no such module"),
                           ("python3 benchmarks/nosuch.py --out x.json", "no such file"),
                           ("python3 -c 'import ('", "does not compile"),
                           ("echo 'unclosed", "does not parse"),
                           ("frobnicate --x | tee log", "no check for this command")):
        problems = check_command(line)
        assert problems and expected in problems[0], (line, problems)
