"""The four-GPU comparison recipe (benchmarks/records/runbooks/FOURGPU.md) on CPU actors with the tiny model.

Each deployment is benched on its own through `disagg bench` (3P1D from tiny-2p2d.yaml by --set,
four colocated instances from tiny-colocated.yaml), on the prefill-heavy and chat workloads
shrunk to a few tokens, then `disagg bench --from-results` compares the split with colocated-4:
as on the GPUs, where each deployment is benched by a command of its own. Checks the plumbing (every request
served, four GPUs' worth of instances per side, the split judged against colocated-4 per
workload), not who wins. One split: the others differ only in their --set (2P2D and 1P3D serve
in tests/cluster/test_cluster_2p2d.py and test_cluster_xpyd_splits.py), and four fleets of four
took 45 s of `make test`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.cli.app import app

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
WORKLOADS = ("prefill-heavy", "chat")
NUM_PROMPTS = 4
RATE = "16"  # req/s: the four prompts arrive within ~0.25 s (at 4 req/s each run took ~1 s of waiting)
DEPLOYMENTS = {  # name: (config, --set overrides)
    "3p1d": ("tiny-2p2d.yaml", ["instances.prefill=3", "instances.decode=1"]),
    "colocated-4": ("tiny-colocated.yaml", ["instances.colocated=4", "instances.cpus_per_instance=0.5"]),
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def bench(args: list[str]) -> None:
    result = CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output + repr(result.exception)


def test_each_split_against_four_colocated_from_stored_results(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the actors inherit it: torch reference kernels
    for name, (config, sets) in DEPLOYMENTS.items():
        bench([str(CONFIGS / config), "--no-compare", *[a for s in sets for a in ("--set", s)],
               "--dataset-name", ",".join(WORKLOADS), "--num-prompts", str(NUM_PROMPTS), "--request-rate", RATE,
               "--random-input-len", "40", "--random-output-len", "4", "--num-warmups", "1",
               "--goodput", "ttft:20000", "--goodput", "tpot:5000", "--slo-scales", "1,2",
               "--save-result", "--result-dir", str(tmp_path / name), "--disable-tqdm"])
    colocated = [a for w in WORKLOADS for a in ("--from-results", str(tmp_path / "colocated-4" / w))]
    for split in ("3p1d",):
        out = tmp_path / f"{split}-vs-colocated-4"
        bench([*[a for w in WORKLOADS for a in ("--from-results", str(tmp_path / split / w))], *colocated,
               "--slo-scales", "1,2", "--result-dir", str(out)])
        summaries = json.loads((out / "compare.json").read_text())["datasets"]
        assert sorted(summaries) == sorted(WORKLOADS)
        for summary in summaries.values():
            under_test, baseline = summary["sides"]
            assert under_test["label"].startswith("tiny-2p2d") and baseline["label"].startswith("tiny-colocated")
            assert under_test["num_gpus"] == baseline["num_gpus"] == 4
            assert [row["best_other"] for row in summary["comparison"]["rows"]] == [baseline["label"]] * 2
            for run in summary["runs"]:
                for path in run["result_files"]:
                    result = json.loads(Path(path).read_text())
                    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result["errors"]
        assert "| prefill-heavy | 1x | TTFT 20000 ms, TPOT 5000 ms | tiny-2p2d" in (out / "summary.md").read_text()
