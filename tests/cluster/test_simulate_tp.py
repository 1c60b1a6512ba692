"""Profiles of tensor-parallel instances: `disagg profile` times a TP instance's ranks and records
its TP; `simulate` and `plan` use a profile only for instances of its TP and take one profile
per TP degree (`simulate` times each role by its TP's, `plan` names each candidate's TP); a push
between TPs is priced by its rank pairs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from disagg.cluster.cli.app import app
from disagg.cluster.simulate import plan as planner
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.link import link_bytes_per_token
from disagg.cluster.simulate.profile import (SMALL_GRID, check_profile_tensor_parallel, instance_tensor_parallel,
                                             load_profile, run_profile)
from disagg.config import Config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROFILE = {  # a profile of the tiny model's shape, TP 1 (no tensor_parallel field: as older profiles)
    "kind": "disagg-profile", "version": 1, "model": "dummy:tiny", "dtype": "float32",
    "device": {"host": "test", "gpus": [], "torch_device": "cpu"},
    "engine": {"num_pages": 256, "page_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "max_model_len": 4096, "kv_bytes_per_token": 512, "vocab_size": 256, "eos_token_ids": [2]},
    "fit": {"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8], "error": 0.1}, "samples": [],
}
TP2 = dict(PROFILE, tensor_parallel=2, engine=dict(PROFILE["engine"], kv_bytes_per_token=256))
SLOW_STEPS = {"coef_s": [0.5, 2e-5, 1.8e-4, 5e-8], "error": 0.1}  # half a second a decode step
TINY_RUN = planner.RunLength(seconds=1.0, min_prompts=10, max_prompts=40)
SLOS = {"ttft": 300, "tpot": 20}


def write(tmp_path: Path, name: str, profile: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return path


def tiny_colocated(tp: int) -> Config:
    return Config.from_dict({"model": {"source": "dummy:tiny", "dtype": "float32"},
                             "cache": {"page_size": 16, "num_pages": 256},
                             "instances": {"colocated": 1, "device": "cpu", "tensor_parallel": tp},
                             "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256}})


def test_a_tp2_profile_times_two_rank_processes_and_records_the_tp(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references (as test_profile.py)
    one = run_profile(tiny_colocated(1), SMALL_GRID)
    assert one["tensor_parallel"] == 1 and one["tp_backend"] is None
    out = tmp_path / "tp2.json"
    result = CliRunner().invoke(app, ["profile", str(CONFIGS / "tiny-colocated.yaml"), "--small-grid", "--out",
                                      str(out), "--set", "instances.colocated=1",
                                      "--set", "instances.tensor_parallel=2"])
    assert result.exit_code == 0, result.output
    assert "at tensor_parallel 2 (gloo)" in result.output
    two = load_profile(out)
    assert two["tensor_parallel"] == 2 and two["tp_backend"] == "gloo"
    # Rank 0's replica: one of tiny's two KV heads, the pages the config gives every rank.
    assert two["engine"]["kv_bytes_per_token"] * 2 == one["engine"]["kv_bytes_per_token"]
    assert two["engine"]["num_pages"] == one["engine"]["num_pages"] == 256
    # The same grid ran, so the same step shapes were timed.
    assert [s[:4] + s[5:] for s in two["samples"]] == [s[:4] + s[5:] for s in one["samples"]]


def test_instance_tensor_parallel_is_the_roles_tp_and_refuses_two():
    assert instance_tensor_parallel(Config.from_yaml(CONFIGS / "tiny-tp2-1p1d.yaml")) == 2
    assert instance_tensor_parallel(Config.from_yaml(CONFIGS / "tiny-1p1d.yaml")) == 1
    tps = {"prefill": 1, "decode": 2, "colocated": 1}
    mixed = SimpleNamespace(instances=SimpleNamespace(prefill=1, decode=1, colocated=0,
                                                      tensor_parallel_of=tps.__getitem__))
    with pytest.raises(ValueError, match="prefill at TP 1, decode at TP 2: profile each TP apart"):
        instance_tensor_parallel(mixed)


def test_a_profile_of_another_tp_is_refused(tmp_path: Path):
    tp1, tp2 = write(tmp_path, "tp1.json", PROFILE), write(tmp_path, "tp2.json", TP2)
    check_profile_tensor_parallel(TP2, Config.from_yaml(CONFIGS / "tiny-tp2-1p1d.yaml"))
    check_profile_tensor_parallel(PROFILE, Config.from_yaml(CONFIGS / "tiny-1p1d.yaml"))
    for config, profile, got, want in (("tiny-tp2-1p1d.yaml", tp1, 1, 2), ("tiny-1p1d.yaml", tp2, 2, 1)):
        result = CliRunner().invoke(app, ["simulate", str(CONFIGS / config), "--profile", str(profile),
                                          "--num-prompts", "4", "--request-rate", "5"])
        assert result.exit_code == 2, result.output
        assert (f"the config's prefill instances run at tensor_parallel {want}, and no profile timed TP {want} "
                f"(profiles of TP {got})") in result.output
    with pytest.raises(ValueError, match="the profile timed an instance of tensor_parallel 1, the config's prefill "
                                         "instances run at tensor_parallel 2"):
        SimFleet(Config.from_yaml(CONFIGS / "tiny-tp2-1p1d.yaml"), PROFILE)
    bad = write(tmp_path, "bad.json", dict(PROFILE, tensor_parallel=0))
    with pytest.raises(ValueError, match="tensor_parallel 0, expected an integer >= 1"):
        load_profile(bad)


def mixed_tp_config(tmp_path: Path, prefill_tp: int, decode_tp: int) -> Path:
    config = Config.from_yaml(CONFIGS / "tiny-tp2-1p1d.yaml").model_dump(mode="json", exclude_unset=True)
    config["instances"]["tensor_parallel"] = {"prefill": prefill_tp, "decode": decode_tp}
    path = tmp_path / f"tiny-p{prefill_tp}-d{decode_tp}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# TP 1 computes prompts fast and decodes slowly (30 ms a step with a decode); TP 2 the other way
# round (0.5 s a step with prompt tokens). Coefficients: decode step, per prompt token, per decoding
# sequence, per context token, prompt step.
FAST_PREFILL = dict(PROFILE, fit={"coef_s": [0.03, 2e-5, 1.8e-4, 5e-8, 1.5e-3], "error": 0.1})
FAST_DECODE = dict(TP2, fit={"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8, 0.5], "error": 0.1})


def test_simulate_times_each_role_of_a_mixed_tp_fleet_by_its_tps_profile(tmp_path: Path):
    """Prefill at TP 1 and decode at TP 2 take the fast side of each profile (fast first tokens,
    fast decodes); the other way round both are slow. One profile for both roles would make one
    of the two fast in both fleets."""
    tp1, tp2 = write(tmp_path, "tp1.json", FAST_PREFILL), write(tmp_path, "tp2.json", FAST_DECODE)
    medians = {}
    for prefill_tp, decode_tp in ((1, 2), (2, 1)):
        out = tmp_path / f"out-{prefill_tp}{decode_tp}"
        result = CliRunner().invoke(app, ["simulate", str(mixed_tp_config(tmp_path, prefill_tp, decode_tp)),
                                          "--profile", str(tp2), "--profile", str(tp1), "--dataset-name", "random",
                                          "--random-input-len", "32", "--random-output-len", "8", "--num-prompts",
                                          "6", "--request-rate", "2", "--result-dir", str(out)])
        assert result.exit_code == 0, result.output
        stored = json.loads(next(out.glob("*.json")).read_text())
        assert stored["num_gpus"] == prefill_tp + decode_tp and len(stored["ttfts"]) == 6
        assert {role: r["tensor_parallel"] for role, r in stored["simulation"]["roles"].items()} == {
            "prefill": prefill_tp, "decode": decode_tp}
        medians[prefill_tp, decode_tp] = stored["median_ttft_ms"], stored["median_tpot_ms"]
    (fast_ttft, fast_tpot), (slow_ttft, slow_tpot) = medians[1, 2], medians[2, 1]
    assert fast_ttft < 50 and fast_tpot < 10, medians
    assert slow_ttft > 400 and slow_tpot > 25, medians


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
def test_a_mixed_tp_fleet_gives_the_narrower_side_proportionally_more_pages(tmp_path: Path, prefill_tp, decode_tp):
    """As a launch sizes a fleet: every PE holds the fleet's pages of the wider side (TP 1, 512 B
    a token), which a TP 2 rank (256 B) views as twice the pages; the page count a plan writes is
    the wider side's, the fewest its memory holds (TP 1's 256; TP 2's 300 half pages hold 150)."""
    config = Config.from_yaml(mixed_tp_config(tmp_path, prefill_tp, decode_tp))
    tp2 = dict(TP2, engine=dict(TP2["engine"], num_pages=300))
    by_tp = {1: PROFILE, 2: tp2}
    fleet = SimFleet(config, {"prefill": by_tp[prefill_tp], "decode": by_tp[decode_tp]})
    pages = {inst.role: inst.actor.cache.num_pages for inst in fleet.instances}
    assert fleet.num_pages == config.cache.num_pages
    wide, narrow = ("prefill", "decode") if prefill_tp == 1 else ("decode", "prefill")
    assert pages == {wide: config.cache.num_pages, narrow: 2 * config.cache.num_pages}
    candidate = next(c for c in planner.candidates(3, (256,), tensor_parallel=(1, 2)) if "prefill" in c.roles
                     and (c.tensor_parallel_of("prefill"), c.tensor_parallel_of("decode")) == (prefill_tp, decode_tp))
    base = planner.base_of(candidate, {1: PROFILE, 2: tp2}, SLOS)
    assert base["cache"]["num_pages"] == 150


def test_simulate_names_the_tp_no_profile_timed(tmp_path: Path):
    result = CliRunner().invoke(app, ["simulate", str(mixed_tp_config(tmp_path, 1, 2)), "--profile",
                                      str(write(tmp_path, "tp1.json", PROFILE)), "--num-prompts", "4",
                                      "--request-rate", "5"])
    assert result.exit_code == 2, result.output
    assert ("the config's decode instances run at tensor_parallel 2, and no profile timed TP 2 (profiles of TP 1): "
            "give one more --profile") in result.output


def test_a_push_is_priced_by_the_busiest_link_of_its_rank_pairs():
    """tiny's two KV heads, 256 B each per token: TP 1 holds 512 B, TP 2 256 B per rank."""
    assert link_bytes_per_token(512, 1, 512, 1) == 512  # rank to rank
    assert link_bytes_per_token(256, 2, 256, 2) == 256
    assert link_bytes_per_token(512, 1, 256, 2) == 512  # one sender writes both decode ranks
    assert link_bytes_per_token(256, 2, 512, 1) == 512  # two senders fill one decode rank: its ingress
    assert link_bytes_per_token(512, 1, 256, 4) == 1024  # each head on two decode ranks: written twice
    assert link_bytes_per_token(256, 4, 512, 1) == 512
    assert link_bytes_per_token(1024, 2, 512, 4, num_kv_heads=8) == 1024  # llama3-70b-like: no replica
    assert link_bytes_per_token(1024, 2, 256, 8, num_kv_heads=8) == 1024
    with pytest.raises(ValueError, match="expected shares > 0 bytes"):
        link_bytes_per_token(0, 1, 256, 2)
    # The fleet gives each prefill instance its pairs' price per decode PE; a link of 1 byte/s
    # then sends a forward of 3 tokens into TP 2 in 3 x 512 s.
    fleet = SimFleet(Config.from_dict(dict(MIXED, instances=dict(MIXED["instances"], prefill=2))),
                     {"prefill": PROFILE, "decode": TP2}, link_gbps=1e-9)
    prefill = fleet.of_role("prefill")[0].actor
    assert prefill.connector.sender.link_bytes == {2: 512.0}
    plan = SimpleNamespace(push_slots=np.array([4, 5, -1, 6]), push_pes=np.array([2, 2, -1, 2], dtype=np.int32),
                           copy_pes=np.array([], dtype=np.int32), send_seq_ids=np.array([], dtype=np.int64),
                           send_complete=np.array([], dtype=bool))
    num_tokens, done = prefill.connector.sender.push(plan, 0.0, 1.0)
    assert (num_tokens, done.at) == (3, pytest.approx(3 * 512))


MIXED = {"model": {"source": "dummy:tiny", "dtype": "float32"}, "cache": {"page_size": 16, "num_pages": 256},
         "instances": {"prefill": 1, "decode": 1, "device": "cpu", "tensor_parallel": {"prefill": 1, "decode": 2}},
         "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256}}


def test_a_tp2_profile_simulates_a_tp2_fleet(tmp_path: Path):
    result = CliRunner().invoke(app, ["simulate", str(CONFIGS / "tiny-tp2-1p1d.yaml"), "--profile",
                                      str(write(tmp_path, "tp2.json", TP2)), "--dataset-name", "chat",
                                      "--num-prompts", "6", "--request-rate", "5", "--goodput", "ttft:500",
                                      "tpot:50", "--result-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    stored = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert stored["num_gpus"] == 4 and stored["simulation"]["tensor_parallel"] == 2
    assert len(stored["ttfts"]) == 6


def test_candidates_name_the_tp_only_when_one_is_not_1():
    one = [c.label for c in planner.candidates(4, (256,), adaptive=False)]
    assert one == ["colocated-4[chunk=256]", "1P3D", "2P2D", "3P1D"]  # one profile of TP 1: as ever
    both = planner.candidates(4, (256,), tensor_parallel=[1, 2])
    assert [c.label for c in both if c.tensor_parallels == (2,)] == [
        "colocated-2(TP2)[chunk=256]", "1P(TP2)+1D(TP2)", "1P(TP2)+1D(TP2)-adaptive"]
    assert "2P(TP1)+2D(TP1)-adaptive" in [c.label for c in both]
    assert {c.num_gpus for c in both} == {4}
    assert all(c.sections["instances"].get("tensor_parallel") == 2 for c in both if c.tensor_parallels == (2,))
    assert [c.label for c in planner.candidates(3, (256,), adaptive=False, tensor_parallel=[2])] == [
        "colocated-1(TP2)[chunk=256]"]  # 3 // 2 instances: a split needs two


def test_plan_judges_each_candidate_with_its_tps_profile():
    search = planner.candidates(2, (256,), splits=False, adaptive=False, tensor_parallel=[1, 2])
    assert [c.label for c in search] == ["colocated-2(TP1)[chunk=256]", "colocated-1(TP2)[chunk=256]"]

    def goodputs(tp1: dict, tp2: dict) -> dict[str, float]:
        ranked = planner.plan([tp2, tp1], dataset_name="random", slos_ms=SLOS, num_gpus=2,
                              search=planner.candidates(2, (256,), splits=False, adaptive=False,
                                                        tensor_parallel=[1, 2]),
                              run_length=TINY_RUN, input_len=32, output_len=8)
        return {c.label: c.goodput_rps for c in ranked}

    slow_tp2 = goodputs(PROFILE, dict(TP2, fit=SLOW_STEPS))
    assert slow_tp2["colocated-2(TP1)[chunk=256]"] > 0 == slow_tp2["colocated-1(TP2)[chunk=256]"]
    slow_tp1 = goodputs(dict(PROFILE, fit=SLOW_STEPS), TP2)
    assert slow_tp1["colocated-1(TP2)[chunk=256]"] > 0 == slow_tp1["colocated-2(TP1)[chunk=256]"]
    with pytest.raises(ValueError, match=r"no profile of the TP of colocated-1\(TP2\)"):
        planner.plan(PROFILE, dataset_name="random", slos_ms=SLOS, num_gpus=2, search=search[1:],
                     run_length=TINY_RUN)


def test_plan_takes_a_profile_per_tp_and_writes_the_best_ones_tp(tmp_path: Path):
    tp1, tp2 = write(tmp_path, "tp1.json", dict(PROFILE, fit=SLOW_STEPS)), write(tmp_path, "tp2.json", TP2)
    out = tmp_path / "best.yaml"
    args = ["plan", "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
            "--goodput", "ttft:300", "tpot:20", "--gpus", "2", "--chunk-sizes", "256", "--run-seconds", "1",
            "--max-prompts", "40"]
    result = CliRunner().invoke(app, [*args, "--profile", str(tp1), "--profile", str(tp2), "--only",
                                      "colocated-2(TP1)[chunk=256],colocated-1(TP2)[chunk=256]", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "best: colocated-1(TP2)[chunk=256]" in result.output
    best = Config.from_yaml(out)
    assert best.instances.tensor_parallel_of("colocated") == 2 and best.instances.num_gpus == 2
    for profiles, message in (([tp2, tp2], "one profile per tensor_parallel degree, got two of TP 2"),
                              ([tp1, write(tmp_path, "other.json", dict(TP2, model="dummy:llama3-8b"))],
                               "expected profiles of one model")):
        result = CliRunner().invoke(app, [*args, *[a for p in profiles for a in ("--profile", str(p))]])
        assert result.exit_code == 2 and message in result.output, result.output
