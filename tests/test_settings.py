"""disagg.settings: the kernel switches as one typed object. The config's `kernels:` section
reaches the model its actors build; DISAGG_* variables override it, read once when the model is
built (or when a fleet is launched), never during a forward; bad values are refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagg.config import Config
from disagg.errors import ConfigError
from disagg.settings import ENV_VARS, Settings, active, allowed_values, current

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny-colocated.yaml"
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the switches choose Triton kernels: needs TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def no_switches_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without DISAGG_* switches."""
    for variable in ENV_VARS.values():
        monkeypatch.delenv(variable, raising=False)


def with_kernels(tmp_path: Path, section: str) -> Path:
    path = tmp_path / "kernels.yaml"
    path.write_text(TINY.read_text() + "kernels:\n" + section)
    return path


def test_each_switch_is_listed_once_with_its_variable_values_and_meaning():
    """The defaults are what the code did before the switches had a home (all "auto" or on)."""
    assert Settings().model_dump() == {"linear": "auto", "blas": "auto", "layer_pdl": "auto",
                                       "rope_append": True, "fused_layers": True, "prefill_attention": "auto"}
    assert ENV_VARS == {name: f"DISAGG_{name.upper()}" for name in Settings.model_fields}
    for name, field in Settings.model_fields.items():
        assert len(field.description) > 40, name
        assert field.default in allowed_values(name)
    assert allowed_values("linear") == ("auto", "cublas", "triton")
    assert allowed_values("layer_pdl") == ("auto", True, False)


def test_environment_overrides_the_base_in_its_own_spelling():
    base = Settings(linear="cublas", rope_append=False)
    env = {"DISAGG_LINEAR": "triton", "DISAGG_LAYER_PDL": "1", "DISAGG_FUSED_LAYERS": "0", "OTHER": "x"}
    got = Settings.from_env(base, env)
    assert got == Settings(linear="triton", layer_pdl=True, fused_layers=False, rope_append=False)
    assert Settings.from_env(base, {}) is base
    assert Settings.from_env(None, {"DISAGG_LAYER_PDL": "0", "DISAGG_ROPE_APPEND": "1"}) == \
        Settings(layer_pdl=False, rope_append=True)


@pytest.mark.parametrize("variable, value, allowed", [
    ("DISAGG_LINEAR", "cuda", "auto, cublas, triton"),
    ("DISAGG_BLAS", "rocblas", "auto, cublaslt, cublas"),
    ("DISAGG_LAYER_PDL", "yes", "auto, 1, 0"),
    ("DISAGG_ROPE_APPEND", "true", "1, 0"),
    ("DISAGG_FUSED_LAYERS", "", "1, 0"),
])
def test_a_bad_variable_is_refused_naming_it_the_values_and_the_switch(variable, value, allowed):
    name = next(n for n, v in ENV_VARS.items() if v == variable)
    with pytest.raises(ConfigError, match=rf"^{variable}: expected one of {allowed} \(the kernels\.{name} "
                                          rf"switch\), got {value!r}$"):
        Settings.from_env(None, {variable: value})


def test_yaml_section_reaches_the_model_an_actor_builds(tmp_path: Path):
    """`disagg.cluster.launch.engines.load` (what every instance actor runs) builds the model with the
    config's section as given, dummy presets cut to fewer layers included; the section survives
    the dict the actors receive."""
    from disagg.cluster.launch.engines import load

    config = Config.from_yaml(with_kernels(tmp_path, "  linear: cublas\n  layer_pdl: true\n"
                                                     "  rope_append: false\n"))
    assert config.kernels == Settings(linear="cublas", layer_pdl=True, rope_append=False)
    assert Config.model_validate(config.model_dump()).kernels == config.kernels  # what an actor gets
    assert load(config, "cpu").settings == config.kernels
    assert load(config.override({"model.num_layers": 1}), "cpu").settings == config.kernels
    assert Config.from_yaml(TINY).kernels == Settings()  # no section: the defaults


@pytest.mark.parametrize("section, expected", [
    ("  linear: cuda\n", r"kernels\.linear: Input should be 'auto', 'cublas' or 'triton' \(got 'cuda'\)"),
    ("  layer_pdl: 1\n", r"kernels\.layer_pdl: expected 'auto', true or false, got 1"),
    ("  rope_append: '0'\n", r"kernels\.rope_append: .*boolean \(got '0'\)"),
    ("  linar: triton\n", r"kernels\.linar: unknown key; did you mean 'linear'\?"),
])
def test_yaml_section_refuses_bad_values_by_field(tmp_path: Path, section: str, expected: str):
    with pytest.raises(ConfigError, match=expected):
        Config.from_yaml(with_kernels(tmp_path, section))


def test_launcher_folds_the_environment_into_the_config_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`Config.with_environment` (called by the fleet's launcher): the variables set now override
    the file's section, and the result travels in the config, so actors elsewhere need none."""
    config = Config.from_yaml(with_kernels(tmp_path, "  linear: cublas\n  blas: cublas\n"))
    assert config.with_environment() is config
    monkeypatch.setenv("DISAGG_LINEAR", "triton")
    monkeypatch.setenv("DISAGG_ROPE_APPEND", "0")
    folded = config.with_environment()
    monkeypatch.setenv("DISAGG_LINEAR", "auto")  # read once: later changes do not reach `folded`
    assert folded.kernels == Settings(linear="triton", blas="cublas", rope_append=False)
    assert folded.path == config.path and config.kernels.linear == "cublas"
    assert Config.model_validate(folded.model_dump()).kernels == folded.kernels
    monkeypatch.setenv("DISAGG_BLAS", "mkl")
    with pytest.raises(ConfigError, match="DISAGG_BLAS: expected one of auto, cublaslt, cublas"):
        config.with_environment()


def test_current_is_the_active_forward_s_else_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DISAGG_LINEAR", "triton")
    assert current().linear == "triton"  # no forward on this thread: read at the call
    inner = Settings(linear="cublas")
    with active(Settings()):
        with active(inner):
            assert current() is inner
        assert current().linear == "auto"
    assert current().linear == "triton"


@needs_interpreter
def test_model_reads_the_environment_once_when_built(monkeypatch: pytest.MonkeyPatch):
    """A model built under DISAGG_LINEAR=triton keeps running every projection through the
    skinny kernel after the variable changes, and even when it holds a bad value (before, the
    forward read it per call and raised); a model built now refuses the bad value by name."""
    import torch

    from disagg.engine import ColocatedEngine
    from disagg.kernels import linear as skinny
    from disagg.model import load_model
    from disagg.sampling import SamplingParams

    monkeypatch.setenv("DISAGG_LINEAR", "triton")
    model = load_model("dummy:tiny", device="cpu", dtype=torch.float32)
    assert model.settings.linear == "triton"
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for value in ("cublas", "not-a-backend"):
        monkeypatch.setenv("DISAGG_LINEAR", value)
        calls.clear()
        engine = ColocatedEngine(model, num_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
        engine.add(value, [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_work():
            engine.step()
        assert len(calls) == 2 * (4 * model.config.num_layers + 1), value  # prefill + one decode
    with pytest.raises(ConfigError, match="DISAGG_LINEAR: expected one of auto, cublas, triton"):
        load_model("dummy:tiny", device="cpu")
