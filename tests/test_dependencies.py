"""A plain `pip install` of the project is enough for its own commands.

Every third-party module that the installed code imports (at the top of a module or inside a
function: `disagg bench` imports matplotlib only when it saves plots, httpx only with
--base-url) must come from a distribution in `project.dependencies` or from one of their own
requirements. The few imports that are optional by design are listed in OPTIONAL with the extra
that provides them and the guard that keeps them optional. A static scan of the sources: no
install, no network, a second or two.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("disagg", "cluster", "kernels", "transfer")  # the folders installed as disagg.*

# module -> (the extra that provides it, why the core commands do not need it)
OPTIONAL = {
    "nvshmem": ("gpu", "transfer/nvshmem_heap.py, the GPU heap; CPU runs use the shm heap"),
    "cuda": ("gpu", "nvshmem4py's cuda.core, imported by transfer/nvshmem_heap.py only"),
    "transformers": ("convert", "the one-time SmolLM2 GGUF conversion (disagg/model/smollm2.py)"),
}


def _requirement_name(text: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", text.strip(), maxsplit=1)[0]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [_requirement_name(r) for r in project["dependencies"]]


def dependency_closure(names: list[str]) -> set[str]:
    """The distributions `names` pull in, by the installed metadata (requirements behind an extra
    marker left out, other markers evaluated for this interpreter)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [_normalize(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_normalize(req.name))
    return seen


def third_party_imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} over the installed sources."""
    found: dict[str, set[str]] = {}
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top != "disagg" and top not in sys.stdlib_module_names and top != "__future__":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_import_of_the_commands_is_a_core_dependency():
    provided = importlib.metadata.packages_distributions()
    closure = dependency_closure(core_requirements())
    missing = []
    for module, files in sorted(third_party_imports().items()):
        if module in OPTIONAL:
            continue
        dists = {_normalize(d) for d in provided.get(module, [module])}
        if not dists & closure:
            missing.append(f"{module} (distribution {sorted(dists)}; imported by {sorted(files)})")
    assert not missing, ("imported by the installed code but not in project.dependencies nor pulled in by them "
                         "(a plain `pip install` would crash there): " + "; ".join(missing)
                         + ". Add them to [project] dependencies in pyproject.toml, or to OPTIONAL here with "
                           "their extra and the guard that keeps them optional.")


def test_the_optional_imports_are_in_their_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, (extra, _why) in OPTIONAL.items():
        assert extra in extras, f"OPTIONAL[{module!r}] names the extra {extra!r}, which pyproject.toml lacks"
    assert any(_requirement_name(r) == "transformers" for r in extras["convert"])


def test_no_core_dependency_hides_in_an_extra_only():
    """The commands' own libraries are core, not only in an extra (a regression of the bench extra)."""
    core = {_normalize(n) for n in core_requirements()}
    assert {"matplotlib", "httpx"} <= core, sorted(core)
