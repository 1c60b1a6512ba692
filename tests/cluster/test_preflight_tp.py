"""The preflight's tensor-parallel check: a model that does not shard over a role's
instances.tensor_parallel is refused with the numbers, before Ray starts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from disagg.cluster.launch.preflight import check_model_source, check_tensor_parallel
from disagg.config import Config
from disagg.errors import PreflightError
from disagg.model.presets import preset_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_TP2 = CONFIGS / "tiny-tp2-1p1d.yaml"


def at(ranks: int) -> Config:
    """tiny-tp2-1p1d.yaml at ``ranks`` per instance."""
    return Config.from_yaml(TINY_TP2).override({"instances.tensor_parallel": ranks})


def shaped(qo: int, kv: int, mlp: int):
    """The tiny preset with ``qo`` query heads, ``kv`` KV heads and an MLP ``mlp`` wide."""
    return replace(preset_config("tiny"), num_qo_heads=qo, num_kv_heads=kv, intermediate_size=mlp)


@pytest.mark.parametrize("qo, kv, mlp, ranks", [
    (4, 2, 128, 1), (4, 2, 128, 2), (4, 2, 128, 4),  # 4: two ranks share each KV head
    (9, 3, 1536, 1), (9, 3, 1536, 3),                 # SmolLM2's shapes
    (32, 8, 14336, 8), (32, 8, 14336, 16),            # llama3-8b: 16 replicates each KV head twice
    (12, 3, 120, 6),                                  # 6 is a multiple of 3 KV heads
])
def test_shapes_that_shard_pass(qo: int, kv: int, mlp: int, ranks: int):
    check_tensor_parallel(at(ranks), shaped(qo, kv, mlp))


@pytest.mark.parametrize("qo, kv, mlp, ranks, problems, fits", [
    (9, 3, 1536, 2, ["its 9 query heads (num_qo_heads) do not divide by 2",
                     "its 3 KV heads (num_kv_heads) do not divide by 2, nor is 2 a multiple of 3"], "1, 3"),
    (4, 2, 129, 2, ["its MLP width (intermediate_size 129) does not divide by 2"], "1"),
    (12, 3, 120, 4, ["its 3 KV heads (num_kv_heads) do not divide by 4, nor is 4 a multiple of 3"], "1, 3, 6, 12"),
    (4, 2, 128, 8, ["its 4 query heads (num_qo_heads) do not divide by 8"], "1, 2, 4"),
])
def test_shapes_that_do_not_shard_are_named_with_the_numbers(qo: int, kv: int, mlp: int, ranks: int,
                                                             problems: list[str], fits: str):
    with pytest.raises(PreflightError) as caught:
        check_tensor_parallel(at(ranks), shaped(qo, kv, mlp))
    message = str(caught.value)
    assert message.startswith(f"instances.tensor_parallel: prefill instances at tensor_parallel {ranks} cannot "
                              "shard dummy:tiny: ")
    for problem in problems:
        assert problem in message
    assert len(message.split("; ")) == len(problems) + 1  # nothing that does divide is named
    assert message.endswith(f"degrees that shard it: {fits}")


def test_the_role_is_named():
    colocated = Config.from_yaml(CONFIGS / "tiny-colocated.yaml").override({"instances.tensor_parallel": 3})
    with pytest.raises(PreflightError, match=r"^instances\.tensor_parallel: colocated instances at tensor_parallel 3"):
        check_tensor_parallel(colocated, preset_config("tiny"))


@pytest.mark.parametrize("source, ranks, expected", [
    ("dummy:tiny", 3, r"cannot shard dummy:tiny: its 4 query heads .*; degrees that shard it: 1, 2, 4"),
    ("dummy:llama3-8b", 3, r"cannot shard dummy:llama3-8b: its 32 query heads .*; its MLP width \(intermediate_size "
                           r"14336\) does not divide by 3"),
    ("smollm2", 2, r"cannot shard smollm2: its 9 query heads"),
])
def test_check_model_source_reads_the_presets_shapes(source: str, ranks: int, expected: str):
    with pytest.raises(PreflightError, match=expected):
        check_model_source(at(ranks).override({"model.source": source}))
    check_model_source(at(1).override({"model.source": source}))


def test_a_model_directory_is_checked_from_its_config_json(tmp_path: Path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "num_hidden_layers": 2, "intermediate_size": 1536, "vocab_size": 256}))
    (folder / "model.safetensors").write_bytes(b"")  # present is all the check asks before Ray
    config = at(2).override({"model.source": str(folder)})
    with pytest.raises(PreflightError, match=r"prefill instances at tensor_parallel 2 cannot shard model: its 9 "
                                             r"query heads"):
        check_model_source(config)
    check_model_source(at(3).override({"model.source": str(folder)}))


def test_a_model_that_does_not_shard_fails_the_launch_before_ray_starts(monkeypatch):
    from disagg.cluster import Cluster
    from disagg.cluster.launch import bootstrap

    def connect(config):
        raise AssertionError("the launch connected to Ray before its checks of this host failed")
    monkeypatch.setattr(bootstrap, "connect", connect)
    with pytest.raises(PreflightError, match=r"prefill instances at tensor_parallel 3 cannot shard dummy:tiny"):
        Cluster.launch(at(3))
    with pytest.raises(AssertionError, match="connected to Ray"):  # a TP that shards gets as far as Ray
        Cluster.launch(at(2))


@pytest.mark.parametrize("gpus_per_instance, num_gpus, refused", [(1.0, 4, False), (1.0, 3, True), (0.5, 2, False),
                                                                   (0.5, 1, True), (0.25, 1, False)])
def test_ranks_need_their_gpus(gpus_per_instance: float, num_gpus: int, refused: bool):
    from disagg.cluster.launch.bootstrap import resolve_device

    inst = Config.from_yaml(CONFIGS / "llama3-8b-tp2-1p1d.yaml").override(
        {"instances.gpus_per_instance": gpus_per_instance}).instances
    if not refused:
        assert resolve_device(inst, num_gpus) == "cuda"
        return
    with pytest.raises(PreflightError, match=rf"instances.device is cuda: 2 instances \(4 tensor-parallel ranks\).* "
                                             rf"need {4 * gpus_per_instance:g} GPUs, the Ray cluster has {num_gpus}"):
        resolve_device(inst, num_gpus)


def test_more_ranks_than_this_hosts_gpus_fail_before_ray_starts(monkeypatch):
    from disagg.cluster import Cluster
    from disagg.cluster.launch import bootstrap

    def connect(config):
        raise AssertionError("the launch connected to Ray before its checks of this host failed")
    monkeypatch.setattr(bootstrap, "connect", connect)
    monkeypatch.setattr(bootstrap, "count_local_gpus", lambda: 2)
    config = Config.from_yaml(CONFIGS / "llama3-8b-tp2-1p1d.yaml").override({"instances.gpus_per_instance": 1.0})
    with pytest.raises(PreflightError, match=r"4 tensor-parallel ranks\) need 4 GPUs, this host .* has 2; set "
                                             r"instances.gpus_per_instance: 0.5 to put 2 ranks on each GPU"):
        Cluster.launch(config)
    with pytest.raises(AssertionError, match="connected to Ray"):  # at 0.5 the four ranks fit on two GPUs
        Cluster.launch(Config.from_yaml(CONFIGS / "llama3-8b-tp2-1p1d.yaml"))
