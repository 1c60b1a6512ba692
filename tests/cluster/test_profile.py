"""`disagg profile`: the step-time fit recovers known coefficients; the tiny instance's profile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from disagg.cluster.cli import app
from disagg.cluster.placement import StepTimeModel
from disagg.cluster.profile import load_profile

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRUE_COEF = (4e-3, 6e-5, 2e-4, 3e-8, 9e-3)  # decode-step intercept ... prompt-step intercept


def synthetic_samples(coef, n: int = 300, noise: float = 0.0, seed: int = 0) -> list[tuple]:
    """Steps over a profile-like grid whose seconds follow ``coef`` (times 1 +- noise)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        kind = rng.integers(3)
        prompt = 0 if kind == 1 else int(rng.integers(16, 8192))
        seqs = 0 if kind == 0 else int(rng.integers(1, 256))
        context = seqs * int(rng.integers(16, 4096))
        seconds = (coef[4] if prompt else coef[0]) + coef[1] * prompt + coef[2] * seqs + coef[3] * context
        samples.append((prompt, seqs, context, seconds * (1 + noise * rng.standard_normal())))
    return samples


def test_fit_recovers_known_coefficients():
    model = StepTimeModel.from_samples(synthetic_samples(TRUE_COEF))
    np.testing.assert_allclose(model.coef, TRUE_COEF, rtol=0.02)
    assert model.error < 0.01
    assert all(e["rms_rel_error"] < 0.01 for e in model.errors_by_region(synthetic_samples(TRUE_COEF, 30)).values())


def test_fit_under_noise_stays_close_and_reports_the_error():
    model = StepTimeModel.from_samples(synthetic_samples(TRUE_COEF, n=600, noise=0.05))
    np.testing.assert_allclose(model.coef, TRUE_COEF, rtol=0.15)
    assert 0.02 < model.error < 0.1


def test_model_round_trips_through_its_dict():
    model = StepTimeModel.from_samples(synthetic_samples(TRUE_COEF))
    again = StepTimeModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.step_s(512, 8, 4096) == pytest.approx(model.step_s(512, 8, 4096))
    with pytest.raises(ValueError, match="4 or 5 finite coefficients"):
        StepTimeModel.from_dict({"coef_s": [1.0, -1.0, 0.0, 0.0]})


@pytest.mark.slow  # ~6 s: ten engine steps of the tiny model under TRITON_INTERPRET
def test_profile_of_the_tiny_instance(tmp_path: Path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["profile", str(CONFIGS / "tiny-colocated.yaml"), "--small-grid",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "relative RMS error" in result.output
    profile = load_profile(out)
    assert profile["model"] == "dummy:tiny" and profile["dtype"] == "float32"
    assert profile["engine"]["num_pages"] == 256 and profile["engine"]["kv_bytes_per_token"] > 0
    scenarios = {s[4] for s in profile["samples"]}
    assert scenarios == {"prefill", "decode", "mixed"}
    shapes = {(s[0] > 0, s[1] > 0) for s in profile["samples"]}
    assert shapes == {(True, False), (False, True), (True, True)}  # prefill, decode and mixed steps
    assert set(profile["errors"]) == {"prefill", "decode", "mixed"}
    assert all(c >= 0 for c in profile["fit"]["coef_s"]) and "commit" in profile


def test_not_a_profile_is_refused(tmp_path: Path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError, match="expected a profile written by `disagg profile`"):
        load_profile(bad)
