"""The docs stay true and read as the project now: what they cite and link exists, no history wording.

- every ``docs/ARCHITECTURE.md §N`` citation in code, configs and docs names a section the file
  has (its ``<a id="sN">`` anchors);
- nothing cites the design contract outside the repository (``DESIGN §``, ``DESIGN.md``,
  ``/work/shared``): the architecture a reader needs is in the repository;
- every repository path docs/ARCHITECTURE.md names in backticks exists;
- README.md is at most 300 lines;
- every relative link in README.md and docs/*.md resolves to a file of the repository (tracked, or
  new and not ignored), and its ``#anchor`` to a heading or ``<a id>`` of the target;
- no history wording (``WORDING``, ``HASH``, ``DATE``) in README.md, docs/*.md, configs/*.yaml, the
  Makefile, and the comments and whitespace-holding string literals of every .py file outside
  benchmarks/records/: history lives in benchmarks/records/ and git.
The commands the docs show: tests/test_docs_commands.py.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
CITED = re.compile(r"docs/ARCHITECTURE\.md\s*§\s*(\d+)")
OUTSIDE = re.compile(r"DESIGN §|DESIGN\.md|/work/shared")


def _visible_files() -> set[str]:
    """Paths a fresh clone has: tracked, or new and not ignored (files not committed yet)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {name for name in out.splitlines() if (ROOT / name).is_file()}


def _tracked_texts() -> list[Path]:
    return [ROOT / name for name in sorted(_visible_files())
            if name.endswith((".py", ".md", ".yaml", ".toml")) or name == "Makefile"]


def _sections() -> set[str]:
    return set(re.findall(r'<a id="s(\d+)"></a>', ARCHITECTURE.read_text()))


def test_citations_name_existing_sections():
    sections = _sections()
    assert sections, f"{ARCHITECTURE} has no <a id=\"sN\"> section anchors"
    bad = []
    for path in _tracked_texts():
        for number in CITED.findall(path.read_text(errors="replace")):
            if number not in sections:
                bad.append(f"{path.relative_to(ROOT)} cites §{number}")
    assert not bad, f"citations of missing sections (have {sorted(sections, key=int)}): {bad}"


def test_nothing_cites_the_contract_outside_the_repository():
    bad = []
    for path in _tracked_texts():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert not bad, f"cite docs/ARCHITECTURE.md instead: {bad}"


def test_named_paths_exist():
    text = re.sub(r"```.*?```", "", ARCHITECTURE.read_text(), flags=re.S)
    missing = []
    for token in re.findall(r"`([^`\n]+)`", text):
        path = token.split()[0].rstrip(",:;")
        is_repo_path = "/" in path and not path.startswith("/") and re.search(r"\.(py|md|yaml|toml)$|/$", path)
        if is_repo_path and "*" not in path and not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


README = ROOT / "README.md"
MAX_README_LINES = 300


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, (
        f"README.md has {num_lines} lines, expected at most {MAX_README_LINES}: move detail to docs/ "
        "(deployment, serving, benchmarking, planning, gpus, security, results) and link it")


# --- links ----------------------------------------------------------------------------------------

FENCED = re.compile(r"^\s*(`{3,}|~{3,}).*?^\s*\1[`~]*\s*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
LINK_TARGETS = (re.compile(r"\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)"),  # [x](t), ![x](t)
                re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)", re.M),              # [x]: t
                re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\""))           # HTML
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:|^//", re.I)


def _blank(match: re.Match) -> str:
    """The match with every character but newlines blanked: line numbers and offsets stay."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _prose(text: str) -> str:
    """Markdown without its fenced blocks and inline code spans (same offsets)."""
    return INLINE_CODE.sub(_blank, FENCED.sub(_blank, text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: text lowercased, punctuation but `-` and `_` dropped, spaces -> `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>|`", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    prose = FENCED.sub(_blank, markdown)
    headings = re.findall(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M)
    headings += re.findall(r"^ {0,3}(\S.*?)\s*\n {0,3}(?:=+|-+)\s*$", prose, re.M)
    anchors, seen = set(), Counter()
    for slug in map(_slug, headings):
        anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return anchors | set(re.findall(r"<a\s[^>]*(?:id|name)=\"([^\"]+)\"", markdown))


def link_failures(doc: Path, root: Path, visible: set[str] | None = None) -> list[str]:
    """`path:line: target (why)` for each relative link of `doc` that does not resolve.

    `visible`: the repository paths a reader has (None: whatever exists on disk).
    """
    text = doc.read_text()
    prose = _prose(text)
    failures = []
    for pattern in LINK_TARGETS:
        for match in pattern.finditer(prose):
            target = match.group(1)
            if SCHEME.match(target):
                continue
            line = prose.count("\n", 0, match.start()) + 1
            path_part, _, anchor = unquote(target).partition("#")
            path_part = path_part.split("?")[0]
            file = (root / path_part.lstrip("/")) if path_part.startswith("/") else (doc.parent / path_part)
            file = file.resolve() if path_part else doc.resolve()
            where = f"{doc.relative_to(root)}:{line}: {target}"
            try:
                rel = file.relative_to(root.resolve()).as_posix()
            except ValueError:
                failures.append(f"{where} (outside the repository)")
                continue
            exists = file.exists() if visible is None else (
                rel in visible or any(name.startswith(rel + "/") for name in visible) or rel == ".")
            if not exists:
                failures.append(f"{where} (no such file{'' if visible is None else ' in the repository'})")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                failures.append(f"{where} (no heading or <a id> `{anchor}` in {rel})")
    return failures


def test_relative_links_resolve():
    visible = _visible_files()
    failures = [f for doc in _docs() for f in link_failures(doc, ROOT, visible)]
    assert not failures, "links that do not resolve (ignored files such as results/ are not in a clone):\n" + \
        "\n".join(failures)


def test_link_checker_flags_missing_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Two words\n\nSetext `heading`\n---\n<a id=\"s3\"></a>\n")
    (tmp_path / "a.md").write_text(
        "[ok](docs/b.md) [ok](docs/b.md#two-words) [ok](docs/b.md#setext-heading) [ok](docs/b.md#s3)\n"
        "![ok](docs/b.md) [web](https://example.com/x.md) [self](#top-title) `[code](missing.md)`\n"
        "# Top title\n[bad](missing.md)\n[bad](docs/b.md#nope)\n```\n[fenced](missing.md)\n```\n")
    failures = link_failures(tmp_path / "a.md", tmp_path)
    assert [f.split(" (")[0] for f in failures] == ["a.md:4: missing.md", "a.md:5: docs/b.md#nope"], failures


# --- history wording ------------------------------------------------------------------------------

WORDING = [re.compile(pattern, re.I) for pattern in (
    r"\bsittings?\b",
    r"\bissues?\s+#?\d+",  # `vllm#17990`: an external reference, fine
    r"\bthe\s+lead\b",
    r"\b(?:this|that|last|earlier|previous|next|each|per|one|a|device|later|same|lead['’]s)\s+sessions?\b",
    r"\bsession\s+[a-z]\b",
    r"\bsessions?\s+\d",
)]
# A commit hash: a 7-12 character lowercase-hex word with a digit and a letter; not `0x...` hex
# (its digits follow the `x`, which the first look-behind already refuses).
HASH = re.compile(r"(?<![0-9A-Za-z_])(?<!0x)(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![0-9A-Za-z_])")
DATE = re.compile(r"20\d\d-\d\d-\d\d")
RECORD_PATH = re.compile(r"benchmarks/records/[^\s`'\"()\[\]<>,;]*")


def wording_hits(text: str) -> list[tuple[int, str]]:
    """(offset, matched text) of every history word in `text`; a date inside a records path is fine."""
    hits = [(m.start(), m.group(0)) for pattern in (*WORDING, HASH) for m in pattern.finditer(text)]
    records = [m.span() for m in RECORD_PATH.finditer(text)]
    hits += [(m.start(), m.group(0)) for m in DATE.finditer(text)
             if not any(start <= m.start() and m.end() <= end for start, end in records)]
    return sorted(hits)


def _python_pieces(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each comment and each string literal holding whitespace.

    Python 3.12+ tokenizes an f-string as FSTRING_START ... FSTRING_END, with the strings of its
    fields as tokens of their own: the outermost one is taken whole from the source, as 3.11 gives
    it in one STRING token.
    """
    lines = source.splitlines(keepends=True)
    starts = {getattr(tokenize, name) for name in ("FSTRING_START", "TSTRING_START") if hasattr(tokenize, name)}
    ends = {getattr(tokenize, name) for name in ("FSTRING_END", "TSTRING_END") if hasattr(tokenize, name)}
    pieces, open_fstrings = [], []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if open_fstrings and token.type not in starts | ends:
            continue  # inside an f-string's {fields}: part of the f-string's text
        if token.type == tokenize.COMMENT:
            pieces.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and re.search(r"\s", token.string):
            pieces.append((token.start[0], token.string))
        elif token.type in starts:
            open_fstrings.append(token.start)
        elif token.type in ends:
            (row, col), (end_row, end_col) = open_fstrings.pop(), token.end
            if not open_fstrings:
                text = "".join(lines[row - 1:end_row])[col:]
                text = text[:len(text) - len(lines[end_row - 1]) + end_col]
                if re.search(r"\s", text):
                    pieces.append((row, text))
    return pieces


def file_wording_hits(path: Path) -> list[tuple[int, str]]:
    """(line, matched text) of every history word in `path`: all of it, or a .py file's comments and strings."""
    source = path.read_text(errors="replace")
    pieces = _python_pieces(source) if path.suffix == ".py" else [(1, source)]
    return [(row + piece[:offset].count("\n"), matched)
            for row, piece in pieces for offset, matched in wording_hits(piece)]


def _wording_scope() -> list[Path]:
    scanned = [*_docs(), *sorted((ROOT / "configs").glob("*.yaml")), ROOT / "Makefile"]
    scanned += [ROOT / name for name in sorted(_visible_files())
                if name.endswith(".py") and not name.startswith("benchmarks/records/")]
    return [path for path in scanned if path != Path(__file__).resolve()]


def test_no_history_wording():
    hits = [(path.relative_to(ROOT).as_posix(), line, matched)
            for path in _wording_scope() for line, matched in file_wording_hits(path)]
    per_folder = Counter(name.split("/")[0] if "/" in name else name for name, _, _ in hits)
    shown = [f"{name}:{line}: {matched}" for name, line, matched in hits[:60]]
    assert not hits, (
        f"{len(hits)} history words (session, sitting, issue N, the lead, commit hashes, dates outside "
        f"benchmarks/records/ paths) by folder {dict(sorted(per_folder.items()))}; say what the project "
        "is now and cite benchmarks/records/<dir> where a figure comes from a record:\n" + "\n".join(shown)
        + (f"\n... and {len(hits) - 60} more" if len(hits) > 60 else ""))


def test_wording_patterns(tmp_path):
    flagged = ["session u", "issue 25", "8cd2c30", "2026-11-27", "the lead", "sitting"]
    fine = ['scope="session"', "test session", "vllm#17990", "0x7fffffff",
            "benchmarks/records/plan-h200-2026-11-29c", "float16", "e4m3", "deadbeef"]
    doc = tmp_path / "a.md"
    doc.write_text("In session u, issue 25 at 8cd2c30\non 2026-11-27: the lead's sitting.\n" + " ".join(fine))
    assert file_wording_hits(doc) == [(1, "session u"), (1, "issue 25"), (1, "8cd2c30"), (2, "2026-11-27"),
                                      (2, "the lead"), (2, "sitting")]
    code = tmp_path / "a.py"
    code.write_text(
        '"""Module: session u,\nissue 25."""\n'
        'x = f"{1} at 8cd2c30"  # 2026-11-27\n'
        'def f(scope="session", mask=0x7fffffff):  # test session, vllm#17990, float16, e4m3\n'
        '    return "the lead\'s sitting", "benchmarks/records/plan-h200-2026-11-29c", "8cd2c30"\n')
    assert file_wording_hits(code) == [(1, "session u"), (2, "issue 25"), (3, "8cd2c30"), (3, "2026-11-27"),
                                       (5, "the lead"), (5, "sitting")]
    assert not wording_hits(" ".join(fine)), [m for _, m in wording_hits(" ".join(fine))]
    assert [m for _, m in wording_hits(" ".join(flagged))] == ["session u", "issue 25", "8cd2c30",
                                                               "2026-11-27", "the lead", "sitting"]
