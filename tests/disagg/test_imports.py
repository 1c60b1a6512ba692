"""The bookkeeping modules import in one direction: no module imports the cache back."""

from __future__ import annotations

import ast
from pathlib import Path

import disagg

BOOKKEEPING = ["blocks", "copies", "forward", "integrity", "pages", "plan", "posmap", "prefix",
               "prefix_cache", "prefix_index", "reserve", "sliding"]


def _imports(module: str) -> set[str]:
    tree = ast.parse((Path(disagg.__file__).parent / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_bookkeeping_module_imports_the_cache() -> None:
    for module in BOOKKEEPING:
        assert "disagg.cache" not in _imports(module), f"disagg.{module} imports disagg.cache (a cycle)"
