"""`git_commit` (cluster/bench/report.py): a result names the exact tree it ran, dirty or not."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from disagg.cluster.bench import report


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_dirty_tree_is_named_by_its_diff(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(report, "REPO_ROOT", tmp_path)
    clean = report.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}", clean)
    (tmp_path / "a.py").write_text("x = 2\n")
    first = report.git_commit()
    assert re.fullmatch(clean + r"-dirty-[0-9a-f]{10}", first)
    assert report.git_commit() == first  # the same tree, the same name
    (tmp_path / "a.py").write_text("x = 3\n")
    assert report.git_commit() not in (first, clean)  # another tree on the same HEAD: another name
    (tmp_path / "a.py").write_text("x = 1\n")
    assert report.git_commit() == clean
