"""The demo job (`make demo`) end to end on the CPU: two Ray actors over the shm heap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from disagg.cluster.demo import DEFAULT_CONFIG, DemoConfig

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_checks_what_landed(tmp_path: Path):
    result = subprocess.run([sys.executable, "-m", "disagg.cluster.demo", str(DEFAULT_CONFIG)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "K/V mismatched bytes 0" in result.stdout
    assert "demo OK" in result.stdout
    # The resident requests leave holes, so at least one map has several runs.
    assert "decode map [3," in result.stdout


def test_demo_config_rejects_unknown_keys():
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["cache"]["page_sise"] = 16
    with pytest.raises(ValidationError, match="page_sise"):
        DemoConfig.model_validate(raw)


def test_demo_config_rejects_bad_values():
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["cache"]["page_size"] = 0
    with pytest.raises(ValidationError, match="page_size"):
        DemoConfig.model_validate(raw)


def test_bad_config_file_exits_with_a_message(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: {num_pages: 4, page_size: 16}\nprompts: [3]\n")  # no model section
    result = subprocess.run([sys.executable, "-m", "disagg.cluster.demo", str(bad)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "model" in result.stderr and "invalid demo config" in result.stderr


def test_demo_config_rejects_heads_that_do_not_group():
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["model"]["num_kv_heads"] = 3
    with pytest.raises(ValidationError, match="multiple of num_kv_heads"):
        DemoConfig.model_validate(raw)
