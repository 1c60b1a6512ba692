"""What the plan tests share (test_plan.py, test_plan_tp.py): the tiny model's instance as
`disagg profile` would time it, the SLOs the plans aim at, a short run, and the profile written
where `disagg plan --profile` reads it. Imported by name (conftest.py puts this folder on sys.path).
"""

from __future__ import annotations

import json
from pathlib import Path

from disagg.cluster.simulate import plan as planner

# The tiny instance at TP 1: 1.5 ms a step, 20 us a prompt token, 180 us a decoding sequence,
# 50 ns a context token; 256 pages of 16 tokens, 512 B of KV a token; no samples.
PROFILE = {
    "kind": "disagg-profile", "version": 1, "model": "dummy:tiny", "dtype": "float32",
    "device": {"host": "test", "gpus": [], "torch_device": "cpu"},
    "engine": {"num_pages": 256, "page_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "max_model_len": 4096, "kv_bytes_per_token": 512, "vocab_size": 256, "eos_token_ids": [2]},
    "fit": {"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8], "error": 0.1}, "samples": [],
}
SLOS = {"ttft": 300, "tpot": 20}  # ms: the goodput targets (``--goodput ttft:300 tpot:20``)
# Runs for what holds at any size (labels, flags, a hop past the TTFT target): 40 requests at most.
TINY_RUN = planner.RunLength(seconds=1.0, min_prompts=10, max_prompts=40)


def write_profile(tmp_path: Path, profile: dict, name: str = "profile.json") -> Path:
    """``profile`` as the JSON file ``tmp_path / name`` (what `disagg profile` writes); its path."""
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return path
