"""docs/ARCHITECTURE.md stays true: what cites it exists, and what it names exists.

- every ``docs/ARCHITECTURE.md §N`` citation in code, configs and docs names a section the file
  has (its ``<a id="sN">`` anchors);
- nothing cites the design contract outside the repository (``DESIGN §``, ``DESIGN.md``,
  ``/work/shared``): the architecture a reader needs is in the repository;
- every repository path the document names in backticks exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
CITED = re.compile(r"docs/ARCHITECTURE\.md\s*§\s*(\d+)")
OUTSIDE = re.compile(r"DESIGN §|DESIGN\.md|/work/shared")


def _tracked_texts() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml", "*.toml", "Makefile"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in out.split()]


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
