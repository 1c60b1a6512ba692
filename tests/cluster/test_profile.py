"""`disagg profile`: the step-time fit recovers known coefficients; the tiny instance's profile."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from disagg.cluster.cli.app import app
from disagg.cluster.simulate.profile import PROFILE_VERSION, load_profile, replayed_prompt_pairs
from disagg.cluster.simulate.step_model import StepTimeModel, _nonnegative_ridge, features
from disagg.engine.steps import prompt_pairs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "records"
# As `FEATURES`: decode-step intercept, per prompt token, per decoding sequence, per context token,
# prompt-step intercept, per attention pair, mixed-step intercept, per context token in eager
# steps, per prompt token beyond the knee (1024 tokens).
TRUE_COEF = (4e-3, 6e-6, 2e-4, 3e-8, 9e-3, 2e-9, 6e-3, 5e-8, 2e-5)


def synthetic_samples(coef, n: int = 300, noise: float = 0.0, seed: int = 0, knee: int = 1024) -> list[tuple]:
    """Steps over a profile-like grid (prompt chunks over a prefix, beside decodes or not) whose
    seconds follow ``coef`` (times 1 +- noise)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        kind = rng.integers(3)
        prompt = 0 if kind == 1 else int(rng.integers(16, 8192))
        pairs = prompt_pairs(int(rng.integers(0, 8192)) if prompt else 0, prompt)
        seqs = 0 if kind == 0 else int(rng.integers(1, 256))
        context = seqs * int(rng.integers(16, 4096))
        seconds = float(features(prompt, seqs, context, pairs, knee) @ np.asarray(coef))
        samples.append((prompt, seqs, context, pairs, seconds * (1 + noise * rng.standard_normal())))
    return samples


def test_fit_recovers_known_coefficients():
    model = StepTimeModel.from_samples(synthetic_samples(TRUE_COEF))
    np.testing.assert_allclose(model.coef, TRUE_COEF, rtol=0.02)
    assert model.error < 0.01 and model.num_outliers == 0 and model.knee_tokens == 1024
    assert all(e["rms_rel_error"] < 0.01 for e in model.errors_by_region(synthetic_samples(TRUE_COEF, 30)).values())
    elsewhere = StepTimeModel.from_samples(synthetic_samples(TRUE_COEF, knee=4096))
    assert elsewhere.knee_tokens == 4096 and elsewhere.error < 0.01


def test_fit_under_noise_stays_close_and_reports_the_error():
    model = StepTimeModel.from_samples(synthetic_samples(TRUE_COEF, n=600, noise=0.05))
    np.testing.assert_allclose(model.coef, TRUE_COEF, rtol=0.15)
    assert 0.02 < model.error < 0.1


@pytest.mark.parametrize("factor", [10.0, 0.1], ids=["one-off-slow", "impossibly-short"])
def test_fit_leaves_out_outlying_steps_and_counts_them(factor):
    # Ten times its time: a first use of a shape. A tenth: a served step timed under async
    # scheduling, which the GPU ran while the host was busy between two engine.step() calls, so
    # the call timed only its tail (cluster/simulate/step_model.py `_inliers`); weighted by 1 / seconds,
    # three such steps would pull the whole fit towards them.
    samples = synthetic_samples(TRUE_COEF)
    for i in (3, 50, 77):
        samples[i] = samples[i][:4] + (factor * samples[i][4],)
    model = StepTimeModel.from_samples(samples)
    np.testing.assert_allclose(model.coef, TRUE_COEF, rtol=0.02)
    assert model.num_outliers == 3 and model.error < 0.01
    errors = model.errors_by_region(samples)
    assert sum(e["num_outliers"] for e in errors.values()) == 3
    assert all(e["rms_rel_error_without_outliers"] < 0.01 for e in errors.values())


def test_step_s_is_the_features_times_the_coefficients():
    model = StepTimeModel(prior=TRUE_COEF)
    for shape in [(0, 8, 4000, 0), (512, 0, 0, 300_000), (100, 16, 9000, 5050), (1, 1, 1, 1), (3000, 2, 9, 5e6)]:
        assert model.step_s(*shape) == pytest.approx(float(features(*shape) @ model.coef), rel=1e-12)


def test_model_round_trips_through_its_dict():
    model = StepTimeModel.from_samples(synthetic_samples(TRUE_COEF))
    again = StepTimeModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.step_s(512, 8, 4096, 200_000) == pytest.approx(model.step_s(512, 8, 4096, 200_000))
    assert again.step_s(3000, 8, 4096, 5e6) == pytest.approx(model.step_s(3000, 8, 4096, 5e6))
    with pytest.raises(ValueError, match="expected 9 finite coefficients"):
        StepTimeModel.from_dict({"coef_s": [1.0, -1.0, 0.0, 0.0]})
    with pytest.raises(ValueError, match="expected 9 finite coefficients"):
        StepTimeModel.from_dict({"coef_s": [1.0] * 8})


def test_an_older_fit_loads_and_predicts_what_it_did():
    """A version 1 profile's 5 coefficients (or 4: one intercept) keep their predictions: the new
    terms are 0 there."""
    old = (6.7e-3, 2.1e-5, 8.3e-6, 4.7e-8, 1.5e-2)
    model = StepTimeModel.from_dict({"coef_s": list(old)})
    for prompt, seqs, context in [(0, 8, 4000), (512, 0, 0), (100, 16, 9000)]:
        expected = (old[4] if prompt else old[0]) + old[1] * prompt + old[2] * seqs + old[3] * context
        assert model.step_s(prompt, seqs, context, prompt_pairs(0, prompt)) == pytest.approx(expected)
    assert StepTimeModel.from_dict({"coef_s": list(old[:4])}).step_s(10, 0, 0, 55) == pytest.approx(
        old[0] + 10 * old[1])


def test_refit_of_a_committed_version_1_profile_derives_its_pairs_and_fits_better(tmp_path: Path):
    """The H100 profile in benchmarks/records/simulator-2026-11-27 (version 1: no pairs in its
    samples) refits on the CPU: the replayed grid gives every prompt step its pairs, and prompt
    and mixed steps fit closer."""
    path = RECORDS / "simulator-2026-11-27" / "profile-h100.json"
    out = tmp_path / "refit.json"
    result = CliRunner().invoke(app, ["profile", "--refit", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    old, new = json.loads(path.read_text()), load_profile(out)
    assert new["version"] == PROFILE_VERSION and new["refit"]["fit"] == old["fit"]
    assert [s[:3] + s[4:] for s in new["samples"]] == old["samples"]
    assert new["samples"][:4] == [[128, 0, 0, prompt_pairs(128 * k, 128), old["samples"][k][3], "prefill"]
                                  for k in range(4)]  # one 512-token prompt in chunks of 128
    for region in ("prefill", "mixed"):
        assert new["errors"][region]["rms_rel_error"] < 0.9 * old["errors"][region]["rms_rel_error"]
    assert new["errors"]["decode"]["rms_rel_error"] < 1.05 * old["errors"]["decode"]["rms_rel_error"]


def test_profile_wants_a_config_or_a_refit():
    result = CliRunner().invoke(app, ["profile"])
    assert result.exit_code == 2 and "expected CONFIG" in result.output


def test_profile_of_the_tiny_instance(tmp_path: Path, monkeypatch):
    # The kernels' torch references: what is checked is the profile's content, not the kernels
    # (the Triton interpreter took ~6 s; the kernels are tested under it on their own).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["profile", str(CONFIGS / "tiny-colocated.yaml"), "--small-grid",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "relative RMS error" in result.output
    profile = load_profile(out)
    assert profile["model"] == "dummy:tiny" and profile["dtype"] == "float32"
    assert profile["engine"]["num_pages"] == 256 and profile["engine"]["kv_bytes_per_token"] > 0
    # What `disagg plan` writes into its YAML besides the sizes: the instance's graphs and layers.
    assert profile["engine"]["cuda_graphs"] == "full" and profile["engine"]["num_layers"] is None
    scenarios = {s[5] for s in profile["samples"]}
    assert scenarios == {"prefill", "decode", "mixed"}
    shapes = {(s[0] > 0, s[1] > 0) for s in profile["samples"]}
    assert shapes == {(True, False), (False, True), (True, True)}  # prefill, decode and mixed steps
    assert set(profile["errors"]) == {"prefill", "decode", "mixed"}
    assert all(c >= 0 for c in profile["fit"]["coef_s"]) and "commit" in profile
    # A version 1 profile had no pairs: replaying its grid gives back the ones the engine reported.
    v1 = dict(profile, version=1, samples=[s[:3] + s[4:] for s in profile["samples"]])
    assert replayed_prompt_pairs(v1) == [s[3] for s in profile["samples"]]
    assert any(s[3] > prompt_pairs(0, s[0]) for s in profile["samples"])  # chunks over a prefix
    assert any(s[:2] == [8, 2] for s in profile["samples"])  # the side prompt beside two decodes


def test_not_a_profile_is_refused(tmp_path: Path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError, match="expected a profile written by `disagg profile`"):
        load_profile(bad)


def test_the_non_negative_fit_is_the_best_over_every_set_of_zeroed_coefficients():
    """The active-set solver against brute force: every subset of coefficients held at 0."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        x, y, lam = rng.normal(size=(30, 5)), rng.normal(size=30), np.full(5, 0.1)

        def cost(c):
            return float(np.sum((x @ c - y) ** 2) + np.sum(lam * c ** 2))

        best = np.inf
        for k in range(6):
            for kept in map(list, itertools.combinations(range(5), k)):
                c = np.zeros(5)
                if kept:
                    c[kept] = np.linalg.solve(x[:, kept].T @ x[:, kept] + np.diag(lam[kept]), x[:, kept].T @ y)
                if (c >= 0).all():
                    best = min(best, cost(c))
        found = _nonnegative_ridge(x, y, lam, np.zeros(5))
        assert (found >= 0).all() and cost(found) <= best * (1 + 1e-9)


def test_refit_with_served_steps_moves_the_fit_to_what_was_served(tmp_path: Path, monkeypatch):
    """--served-steps: the step records of a trace join the profile's samples. Served steps that
    ran 1.5x the profile's own steps pull the fit up; --instance keeps one instance's steps; a
    record without num_prompt_pairs (older traces) gets one chunk per prompt from position 0."""
    from disagg import trace

    path = RECORDS / "simulator-2026-11-27b" / "profile-h100-v2.json"
    base = StepTimeModel.from_dict(json.loads(path.read_text())["fit"])
    trace_dir = tmp_path / "trace"
    monkeypatch.setenv(trace.ENV, str(trace_dir))
    rng = np.random.default_rng(0)
    for i in range(3000):
        prompt = int(rng.integers(1, 2048)) if i % 5 == 0 else 0
        seqs, context = int(rng.integers(1, 128)), int(rng.integers(100, 200_000))
        pairs = prompt_pairs(0, prompt)
        seconds = 1.5 * base.step_s(prompt, seqs, context, pairs)
        fields = {} if i == 0 else {"num_prompt_pairs": pairs}
        trace.record("step", instance="decode-0" if i % 2 else "prefill-0", t_start=100.0, t_end=100.0 + seconds,
                     num_prefill_tokens=prompt, num_decode_seqs=seqs, num_context_tokens=context,
                     num_prompts=1 if prompt else 0, **fields)
    out = tmp_path / "served.json"
    result = CliRunner().invoke(app, ["profile", "--refit", str(path), "--served-steps", str(trace_dir),
                                      "--instance", "decode-0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    new = load_profile(out)
    served = [s for s in new["samples"] if s[5] == "served"]
    assert len(served) == 1500 and new["refit"]["served_steps"] == 1500
    fitted = StepTimeModel.from_dict(new["fit"])
    for prompt, seqs, context in ((0, 64, 64 * 2000), (512, 32, 32 * 1000)):
        ratio = fitted.step_s(prompt, seqs, context, prompt_pairs(0, prompt)) / base.step_s(prompt, seqs, context,
                                                                                           prompt_pairs(0, prompt))
        assert 1.2 < ratio < 1.6, (prompt, seqs, ratio)
    bad = CliRunner().invoke(app, ["profile", str(CONFIGS / "tiny-colocated.yaml"), "--served-steps", str(trace_dir)])
    assert bad.exit_code == 2 and "--refit" in bad.output
    for where, words in ((tmp_path / "none", "expected a DISAGG_TRACE_DIR"), (tmp_path, "no step records")):
        refused = CliRunner().invoke(app, ["profile", "--refit", str(path), "--served-steps", str(where),
                                           "--out", str(out)])
        assert refused.exit_code == 2 and words in refused.output
