"""`disagg plan` choosing the TP of each role: with profiles of TP 1 and TP 2 it searches
xP(TP1)+yD(TP2) and xP(TP2)+yD(TP1) beside each TP's own deployments, times every instance by
its role's profile, and writes the YAML of the fleet it simulated (TP per role, pages).

The TP 2 profiles are built from the TP 1 one (tensor_parallel 2, half the KV bytes per token,
their own step times); `test_simulate_tp.py` profiles a real TP 2 instance."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_profiles import PROFILE as TP1
from plan_profiles import SLOS, TINY_RUN, write_profile
from typer.testing import CliRunner

from disagg.cluster.cli.app import app
from disagg.cluster.simulate import plan as planner
from disagg.config import Config

TP2 = dict(TP1, tensor_parallel=2, engine=dict(TP1["engine"], kv_bytes_per_token=256, num_pages=128,
                                               max_model_len=2048))
# Coefficients (decode step, per prompt token, per decoding sequence, per context token, prompt
# step): at TP 1 a step with a decode takes over 25 ms, past a TPOT of 20 ms; at TP 2 a step with
# prompt tokens takes 0.5 s, past a TTFT of 300 ms. Only prefill at TP 1 and decode at TP 2 meets both.
FAST_PREFILL = {"coef_s": [1.5e-3, 2e-5, 0.025, 5e-8, 1.5e-3], "error": 0.1}
FAST_DECODE = {"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8, 0.5], "error": 0.1}


def test_the_search_spans_each_pair_of_profiled_tps():
    search = planner.candidates(4, (256,), tensor_parallel=[1, 2])
    mixed = {c.label: c for c in search if len(c.tensor_parallels) == 2}
    assert list(mixed) == ["2P(TP1)+1D(TP2)", "2P(TP1)+1D(TP2)-adaptive", "1P(TP2)+2D(TP1)", "1P(TP2)+2D(TP1)-adaptive"]
    split = mixed["2P(TP1)+1D(TP2)"]
    assert split.sections["instances"] == {"prefill": 2, "decode": 1, "tensor_parallel": {"prefill": 1, "decode": 2}}
    assert (split.tensor_parallel_of("prefill"), split.tensor_parallel_of("decode"), split.num_gpus) == (1, 2, 4)
    # Each split fills the GPUs: no room is left for one more instance of either role.
    assert planner.tp_splits(8, 1, 2) == [(2, 3), (4, 2), (6, 1)]
    assert planner.tp_splits(7, 2, 4) == [(1, 1)]  # 6 of 7 GPUs: a TP-2 instance more would need 8
    assert planner.tp_splits(3, 2, 2) == []  # the search at one TP covers equal TPs
    wide = planner.tp_splits(64, 1, 4)
    assert len(wide) == 9 and all(x + 4 * y == 64 for x, y in wide)  # beyond 8 splits: the nine ratios
    assert [c.label for c in planner.candidates(4, (256,), tensor_parallel=[1])][:2] == ["colocated-4[chunk=256]", "1P3D"]


def test_a_split_across_tps_times_each_role_by_its_profile():
    """Each instance runs its role's step-time model and pushes its role's KV bytes; the fleet
    runs the pages a launch sizes (TP 2's 128 pages of half the bytes hold 64 of TP 1's, which the
    TP 2 rank views as 128); a split whose decode side is the slow one misses."""
    (cand,) = [c for c in planner.candidates(4, (256,), adaptive=False, tensor_parallel=[1, 2])
               if c.label == "2P(TP1)+1D(TP2)"]
    profiles = {1: dict(TP1, fit=FAST_PREFILL), 2: dict(TP2, fit=FAST_DECODE)}
    base = planner.base_of(cand, profiles, SLOS)
    assert base["cache"]["num_pages"] == 64 and "tensor_parallel" not in base["instances"]
    config = Config.from_dict(planner.config_of(base, cand))
    fleet = planner.SimFleet(config, planner.role_profiles(cand, profiles))
    coef = {inst.name: list(inst.actor.runner.model.coef[:5]) for inst in fleet.instances}
    assert coef == {"prefill-0": FAST_PREFILL["coef_s"], "prefill-1": FAST_PREFILL["coef_s"],
                    "decode-0": FAST_DECODE["coef_s"]}
    assert {name: list(m.coef[:5]) for name, m in fleet.placer.fleet_model.models.items()} == coef
    assert {inst.name: inst.actor.connector.sender.bytes_per_token for inst in fleet.instances} == {
        "prefill-0": 512, "prefill-1": 512, "decode-0": 256}
    assert fleet.num_pages == 64
    assert {inst.name: inst.actor.cache.num_pages for inst in fleet.instances} == {
        "prefill-0": 64, "prefill-1": 64, "decode-0": 128}

    def goodput(label: str) -> float:
        (c,) = [c for c in planner.candidates(4, (256,), adaptive=False, tensor_parallel=[1, 2]) if c.label == label]
        return planner.judge(c, planner.base_of(c, profiles, SLOS), planner.role_profiles(c, profiles),
                             dataset_name="random", slos_ms=SLOS, run_length=TINY_RUN, input_len=32,
                             output_len=8).goodput_rps

    assert goodput("2P(TP1)+1D(TP2)") > 0 == goodput("1P(TP2)+2D(TP1)")


def test_plan_chooses_the_tp_of_each_role_and_writes_the_fleet_it_simulated(tmp_path: Path):
    tp1 = write_profile(tmp_path, dict(TP1, fit=FAST_PREFILL), "tp1.json")
    tp2 = write_profile(tmp_path, dict(TP2, fit=FAST_DECODE), "tp2.json")
    out = tmp_path / "best.yaml"
    result = CliRunner().invoke(app, ["plan", "--profile", str(tp1), "--profile", str(tp2), "--dataset-name",
                                      "random", "--random-input-len", "32", "--random-output-len", "8", "--goodput",
                                      "ttft:300", "tpot:20", "--gpus", "4", "--chunk-sizes", "256", "--run-seconds",
                                      "1", "--max-prompts", "40", "--jobs", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    screened = [line for line in result.output.splitlines() if line.startswith("  simulate") or
                line.startswith("  screened out")]
    assert len(screened) == len(planner.candidates(4, (256,), tensor_parallel=[1, 2]))
    assert any(line.startswith("  simulate") and "2P(TP1)+1D(TP2):" in line for line in screened)
    assert any(line.startswith("  screened out") and "1P(TP2)+2D(TP1):" in line for line in screened), result.output
    best = next(line for line in result.output.splitlines() if line.startswith("best: "))
    assert best.startswith("best: 2P(TP1)+1D(TP2)"), result.output
    config = Config.from_yaml(out)
    assert (config.instances.prefill, config.instances.decode) == (2, 1)
    assert (config.instances.tensor_parallel_of("prefill"), config.instances.tensor_parallel_of("decode")) == (1, 2)
    # TP 2's memory is the tightest: its 128 pages of half the bytes hold 64 of TP 1's, which a
    # sequence of TP 1's must fit in
    assert config.instances.num_ranks == 4 and config.cache.num_pages == 64
    assert config.model.max_model_len == 64 * 16
    fleet = planner.SimFleet(config, {"prefill": dict(TP1, fit=FAST_PREFILL), "decode": dict(TP2, fit=FAST_DECODE)})
    assert fleet.num_pages == config.cache.num_pages  # the YAML launches the pages simulated


def test_a_role_at_a_tp_no_profile_timed_is_refused():
    (cand,) = [c for c in planner.candidates(4, (256,), adaptive=False, tensor_parallel=[1, 2])
               if c.label == "2P(TP1)+1D(TP2)"]
    with pytest.raises(ValueError, match=r"no profile of the TP of 2P\(TP1\)\+1D\(TP2\).*profile an instance of TP 2"):
        planner.role_profiles(cand, {1: TP1})


def test_the_screen_prices_a_push_across_tps_by_its_busiest_link():
    """1P(TP2)+2D(TP1): each prefill rank holds 256 B a token, but the one decode rank it fills
    takes 512 B a token from the two of them; on a slow link the split is bound by that link."""
    (cand,) = [c for c in planner.candidates(4, (256,), adaptive=False, tensor_parallel=[1, 2])
               if c.label == "1P(TP2)+2D(TP1)"]
    work = planner.screen.WorkloadShape.of([32], [8])
    got = planner.screened(cand, {1: TP1, 2: TP2}, SLOS, work, link_gbps=1e-6)
    assert got.bound == "prefill" and got.rate_rps == pytest.approx(1e3 / (32 * 512))
