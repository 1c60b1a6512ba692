"""`disagg profile --derive` and `--num-layers`: a profile of an instance not timed, its arithmetic
term by term, what it says was measured and derived, what it refuses, and `disagg plan` reading it."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.cli.app import app
from disagg.cluster.simulate import derive
from disagg.cluster.simulate.profile import load_profile, refit_profile, summary_lines
from disagg.cluster.simulate.step_model import FEATURES
from disagg.model.presets import preset_config

COEF = (4e-3, 6e-6, 2e-4, 3e-8, 9e-3, 2e-9, 6e-3, 5e-8, 2e-5)
# The tiny preset (2 layers, hidden 64, MLP 128, 4 q heads and 2 KV heads of 16, vocabulary 256) in
# float32, timed at TP 1 on a GPU whose pages it sized from memory.
BASE = {
    "kind": "disagg-profile", "version": 2, "model": "dummy:tiny", "dtype": "float32",
    "kv_dtype": "torch.float32", "tensor_parallel": 1, "date": "20260101-000000", "commit": "abc",
    "device": {"gpus": ["GPU-X"], "torch_device": "cuda:0"}, "wall_s": 1.0,
    "engine": {"num_pages": 1000, "page_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "max_model_len": 4096, "kv_bytes_per_token": 512, "vocab_size": 256, "eos_token_ids": [2],
               "num_layers": None, "kv_pages_from": "gpu_memory"},
    "fit": {"coef_s": list(COEF), "knee_tokens": 1024, "error": 0.05}, "samples": [[16, 0, 0, 136, 0.01, "prefill"]],
    "errors": {"prefill": {"num_samples": 1, "rms_rel_error": 0.05, "num_outliers": 0,
                           "rms_rel_error_without_outliers": 0.05}},
}
# Tiny's per-layer weights by hand: q, k, v, o = 64 x (64 + 16 + 16 + 64) ... at TP 1: 64 x 192
# attention + 3 x 64 x 128 MLP = 36864 matmul weights, + 128 of norms; the LM head 256 x 64.
MATMUL_1, MATMUL_2, NORMS, HEAD = 36864, 18432, 128, 256 * 64
NO_COLLECTIVES = derive.Collectives(0.0, None, "none")


def coefficient(profile: dict, name: str) -> float:
    return profile["fit"]["coef_s"][FEATURES.index(name)]


def test_tp2_divides_each_term_by_its_work_per_rank():
    tp2 = derive.derive_profile(BASE, tensor_parallel=2, collectives=NO_COLLECTIVES)
    streamed = ((2 * (MATMUL_2 + NORMS) + HEAD / 2) / (2 * (MATMUL_1 + NORMS) + HEAD))
    expected = {"decode_step": streamed, "prompt_step": streamed, "prompt_tokens": 0.5, "prompt_tokens_over_knee": 0.5,
                "decode_seqs": (2 * MATMUL_2 + HEAD / 2) / (2 * MATMUL_1 + HEAD), "context_tokens": 0.5,
                "eager_context_tokens": 0.5, "prompt_pairs": 0.5, "mixed_step": 1.0}
    for name, ratio in expected.items():
        assert coefficient(tp2, name) == pytest.approx(COEF[FEATURES.index(name)] * ratio, rel=1e-12), name
    assert tp2["tensor_parallel"] == 2 and tp2["engine"]["kv_bytes_per_token"] == 256  # one KV head of two


def test_collectives_add_two_all_reduces_per_layer_and_the_embedding_and_logits():
    nvlink = derive.Collectives(derive.NvlinkModel.latency_s, derive.NvlinkModel.bus_gbps, "model")
    plain = derive.derive_profile(BASE, tensor_parallel=2, collectives=NO_COLLECTIVES)
    tp2 = derive.derive_profile(BASE, tensor_parallel=2, collectives=nvlink)
    added = {n: coefficient(tp2, n) - coefficient(plain, n) for n in FEATURES}
    per_token = 5 * 1.0 * 64 * 4 / 300e9  # 2 x 2 layers + 1, the ring's 2 (k-1)/k = 1, 64 floats of 4 bytes
    assert added["decode_step"] == pytest.approx(6 * 15e-6) and added["prompt_step"] == pytest.approx(6 * 15e-6)
    assert added["prompt_tokens"] == pytest.approx(per_token)
    assert added["decode_seqs"] == pytest.approx(per_token + 128 * 4 / 300e9)  # the other rank's logits
    assert all(added[n] == 0 for n in FEATURES if n not in ("decode_step", "prompt_step", "prompt_tokens",
                                                            "decode_seqs"))
    assert "collectives: 5 all-reduces" in " ".join(tp2["derived"]["derived"])


def test_collectives_measured_by_a_tp2_profile_are_its_cost_over_the_base_halves():
    truth = derive.Collectives(20e-6, 250.0, "truth")
    measured = dict(derive.derive_profile(BASE, tensor_parallel=2, collectives=truth), derived=None)
    got = derive.allreduce_from_profile(measured, BASE, derive.base_model_config(BASE), "tp2.json")
    assert got.latency_s == pytest.approx(20e-6) and got.bus_gbps == pytest.approx(250.0)
    tp4 = derive.derive_profile(BASE, tensor_parallel=4, collectives=got, base_path="base.json")
    assert any(line.startswith("collectives:") and "measured: tp2.json" in line for line in tp4["derived"]["measured"])
    with pytest.raises(ValueError, match="--allreduce-from: expected a profile of tensor_parallel > 1"):
        derive.allreduce_from_profile(BASE, BASE, derive.base_model_config(BASE), "tp1.json")
    with pytest.raises(ValueError, match="of the base's model 'dummy:tiny', got tp2.json of 'dummy:llama3-8b'"):
        derive.allreduce_from_profile(dict(measured, model="dummy:llama3-8b"), BASE, derive.base_model_config(BASE),
                                      "tp2.json")


def test_weights_per_rank_are_the_checkpoints_parameter_counts():
    """The published parameter counts: Llama-3-8B 8,030,261,248; Llama-3-70B 70,553,706,496;
    Qwen2.5-32B 32,763,876,352 (bf16: two bytes each)."""
    for name, params in (("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
                         ("qwen2.5-32b", 32_763_876_352)):
        assert derive.rank_work(preset_config(name), 1, "bfloat16", "bfloat16", 8192).weight_bytes == 2 * params, name
    tp8, tp16 = (derive.rank_work(preset_config("llama3-70b"), k, "bfloat16", "bfloat16", 8192) for k in (8, 16))
    assert tp16.kv_bytes_per_token == tp8.kv_bytes_per_token == 2 * 80 * 128 * 2  # one of 8 KV heads: replicated


def test_pages_take_the_memory_the_weights_free_or_keep_a_configured_budget():
    base_work = derive.rank_work(preset_config("tiny"), 1, "float32", "float32", 256)
    tp2 = derive.derive_profile(BASE, tensor_parallel=2, collectives=NO_COLLECTIVES)
    work = derive.rank_work(preset_config("tiny"), 2, "float32", "float32", 256)
    held = 1000 * 16 * 512 + base_work.weight_bytes + base_work.activation_bytes
    assert tp2["engine"]["num_pages"] == int((held - work.weight_bytes - work.activation_bytes) // (16 * 256))
    pinned = dict(BASE, engine=dict(BASE["engine"], kv_pages_from="num_pages"))
    assert derive.derive_profile(pinned, tensor_parallel=2, collectives=NO_COLLECTIVES)["engine"]["num_pages"] == 1000
    budget = dict(BASE, engine=dict(BASE["engine"], kv_pages_from="kv_bytes"))
    assert derive.derive_profile(budget, tensor_parallel=2, collectives=NO_COLLECTIVES)["engine"]["num_pages"] == 2000
    old = dict(BASE, engine={k: v for k, v in BASE["engine"].items() if k != "kv_pages_from"})
    assert "assumed" in derive.derive_profile(old, tensor_parallel=2)["derived"]["memory"]["how"]


def test_a_larger_model_derived_from_a_measured_one_says_what_is_which():
    h200 = dict(BASE, model="dummy:llama3-8b", dtype="bfloat16", kv_dtype="torch.bfloat16",
                engine=dict(BASE["engine"], num_pages=48436, max_num_batched_tokens=8192, max_model_len=8192,
                            kv_bytes_per_token=131072, vocab_size=128256))
    with pytest.raises(ValueError, match="does not fit the base's GPU"):  # 141 GB of weights
        derive.derive_profile(h200, tensor_parallel=1, model="dummy:llama3-70b")
    tp2 = derive.derive_profile(h200, tensor_parallel=2, model="dummy:llama3-70b", base_path="h200.json")
    record = tp2["derived"]
    assert (tp2["model"], tp2["num_layers"], tp2["engine"]["kv_bytes_per_token"]) == ("dummy:llama3-70b", 80, 163840)
    assert record["from"]["profile"] == "h200.json" and record["from"]["model"] == "dummy:llama3-8b"
    assert "step times" in record["measured"][0] and "NVLink model" in " ".join(record["derived"])
    lines = summary_lines(tp2)
    assert lines[0].startswith("dummy:llama3-70b (bfloat16) at tensor_parallel 2: derived from dummy:llama3-8b")
    assert any(line.startswith("  measured: step times") for line in lines)
    assert any(line.startswith("  derived:  num_pages") for line in lines)
    with pytest.raises(ValueError, match="its samples are the base's steps"):
        refit_profile(tp2)


@pytest.mark.parametrize("call, match", [
    (dict(tensor_parallel=3), "tensor_parallel=3 must divide num_qo_heads=4"),
    (dict(tensor_parallel=2, model="dummy:gpt9"), "unknown preset 'gpt9'"),
    (dict(tensor_parallel=2, model="no/such/dir"), "expected dummy:<preset>"),
    (dict(tensor_parallel=1), "expected --tensor-parallel > 1 or another --model"),
], ids=["k-not-dividing-heads", "unknown-preset", "unknown-model", "nothing-to-derive"])
def test_refusals_name_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        derive.derive_profile(BASE, **call)


def test_refuses_a_tp_base_and_a_profile_of_another_model_than_it_names():
    with pytest.raises(ValueError, match="expected a profile of tensor_parallel 1 as the base"):
        derive.derive_profile(dict(BASE, tensor_parallel=2, engine=dict(BASE["engine"], kv_bytes_per_token=256)),
                              tensor_parallel=4)
    with pytest.raises(ValueError, match="expected 512 KV bytes per token per rank, the profile has 999"):
        derive.derive_profile(dict(BASE, engine=dict(BASE["engine"], kv_bytes_per_token=999)), tensor_parallel=2)


def test_first_layers_timed_scale_to_the_whole_model():
    timed = dict(BASE, engine=dict(BASE["engine"], num_layers=1, kv_bytes_per_token=256))
    whole = derive.scale_layers(timed, 1)
    layer = MATMUL_1 + NORMS
    expected = {"decode_step": (2 * layer + HEAD) / (layer + HEAD), "prompt_tokens": 2.0, "mixed_step": 2.0,
                "decode_seqs": (2 * MATMUL_1 + HEAD) / (MATMUL_1 + HEAD), "context_tokens": 2.0, "prompt_pairs": 2.0}
    for name, ratio in expected.items():
        assert coefficient(whole, name) == pytest.approx(COEF[FEATURES.index(name)] * ratio, rel=1e-12), name
    assert (whole["num_layers_timed"], whole["num_layers"], whole["engine"]["num_layers"]) == (1, 2, None)
    assert whole["engine"]["kv_bytes_per_token"] == 512 and whole["tensor_parallel"] == 1
    assert "timed 1 of 2 layers, scaled" in summary_lines(whole)[0]
    assert derive.yaml_comment([whole, BASE]).endswith(": dummy:tiny at TP 1, timed 1 of 2 layers, scaled\n")


def test_profile_num_layers_times_that_many_and_writes_the_scaled_profile(tmp_path: Path, monkeypatch):
    seen = {}

    def fake_profile_instance(config, grid):
        seen["num_layers"] = config.model.num_layers
        return dict(BASE, engine=dict(BASE["engine"], num_layers=config.model.num_layers, kv_bytes_per_token=256))

    monkeypatch.setattr("disagg.cluster.simulate.profile_ranks.profile_instance", fake_profile_instance)
    configs = Path(__file__).resolve().parents[2] / "configs"
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["profile", str(configs / "tiny-colocated.yaml"), "--num-layers", "1",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert seen["num_layers"] == 1 and "timed 1 of 2 layers, scaled" in result.output
    assert load_profile(out)["num_layers_timed"] == 1
    result = CliRunner().invoke(app, ["profile", str(configs / "tiny-colocated.yaml"), "--num-layers", "3"])
    assert result.exit_code == 2 and "at most the 2 layers of dummy:tiny, got 3" in result.output


def test_cli_derive_then_plan_and_simulate_read_the_derived_profiles(tmp_path: Path):
    base = dict(BASE, device={"torch_device": "cpu", "gpus": []}, engine=dict(BASE["engine"], num_pages=256,
                                                                               kv_pages_from="num_pages"))
    base_path, tp2_path = tmp_path / "tp1.json", tmp_path / "tp2.json"
    base_path.write_text(json.dumps(base))
    result = CliRunner().invoke(app, ["profile", "--derive", str(base_path), "--tensor-parallel", "2", "--out",
                                      str(tp2_path)])
    assert result.exit_code == 0, result.output
    assert "derived from dummy:tiny at TP 1" in result.output and "NVLink model" in result.output
    assert load_profile(tp2_path)["derived"]["from"]["profile"] == str(base_path)
    bad = CliRunner().invoke(app, ["profile", "--derive", str(base_path), "--tensor-parallel", "3"])
    assert bad.exit_code == 2 and "must divide num_qo_heads" in bad.output
    result = CliRunner().invoke(app, ["plan", "--profile", str(base_path), "--profile", str(tp2_path),
                                      "--dataset-name", "random", "--random-input-len", "64", "--random-output-len",
                                      "16", "--goodput", "ttft:300", "tpot:20", "--gpus", "2", "--chunk-sizes", "256",
                                      "--run-seconds", "1", "--max-prompts", "40", "--max-simulated", "1", "--jobs",
                                      "1"])
    assert result.exit_code == 0, result.output
    assert "derived profiles (a prediction from these" in result.output
    assert "  dummy:tiny at TP 2: derived (dummy:tiny at TP 2 from dummy:tiny at TP 1)" in result.output
    assert ("# derived step times, not measured (a prediction until a run measures it): dummy:tiny at TP 2 from "
            "dummy:tiny at TP 1\n") in result.output
    configs = Path(__file__).resolve().parents[2] / "configs"
    result = CliRunner().invoke(app, ["simulate", str(configs / "tiny-colocated.yaml"), "--profile", str(tp2_path),
                                      "--set", "instances.tensor_parallel=2", "--num-prompts", "5", "--request-rate",
                                      "10", "--random-input-len", "32", "--random-output-len", "4", "--result-dir",
                                      str(tmp_path / "sim")])
    assert result.exit_code == 0, result.output
    assert "  dummy:tiny at TP 2: derived (dummy:tiny at TP 2 from dummy:tiny at TP 1)" in result.output


def test_the_cli_defaults_are_the_nvlink_model():
    from disagg.cluster.simulate.command import profile_command

    defaults = {name: p.default for name, p in inspect.signature(profile_command).parameters.items()}
    assert defaults["allreduce_gbps"] == derive.NvlinkModel.bus_gbps
    assert defaults["allreduce_latency_us"] == pytest.approx(derive.NvlinkModel.latency_s * 1e6)


def test_a_model_scaled_past_its_gpu_is_a_base_for_a_tp_that_fits(tmp_path: Path):
    """8 of llama3-70b's 80 layers fit an H200; the whole model at TP 1 does not: the scaled profile
    gets no pages (not simulated), and a TP 2 derived from it has the memory the GPU held."""
    kv_8 = 2 * 8 * 8 * 128 * 2
    timed = dict(BASE, model="dummy:llama3-70b", dtype="bfloat16", kv_dtype="torch.bfloat16",
                 engine=dict(BASE["engine"], num_pages=180000, max_num_batched_tokens=8192, max_model_len=8192,
                             kv_bytes_per_token=kv_8, vocab_size=128256, num_layers=8))
    whole = derive.scale_layers(timed, 8)
    assert whole["engine"]["num_pages"] == 0 and whole["num_layers"] == 80
    path = tmp_path / "whole.json"
    path.write_text(json.dumps(whole))
    with pytest.raises(ValueError, match="holds no pages"):
        load_profile(path)
    tp2 = derive.derive_profile(load_profile(path, base_only=True), tensor_parallel=2)
    config = preset_config("llama3-70b")
    cut = derive.rank_work(derive.base_model_config(timed), 1, "bfloat16", "bfloat16", 8192)
    work = derive.rank_work(config, 2, "bfloat16", "bfloat16", 8192)
    held = 180000 * 16 * kv_8 + cut.weight_bytes + cut.activation_bytes
    assert tp2["engine"]["num_pages"] == int((held - work.weight_bytes - work.activation_bytes) // (16 * 163840))
    assert "timed 8 of 80 layers, scaled" in tp2["derived"]["base_derived"]["how"]
