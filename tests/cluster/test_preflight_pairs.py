"""The preflight of a fleet whose prefill and decode sides differ in tensor parallelism: each side
must shard the model (refused naming both numbers), ranks of different TP are compared without
their share of the heads, and pages are sized from the widest page (every PE allocates it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.cluster.launch.preflight import check_same_model, check_tensor_parallel, size_cache
from disagg.config import Config
from disagg.errors import PreflightError
from disagg.model.presets import preset_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-1p1d.yaml"


def info(tp: int, num_kv_heads: int, page_bytes: int, **changes) -> dict:
    base = {"geometry": {"num_layers": 2, "num_kv_heads": num_kv_heads, "page_size": 16, "head_dim": 16,
                         "kv_dtype": "torch.float32"},
            "page_bytes": page_bytes, "kv_budget_bytes": 8192 * 100, "model_name": "dummy:tiny",
            "max_position_embeddings": 4096, "tensor_parallel": tp, "model_num_kv_heads": 2}
    base.update(changes)
    return base


def test_ranks_of_different_tensor_parallelism_differ_only_in_their_heads():
    prefill, decode = info(1, 2, 8192), info(2, 1, 4096)
    check_same_model(["prefill-0", "decode-0", "decode-0 rank 1"], [prefill, decode, decode])
    with pytest.raises(PreflightError, match=r"differ in geometry: num_kv_heads 1 vs 2"):
        check_same_model(["decode-0", "decode-0 rank 1"], [decode, info(2, 2, 8192)])  # one TP: heads must match
    with pytest.raises(PreflightError, match=r"differ in model_num_kv_heads: 2 vs 4"):
        check_same_model(["prefill-0", "decode-0"], [prefill, info(2, 1, 4096, model_num_kv_heads=4)])
    with pytest.raises(PreflightError, match=r"differ in geometry: head_dim 16 vs 32"):
        bad = info(2, 1, 4096)
        bad["geometry"] = dict(bad["geometry"], head_dim=32)
        check_same_model(["prefill-0", "decode-0"], [prefill, bad])


def test_pages_are_sized_from_the_widest_page():
    config = Config.from_yaml(TINY).override({"cache.num_pages": None})
    sizing = size_cache(config, ["prefill-0", "decode-0"], [info(1, 2, 8192), info(2, 1, 4096)])
    assert (sizing.page_bytes, sizing.num_pages) == (8192, 100)


def test_a_pair_is_checked_side_by_side_naming_both_numbers():
    tiny = preset_config("tiny")
    config = Config.from_yaml(TINY)
    for prefill, decode in ((1, 2), (2, 1), (2, 4), (4, 2), (1, 4)):
        check_tensor_parallel(config.override({"instances.tensor_parallel": {"prefill": prefill, "decode": decode}}),
                              tiny)
    with pytest.raises(PreflightError, match=r"prefill 4 pushing into decode 3: decode instances at tensor_parallel "
                                             r"3 cannot shard"):
        check_tensor_parallel(config.override({"instances.tensor_parallel": {"prefill": 4, "decode": 3}}), tiny)
    for tensor_parallel in ({"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 2}, 2):  # a digest per route
        check_tensor_parallel(config.override({"instances.tensor_parallel": tensor_parallel, "transfer.verify": True}),
                              tiny)
