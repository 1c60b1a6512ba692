"""Ctrl-C during `disagg bench` on the tiny config (a real launch): one line that says what was
kept, exit status 130, no traceback, and the runs that had finished still on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-1p1d.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def ctrl_c_enabled() -> None:
    """In the child before exec: a test suite started in the background (`make test &`) hands its
    children SIGINT ignored, as shells do for background jobs, and Python then never raises
    KeyboardInterrupt; Ctrl-C is what this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    # A fast first rate (its table marks the moment), then a slow one to interrupt.
    command = [sys.executable, "-m", "disagg.cluster.cli.app", "bench", str(CONFIG), "--no-compare",
               "--num-prompts", "6", "--input-len", "8", "--output-len", "2", "--request-rate", "100,0.05",
               "--goodput", "ttft:60000", "tpot:60000", "--save-result", "--result-dir", str(tmp_path),
               "--disable-tqdm"]
    # TRITON_INTERPRET=0: the actors run the torch reference kernels (the interpreter took 8 s more).
    env = dict(os.environ, COLUMNS="80", DISAGG_LOG="ERROR", PYTHONUNBUFFERED="1", TRITON_INTERPRET="0")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=ctrl_c_enabled)
    seen, first_run_done = [], threading.Event()

    def read_stdout() -> None:  # a thread: select() cannot see lines already in the pipe's buffer
        for line in proc.stdout:
            seen.append(line)
            if "Successful requests" in line:
                first_run_done.set()
    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        assert first_run_done.wait(240), "".join(seen)
        time.sleep(0.5)  # inside the slow run: it starts ~10 ms after the table's line, and lasts ~2 min
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # the test failed before the bench ended: do not leave it running
            proc.kill()
    reader.join(10)
    out = "".join(seen)
    said = [line for line in err.splitlines() if line.startswith("disagg bench:")]
    assert proc.returncode == 130, (out, err)
    assert said == [f"disagg bench: interrupted (Ctrl-C); 1 finished run(s) kept: 1 result file(s) under {tmp_path}"], err
    assert "Traceback" not in err + out and "KeyboardInterrupt" not in err + out, err
    assert len(list(tmp_path.glob("tiny-1p1d-100.0qps-*.json"))) == 1
