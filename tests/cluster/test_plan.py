"""`disagg plan`: the search finds the known best split, and writes a YAML that launches it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from plan_profiles import PROFILE, SLOS, TINY_RUN, write_profile
from typer.testing import CliRunner

from disagg.cluster.cli.app import app
from disagg.cluster.simulate import plan as planner
from disagg.config import Config

SHORT = planner.RunLength(seconds=3.0, min_prompts=40, max_prompts=150)
# 3 s of arrivals up to 600 requests: at the splits' knees (200-850 req/s) a run's requests do not
# all arrive within the TTFT SLO (the search's ceiling, `plan`), so the runs load the fleet.
LOADED = planner.RunLength(seconds=3.0, min_prompts=40, max_prompts=600)
TINY_RUN_ARGS = ["--run-seconds", "1", "--max-prompts", "40"]  # `TINY_RUN` as `disagg plan` flags


def test_max_rate_brackets_and_bisects():
    assert planner.max_rate(lambda r: 1.0 if r <= 37.0 else 0.0, 4.0) == pytest.approx(37.0, rel=0.1)
    assert planner.max_rate(lambda r: 1.0 if r <= 0.3 else 0.0, 4.0) == pytest.approx(0.3, rel=0.1)
    assert planner.max_rate(lambda r: 0.0, 4.0) == 0.0


def _drive(search, attainment):
    """Run a `rate_search` generator to its end; its answer and the batches it asked for."""
    batches, rates = [], next(search)
    while True:
        batches.append(rates)
        try:
            rates = search.send([attainment(r) for r in rates])
        except StopIteration as done:
            return done.value, batches


@pytest.mark.parametrize("width", [2, 3, 7, 15, 16])
def test_a_wider_rate_search_finds_the_one_at_a_time_rate_whatever_the_attainments(width):
    """Batches judge the rates a one-at-a-time search would visit among others, and walk its path:
    the same rate for any attainment, monotone or not (noisy knees, a rate that holds past one that
    misses), in fewer rounds."""
    import random
    rng = random.Random(width)
    for trial in range(300):
        knee, noise, start = rng.uniform(0.01, 500), rng.random() * 0.3, rng.choice([0.5, 1.0, 4.0, 64.0])
        ceiling = rng.choice([math.inf, start * rng.uniform(0.5, 6.0)])  # some within `CEILING_FIRST`
        table: dict[float, float] = {}

        def attainment(rate: float) -> float:  # the same answer for a rate however often asked
            if rate not in table:
                table[rate] = min(1.0, max(0.0, (0.95 if rate <= knee else 0.8) + rng.uniform(-noise, noise)))
            return table[rate]

        probe = trial % 2 == 1  # probed searches too: the one-at-a-time one's rate, whatever the attainments
        one, one_batches = _drive(planner.rate_search(start, 1, ceiling=ceiling, probe=probe), attainment)
        wide, wide_batches = _drive(planner.rate_search(start, width, ceiling=ceiling, probe=probe), attainment)
        assert wide == one == planner.max_rate(attainment, start, ceiling=ceiling, probe=probe), (
            trial, knee, noise, start)
        assert all(len(b) <= width for b in wide_batches)
        assert {r for b in one_batches for r in b} <= {r for b in wide_batches for r in b}
        assert len(wide_batches) <= len(one_batches)
        # >= 2 bisection levels a round (a hold at the ceiling, judged first, is one round either way)
        assert width < 3 or len(wide_batches) < len(one_batches) or one_batches == wide_batches == [[one]]
    with pytest.raises(ValueError, match="width"):
        next(planner.rate_search(1.0, 0))


def test_a_probed_search_finds_the_unprobed_rate_where_attainment_falls_with_the_rate():
    """``probe``: for any knee and any attainment that falls with the rate (steps and slopes), the
    rate of the search without it; from a start within 0.875-1.125x of the knee 4 or 5 runs
    instead of 7, else at most one run more; the probe is the rate the bisection computes."""
    import random
    rng = random.Random(3)
    for trial in range(400):
        start = rng.choice([1.0, 3.0, 64.0, 300.0])
        knee = start * rng.choice([rng.uniform(0.9, 1.1), rng.uniform(0.01, 40.0)])
        ceiling = rng.choice([math.inf, start * rng.uniform(0.5, 6.0)])
        slope = rng.choice([0.0, rng.uniform(0.01, 2.0)])  # 0: a step at the knee

        def attainment(rate: float) -> float:  # non-increasing in the rate, the target at the knee
            return 1.0 if rate <= knee else max(0.0, 0.9 - 1e-9 - slope * (rate / knee - 1))

        runs = {}
        for probe in (False, True):
            asked = []
            found = planner.max_rate(lambda r: asked.append(r) or attainment(r), start, ceiling=ceiling, probe=probe)
            runs[probe] = (found, asked)
        (plain, plain_asked), (probed, probed_asked) = runs[False], runs[True]
        assert probed == plain, (trial, start, knee, ceiling)
        assert len(probed_asked) <= len(plain_asked) + 1, (trial, plain_asked, probed_asked)
        if 0.875 * start < knee < 1.125 * start and ceiling == math.inf:
            assert len(probed_asked) in (4, 5) and len(plain_asked) == 7, (trial, plain_asked, probed_asked)
    # The probe is the bisection's own midpoint: a held start's search reaches it, bit for bit.
    asked = []
    planner.max_rate(lambda r: asked.append(r) or (1.0 if r <= 1.01 * 300.0 else 0.0), 300.0)
    assert planner.max_rate(lambda r: 1.0 if r <= 1.01 * 300.0 else 0.0, 300.0, probe=True) == max(
        r for r in asked if r <= 1.01 * 300.0)
    assert 300.0 * 1.125 in asked


def test_a_start_near_the_ceiling_judges_the_ceiling_first():
    """Two doublings below the ceiling: the doubling past it is judged first, and a hold there
    is the rate the doubling from the start finds (one run instead of three); a miss there is
    kept, not judged again, and the search goes on from the start to the same rate."""
    def judged(attainment, start: float, ceiling: float) -> tuple[float, list[float]]:
        asked: list[float] = []
        rate = planner.max_rate(lambda r: asked.append(r) or attainment(r), start, ceiling=ceiling)
        return rate, asked

    assert judged(lambda r: 1.0, 10.0, 35.0) == (40.0, [40.0])
    assert judged(lambda r: 1.0, 10.0, 20.0) == (20.0, [20.0])
    assert judged(lambda r: 1.0, 10.0, 50.0) == (80.0, [10.0, 20.0, 40.0, 80.0])  # three doublings: as ever
    rate, asked = judged(lambda r: 1.0 if r <= 30.0 else 0.0, 10.0, 35.0)
    assert asked[:3] == [40.0, 10.0, 20.0] and asked.count(40.0) == 1 and 28.0 < rate <= 30.0
    with_ceiling_last = planner.max_rate(lambda r: 1.0 if r <= 30.0 else 0.0, 10.0)
    assert rate == with_ceiling_last


@pytest.mark.parametrize("lengths, best, worst", [
    (dict(input_len=200, output_len=6), "3P1D", "1P3D"),   # prompts dominate: prefill instances
    # answers dominate: decode instances (the same search the other way round: out of `make test`)
    pytest.param(dict(input_len=8, output_len=64), "1P3D", "3P1D", marks=pytest.mark.slow),
])
def test_plan_finds_the_known_best_split(lengths, best, worst):
    search = [c for c in planner.candidates(4, adaptive=False, colocated=False)]
    ranked = planner.plan(PROFILE, dataset_name="random", slos_ms=SLOS, num_gpus=4,
                          search=search, run_length=LOADED, **lengths)
    assert [c.label for c in search] == ["1P3D", "2P2D", "3P1D"]
    assert ranked[0].label == best and ranked[-1].label == worst
    assert ranked[0].goodput_per_gpu > 1.2 * ranked[-1].goodput_per_gpu


def test_tiny_chunks_lose_to_the_budget():
    search = planner.candidates(2, chunk_sizes=(16, 256), splits=False, adaptive=False)
    ranked = planner.plan(PROFILE, dataset_name="random", slos_ms=SLOS, num_gpus=2,
                          search=search, run_length=SHORT, input_len=200, output_len=8)
    assert [c.label for c in ranked] == ["colocated-2[chunk=256]", "colocated-2[chunk=16]"]


def test_cli_prints_every_candidate_and_writes_a_loadable_yaml(tmp_path: Path):
    profile = write_profile(tmp_path, PROFILE)
    out = tmp_path / "best.yaml"
    result = CliRunner().invoke(app, ["plan", "--profile", str(profile), "--dataset-name", "random",
                                      "--random-input-len", "64", "--random-output-len", "16", "--goodput",
                                      "ttft:300", "tpot:20", "--gpus", "2", "--chunk-sizes", "256",
                                      *TINY_RUN_ARGS, "--out", str(out), "--adaptive-prefer", "fastest,balanced"])
    assert result.exit_code == 0, result.output
    for label in ("colocated-2[chunk=256]", "1P1D", "1P1D-adaptive[prefer=fastest]", "1P1D-adaptive[prefer=balanced]"):
        assert label in result.output
    config = Config.from_yaml(out)
    assert config.instances.num_gpus == 2 and config.model.source == "dummy:tiny"
    assert config.bench.goodput == {"ttft": 300.0, "tpot": 20.0}


def test_hops_are_given_to_every_simulated_fleet_and_named_in_the_yaml(tmp_path: Path):
    """A hop longer than the TTFT target leaves no rate within it: the judged fleets ran with it."""
    def goodput(**hops):
        (cand,) = [c for c in planner.candidates(2, adaptive=False, colocated=False)]
        base = planner.base_sections(PROFILE, SLOS)
        return planner.judge(cand, base, PROFILE, dataset_name="random", slos_ms=SLOS,
                             run_length=TINY_RUN, input_len=64, output_len=8, hops=hops).goodput_rps

    assert goodput() > 0 and goodput(hop_ms=400.0) < goodput()
    assert goodput(reserve_ms=400.0) < goodput()  # 1P1D: every request is pushed, every one reserves
    with pytest.raises(ValueError, match="--step-gap-ms"):
        planner.plan(PROFILE, dataset_name="random", slos_ms=SLOS, num_gpus=2,
                     hops={"step_gap_ms": -1.0}, search=[])
    profile = write_profile(tmp_path, PROFILE)
    result = CliRunner().invoke(app, ["plan", "--profile", str(profile), "--dataset-name", "random",
                                      "--random-input-len", "64", "--random-output-len", "16", "--goodput",
                                      "ttft:300", "tpot:20", "--gpus", "1", "--chunk-sizes", "256",
                                      *TINY_RUN_ARGS, "--hop-ms", "6", "--reserve-ms", "8"])
    assert result.exit_code == 0, result.output
    assert "--hop-ms 6, --reserve-ms 8." in result.output


def _small_plan(tmp_path: Path) -> list[str]:
    """`disagg plan` on two GPUs of PROFILE, short random prompts, 3-s runs (add the options)."""
    profile = write_profile(tmp_path, PROFILE)
    return ["plan", "--profile", str(profile), "--dataset-name", "random", "--random-input-len", "64",
            "--random-output-len", "16", "--goodput", "ttft:300", "tpot:20", "--gpus", "2", "--chunk-sizes", "256",
            "--run-seconds", "3"]


def test_only_judges_the_named_candidates_and_names_the_valid_ones_otherwise(tmp_path: Path):
    search = planner.candidates(4, chunk_sizes=(512,))
    assert [c.label for c in planner.only(search, ["3P1D-adaptive", "colocated-4[chunk=512]"])] == [
        "colocated-4[chunk=512]", "3P1D-adaptive"]
    with pytest.raises(ValueError, match=r"--only: expected labels of this search \(colocated-4\[chunk=512\], "
                                         r"1P3D, .*got 5P3D"):
        planner.only(search, ["1P3D", "5P3D"])
    with pytest.raises(ValueError, match="got none"):
        planner.only(search, [])
    large = planner.candidates(64, chunk_sizes=(8192,), tensor_parallel=(1, 2))  # too many to list
    with pytest.raises(ValueError, match=r"\(\d+ in all; closest: colocated-64\(TP1\)\[chunk=8192\], .*\), "
                                         r"got colocated-64\(TP1\)$") as refused:
        planner.only(large, ["colocated-64(TP1)"])
    assert len(str(refused.value)) < 600 and len(large) > 40
    common = _small_plan(tmp_path) + ["--max-prompts", "40"]
    result = CliRunner().invoke(app, common + ["--only", "1P1D"])
    assert result.exit_code == 0, result.output
    assert "1P1D: " in result.output and "colocated-2" not in result.output and "1P1D-adaptive" not in result.output
    result = CliRunner().invoke(app, common + ["--only", "1P1D,2P0D"])
    assert result.exit_code == 2 and "--only" in result.output and "2P0D" in result.output


def test_runs_send_the_same_seconds_of_arrivals_at_any_fleet_size_and_a_cut_run_is_named(tmp_path: Path):
    """Capped at a fixed 3000 requests, a 64-GPU fleet's runs lasted 2-3 s of arrivals, judged
    before its seats filled (decode-heavy: 344 req/s per GPU against 13 on 8 GPUs)."""
    assert planner.RunLength.for_gpus(8).max_prompts == 3000 and planner.RunLength.for_gpus(2).max_prompts == 3000
    run = planner.RunLength.for_gpus(64)
    assert run.max_prompts == 64 * planner.PROMPTS_PER_GPU and run.seconds_at(12.5 * 64) == pytest.approx(30.0, rel=0.01)
    assert planner.RunLength.for_gpus(64, max_prompts=3000).seconds_at(800.0) == pytest.approx(3.75)
    common = _small_plan(tmp_path) + ["--only", "1P1D"]
    result = CliRunner().invoke(app, common + ["--max-prompts", "12"])
    assert result.exit_code == 0, result.output
    assert "s of arrivals: --max-prompts)" in result.output, result.output
    assert "judged on fewer than 3 s of arrivals (--max-prompts 12), optimistic: 1P1D" in result.output
    result = CliRunner().invoke(app, common)
    assert result.exit_code == 0 and "of arrivals" not in result.output, result.output


def test_cli_needs_slos(tmp_path: Path):
    profile = write_profile(tmp_path, PROFILE)
    result = CliRunner().invoke(app, ["plan", "--profile", str(profile), "--gpus", "2"])
    assert result.exit_code == 2 and "--goodput" in result.output
    for bad in ("fastest,local", "fastest,fastest", ","):
        result = CliRunner().invoke(app, ["plan", "--profile", str(profile), "--gpus", "2", "--goodput", "ttft:300",
                                          "tpot:20", "--adaptive-prefer", bad])
        assert result.exit_code == 2 and "--adaptive-prefer" in result.output and "balanced" in result.output, bad


def test_search_space_every_split_up_to_8_gpus_then_ratios():
    labels = [c.label for c in planner.candidates(4, chunk_sizes=(512,))]
    assert labels == ["colocated-4[chunk=512]", "1P3D", "1P3D-adaptive", "2P2D", "2P2D-adaptive", "3P1D",
                      "3P1D-adaptive"]
    # The adaptive fleet gets the colocated side's chunk sizes (best against best), or its own.
    both = planner.candidates(2, chunk_sizes=(512, 8192), splits=False, colocated=False)
    assert [(c.label, c.sections["scheduler"]["max_num_batched_tokens"]) for c in both] == [
        ("1P1D-adaptive[chunk=512]", 512), ("1P1D-adaptive[chunk=8192]", 8192)]
    own = planner.candidates(2, chunk_sizes=(512, 8192), splits=False, colocated=False, adaptive_chunk_sizes=(2048,))
    assert [c.label for c in own] == ["1P1D-adaptive"] and own[0].sections["scheduler"]["max_num_batched_tokens"] == 2048
    # Several adaptive preferences: one candidate each, the preference in its label and YAML.
    prefers = planner.candidates(2, chunk_sizes=(512,), splits=False, colocated=False,
                                 adaptive_prefers=("fastest", "balanced"))
    assert [(c.label, c.sections["router"].get("adaptive_prefer")) for c in prefers] == [
        ("1P1D-adaptive[prefer=fastest]", "fastest"), ("1P1D-adaptive[prefer=balanced]", None)]
    assert planner.prefill_counts(8) == list(range(1, 8))
    assert planner.prefill_counts(64) == [8, 11, 16, 21, 32, 43, 48, 53, 56]
    with pytest.raises(ValueError, match="at least 1 GPU"):
        planner.candidates(0)


def test_seeds_pool_the_requests_of_several_draws():
    """``seeds=2``: a rate's attainment is over both draws' requests (equal counts: the mean)."""
    base = planner.base_sections(PROFILE, SLOS)
    judged = {}
    for seed, seeds in ((0, 1), (1, 1), (0, 2)):
        (cand,) = [c for c in planner.candidates(2, adaptive=False, colocated=False)]
        judged[seed, seeds] = planner.judge(cand, base, PROFILE, dataset_name="random", slos_ms=SLOS,
                                            run_length=SHORT, seed=seed, seeds=seeds, input_len=200, output_len=8,
                                            stop_early=False)
    rates = set(judged[0, 1].attainment_at) & set(judged[1, 1].attainment_at) & set(judged[0, 2].attainment_at)
    apart = [r for r in rates if judged[0, 1].attainment_at[r] != judged[1, 1].attainment_at[r]]
    assert apart, "the two draws never differ: the test could not tell pooling from one draw"
    for rate in rates:
        assert judged[0, 2].attainment_at[rate] == pytest.approx(
            (judged[0, 1].attainment_at[rate] + judged[1, 1].attainment_at[rate]) / 2)
    with pytest.raises(ValueError, match="--seeds"):
        planner.plan(PROFILE, dataset_name="random", slos_ms=SLOS, num_gpus=2, seeds=0)


# 1: a single draw's cut, which two pooled draws (the stop across draws too) cover: out of `make test`
@pytest.mark.parametrize("seeds", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_runs_stop_at_a_certain_miss_with_the_same_verdicts(seeds):
    """``stop_early`` (the default): the same goodput and, rate by rate, the same verdict as runs
    played to the end; a cut rate's attainment is a bound below the whole run's on the same side
    of the target, and the search cuts rates on both sides of the knee (a certain miss, a certain
    hold)."""
    base = planner.base_sections(PROFILE, SLOS)
    judged = {}
    for stop_early in (False, True):
        (cand,) = [c for c in planner.candidates(2, adaptive=False, colocated=False)]
        judged[stop_early] = planner.judge(cand, base, PROFILE, dataset_name="random", slos_ms=SLOS,
                                           run_length=SHORT, seeds=seeds, input_len=200, output_len=8,
                                           stop_early=stop_early)
    full, cut = judged[False], judged[True]
    assert cut.goodput_rps == full.goodput_rps > 0
    assert cut.attainment_at.keys() == full.attainment_at.keys()
    target = planner.TARGET_ATTAINMENT
    assert {r: a >= target for r, a in cut.attainment_at.items()} == {r: a >= target for r, a in full.attainment_at.items()}
    assert not full.cut_at
    assert any(full.attainment_at[r] < target for r in cut.cut_at)
    assert any(full.attainment_at[r] >= target for r in cut.cut_at)
    for rate, attained in cut.attainment_at.items():
        assert attained == full.attainment_at[rate] if rate not in cut.cut_at else attained <= full.attainment_at[rate]
    assert [planner.misses_allowed(n) for n in (1, 9, 10, 11, 100, 101)] == [0, 0, 1, 1, 10, 10]


def test_a_start_rate_near_the_knee_skips_the_low_rates_with_the_same_goodput(tmp_path: Path):
    """--start-rate: the bracket the search doubles to from 1 req/s per GPU is found from a start
    inside it without the rates below; the same goodput. A start of 0 is refused."""
    kwargs = dict(dataset_name="random", slos_ms=SLOS, num_gpus=2, run_length=SHORT,
                  input_len=200, output_len=8)
    search = lambda: planner.candidates(2, splits=False, adaptive=False, chunk_sizes=(256,))  # noqa: E731
    (whole,) = planner.plan(PROFILE, search=search(), **kwargs)
    rates = sorted(whole.attainment_at)
    held = [r for r in rates if whole.attainment_at[r] >= planner.TARGET_ATTAINMENT]
    doubled = [r for r in rates if r / 2 in rates or r == 2.0]  # 2, 4, 8, ...: the doubling
    start = max(r for r in doubled if r in held)  # the bracket's low end
    (started,) = planner.plan(PROFILE, search=search(), start_rate_per_gpu=start / 2, **kwargs)
    assert started.goodput_rps == whole.goodput_rps > 0
    assert min(started.attainment_at) == start and len(started.attainment_at) < len(whole.attainment_at)
    profile = write_profile(tmp_path, PROFILE)
    result = CliRunner().invoke(app, ["plan", "--profile", str(profile), "--dataset-name", "random", "--goodput",
                                      "ttft:300", "tpot:20", "--gpus", "2", "--start-rate", "0"])
    assert result.exit_code == 2 and "--start-rate" in result.output


def test_more_jobs_than_candidates_judge_rates_at_once_with_the_same_goodput():
    """--jobs beyond the candidates: each candidate's rates in batches across the workers; the same
    goodput as one process, every rate that one judged judged alike, and each candidate heard once."""
    kwargs = dict(dataset_name="random", slos_ms=SLOS, num_gpus=2, run_length=SHORT,
                  input_len=200, output_len=8)
    search = lambda: planner.candidates(2, chunk_sizes=(256,), splits=False, adaptive=False) + \
        [c for c in planner.candidates(2, adaptive=False, colocated=False)]  # noqa: E731
    alone = planner.plan(PROFILE, search=search(), **kwargs)
    seen = []
    wide = planner.plan(PROFILE, search=search(), jobs=6, on_judged=lambda c: seen.append(c.label), **kwargs)
    assert [(c.label, c.goodput_rps) for c in wide] == [(c.label, c.goodput_rps) for c in alone]
    assert all(c.goodput_rps > 0 for c in wide) and sorted(seen) == sorted(c.label for c in alone)
    for w, a in zip(wide, alone):
        assert a.attainment_at.items() <= w.attainment_at.items()  # the same runs, more of them
        assert a.cut_at <= w.cut_at


def test_jobs_judge_in_worker_processes_with_the_same_result():
    search = lambda: planner.candidates(2, chunk_sizes=(16, 256), splits=False, adaptive=False)  # noqa: E731
    kwargs = dict(dataset_name="random", slos_ms=SLOS, num_gpus=2, run_length=SHORT,
                  input_len=200, output_len=8)
    seen = []
    alone = planner.plan(PROFILE, search=search(), **kwargs)
    workers = planner.plan(PROFILE, search=search(), jobs=2, on_judged=lambda c: seen.append(c.label), **kwargs)
    assert [(c.label, c.goodput_rps, c.attainment_at) for c in workers] == \
        [(c.label, c.goodput_rps, c.attainment_at) for c in alone]
    assert sorted(seen) == sorted(c.label for c in alone)
    with pytest.raises(ValueError, match="--jobs"):
        planner.plan(PROFILE, jobs=0, **kwargs)


# The samples of `disagg profile --small-grid` on the tiny instance (version 1 layout: prompt
# tokens, decoding sequences, context tokens, seconds, scenario): chunks of 16 and 32 tokens, a
# side prompt of 8, batches of 1 and 2.
SMALL_GRID_SAMPLES = [[16, 0, 0, 0.05, "prefill"], [16, 0, 16, 0.05, "prefill"], [32, 0, 0, 0.09, "prefill"],
                      [16, 0, 0, 0.05, "mixed"], [0, 1, 16, 0.04, "decode"], [8, 1, 17, 0.05, "mixed"],
                      [16, 1, 17, 0.06, "mixed"], [0, 2, 34, 0.04, "decode"], [8, 2, 36, 0.05, "mixed"]]


def test_candidates_outside_the_profiled_steps_are_named_with_the_values_and_the_ranges():
    """Chunks of 8192 tokens judged from a profile that timed 16- and 32-token chunks are the
    fit's extrapolation; a chunk within a tenth of the largest step timed is not."""
    profile = dict(PROFILE, samples=SMALL_GRID_SAMPLES)
    assert planner.sampled_ranges(profile) == {"prompt_tokens": (8, 32), "decode_seqs": (1, 2)}
    base = planner.base_sections(profile, SLOS)
    search = planner.candidates(2, chunk_sizes=(32, 8192), adaptive=False)
    notes = planner.extrapolations(profile, base, search)
    batches = "batches up to 16 sequences (the profile timed 1-2)"
    assert notes == {"colocated-2[chunk=32]": [batches],
                     "colocated-2[chunk=8192]": ["chunk 8192 prompt tokens (the profile timed 8-32)", batches],
                     "1P1D": ["chunk 256 prompt tokens (the profile timed 8-32)", batches]}  # the profile's budget
    lines = planner.extrapolation_lines(notes, len(search))
    assert lines[1:] == ["  chunk 256 prompt tokens (the profile timed 8-32): 1P1D",
                         "  chunk 8192 prompt tokens (the profile timed 8-32): colocated-2[chunk=8192]",
                         f"  {batches}: every candidate"]
    covered = dict(PROFILE, samples=[[2, 0, 0, 0.01, "prefill"], [8190, 0, 0, 0.2, "prefill"],
                                     [0, 16, 4096, 0.03, "decode"]])
    assert planner.extrapolations(covered, base, search) == {}
    assert planner.extrapolations(PROFILE, base, search) == {}  # no samples: no range to judge by


def test_plan_says_where_it_extrapolated_and_writes_the_fleet_it_simulated(tmp_path: Path):
    """`disagg plan` on a --small-grid profile recommended chunk 8192 without a word, and its YAML
    left cache.num_pages out: the launched fleet sized its pages from memory (32768 per instance
    on a GPU), not the profile's 256 that were simulated."""
    profile = write_profile(tmp_path, dict(PROFILE, samples=SMALL_GRID_SAMPLES))
    out = tmp_path / "best.yaml"
    result = CliRunner().invoke(app, ["plan", "--profile", str(profile), "--dataset-name", "random",
                                      "--random-input-len", "64", "--random-output-len", "16", "--goodput",
                                      "ttft:300", "tpot:20", "--gpus", "1", "--chunk-sizes", "8192",
                                      *TINY_RUN_ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    config = Config.from_yaml(out)
    assert config.cache.num_pages == PROFILE["engine"]["num_pages"] == 256
    assert config.model.max_model_len == PROFILE["engine"]["max_model_len"]
    assert planner.SimFleet(config, PROFILE).num_pages == 256  # what the plan simulated: the same pages
    assert "\n  chunk 8192 prompt tokens (the profile timed 8-32): colocated-1[chunk=8192]\n" in result.output
    assert "\n  batches up to 16 sequences (the profile timed 1-2): colocated-1[chunk=8192]\n" in result.output
    assert ("# extrapolated beyond the profile's samples: chunk 8192 prompt tokens (the profile timed 8-32); "
            "batches up to 16 sequences (the profile timed 1-2).\n") in out.read_text()


def test_the_written_yaml_carries_what_the_profiled_instance_ran():
    """KV dtype, CUDA graphs and a dummy's layer count of the profiled instance: the YAML's fleet
    is the one whose step times were simulated."""
    profile = dict(PROFILE, kv_dtype="torch.float8_e4m3fn", device={"torch_device": "cuda:0"},
                   engine=dict(PROFILE["engine"], cuda_graphs="full_decode_only", num_layers=2))
    base = planner.base_sections(profile, SLOS)
    config = Config.from_dict(planner.config_of(base, planner.candidates(2, adaptive=False, colocated=False)[0]))
    assert (config.cache.kv_dtype, config.scheduler.cuda_graphs, config.model.num_layers) == (
        "fp8_e4m3", "full_decode_only", 2)
    assert config.cache.num_pages == 256 and config.instances.device == "cuda"
