"""The layout and import rules of docs/ARCHITECTURE.md §1, checked on the installed package.

- one import root: `kernels/`, `transfer/`, `cluster/` install as `disagg.kernels` etc., and none
  of them as a top-level `kernels`, `transfer` or `cluster` module;
- `import disagg` (and the numpy-only core) pulls in no torch, triton, ray or nvshmem;
- imports only point down: triton only in disagg.kernels, nvshmem only in disagg.transfer,
  ray only in disagg.cluster, and the core never imports disagg.cluster.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"disagg": "disagg", "kernels": "disagg.kernels", "transfer": "disagg.transfer",
                "cluster": "disagg.cluster"}
HEAVY = ("torch", "triton", "ray", "nvshmem")


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    # A fresh interpreter whose working directory is NOT the repository, as a user's would be.
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_top_level_is_the_design_card():
    required = {"disagg", "kernels", "transfer", "cluster", "tests", "configs", "pyproject.toml",
                "README.md", "Makefile", ".ci"}
    present = {p.name for p in ROOT.iterdir()}
    assert required <= present, f"missing top-level entries: {sorted(required - present)}"


@pytest.mark.parametrize("folder,module", sorted(PACKAGE_DIRS.items()))
def test_folders_install_under_one_root(folder: str, module: str, tmp_path: Path):
    result = _run_python(f"import {module}; print({module}.__file__)", tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).parent == ROOT / folder


@pytest.mark.parametrize("name", ["kernels", "transfer", "cluster"])
def test_no_top_level_module_collides(name: str, tmp_path: Path):
    # Our folders install only under `disagg`: a top-level module of that name, where one is found,
    # is another distribution's (transformers >= 5.25 depends on Hugging Face's `kernels`).
    result = _run_python(f"import importlib.util; spec = importlib.util.find_spec({name!r}); "
                         f"print(spec.origin if spec is not None else '')", tmp_path)
    assert result.returncode == 0, result.stderr
    origin = result.stdout.strip()
    assert not origin or ROOT / name not in Path(origin).resolve().parents, (
        f"`import {name}` after install: expected no module from {ROOT / name}, got {origin}")


@pytest.mark.parametrize("module", ["disagg", "disagg.cache", "disagg.posmap", "disagg.errors",
                                    "disagg.plan"])
def test_core_imports_nothing_heavy(module: str, tmp_path: Path):
    code = (f"import sys, {module}\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
            "print(','.join(heavy))")
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{module} imported {result.stdout.strip()}"


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("library,allowed_folder", [("triton", "kernels"), ("nvshmem", "transfer"),
                                                     ("ray", "cluster")])
def test_heavy_libraries_stay_in_their_layer(library: str, allowed_folder: str):
    offenders = []
    for folder in PACKAGE_DIRS:
        if folder == allowed_folder:
            continue
        for path in _sources(folder):
            if any(n == library or n.startswith(library + ".") for n in _imported_roots(path)):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"{library} may be imported only under {allowed_folder}/: {offenders}"


def test_lower_layers_never_import_the_cluster():
    offenders = [str(p.relative_to(ROOT)) for folder in ("disagg", "kernels", "transfer")
                 for p in _sources(folder)
                 if any(n.startswith("disagg.cluster") for n in _imported_roots(p))]
    assert not offenders, f"imports must point down; these import disagg.cluster: {offenders}"


# The working tree is copied to a GPU host beside the wheels (`.whl`, ~55 MiB), both under 64 MiB
# together, so the tracked files stay a few MiB: raw traces and per-request results belong in a
# run's output and the records' summaries, not the tree.
TRACKED_BYTES_MAX = 7 * 2**20


def test_the_tracked_tree_stays_light_enough_to_travel_with_the_wheels():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    sizes = {str(f.relative_to(ROOT)): f.stat().st_size for f in files if f.is_file()}
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert sum(sizes.values()) <= TRACKED_BYTES_MAX, (
        f"tracked files: expected <= {TRACKED_BYTES_MAX / 2**20:.0f} MiB, got {sum(sizes.values()) / 2**20:.1f} MiB;"
        f" the largest: {largest}")
