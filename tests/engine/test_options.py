"""`EngineOptions`: validated once, merged with the engines' size keywords (CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import close_heaps, collective

from disagg.engine import ColocatedEngine, DecodeEngine, EngineOptions, PrefillEngine
from disagg.engine.core import EngineCore
from disagg.transfer import new_unique_id, open_heap


SIZES = dict(num_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=16)


@pytest.mark.parametrize("field, value, error, message", [
    ("num_pages", 0, ValueError, r"num_pages: expected an int >= 1, got 0"),
    ("page_size", 2.0, TypeError, r"page_size: expected an int >= 1, got float 2.0"),
    ("max_num_seqs", True, TypeError, r"max_num_seqs: expected an int >= 1, got bool True"),
    ("async_scheduling", 1, TypeError, r"async_scheduling: expected a bool, got int 1"),
    ("use_cuda_graphs", "yes", TypeError, r"use_cuda_graphs: expected a bool or None, got str"),
    ("kv_dtype", "bf16", TypeError, r"kv_dtype: expected a torch.dtype or None, got str"),
    ("lease_s", 0.0, ValueError, r"lease_s: expected seconds > 0, got 0.0"),
    ("clock", 3, TypeError, r"clock: expected a callable"),
    ("push_after", "later", ValueError, r"push_after: expected one of \('graphs', 'never', 'always'\), got 'later'"),
])
def test_a_bad_value_names_the_field_expected_and_got(field, value, error, message):
    with pytest.raises(error, match=message):
        EngineOptions(**{field: value})
    with pytest.raises(error, match=message):
        EngineOptions().replace(**{field: value})


def test_frozen():
    with pytest.raises(AttributeError):
        EngineOptions().num_pages = 4  # type: ignore[misc]


def test_sizes_as_keywords_or_in_options(tiny_model):
    by_keyword = ColocatedEngine(tiny_model, **SIZES)
    in_options = ColocatedEngine(tiny_model, options=EngineOptions(**SIZES))
    both_same = ColocatedEngine(tiny_model, num_pages=8, options=EngineOptions(**SIZES, kv_dtype=torch.float32))
    assert by_keyword.options == in_options.options == EngineOptions(**SIZES)
    assert both_same.options.kv_dtype is torch.float32 and both_same.kv.dtype == torch.float32
    assert by_keyword.cache.num_pages == 8 and by_keyword.max_num_batched_tokens == 16


def test_a_size_given_twice_differently_or_missing_raises(tiny_model):
    with pytest.raises(ValueError, match=r"num_pages: given as a keyword \(9\) and in options \(8\)"):
        ColocatedEngine(tiny_model, num_pages=9, options=EngineOptions(**SIZES))
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: expected an int >= 1 .*got None"):
        ColocatedEngine(tiny_model, num_pages=8, page_size=4, max_num_seqs=2)
    with pytest.raises(TypeError, match=r"options: expected EngineOptions, got dict"):
        EngineCore(tiny_model, dict(SIZES))


def test_role_defaults(tiny_model):
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                              num_signals=16, timeout_s=10.0) for r in range(2)])
    try:
        prefill, decode = collective([lambda: PrefillEngine(tiny_model, heaps[0], **SIZES),
                                      lambda: DecodeEngine(tiny_model, heaps[1], num_pages=8, page_size=4,
                                                           max_num_seqs=3)])
        assert decode.options.max_num_batched_tokens == 2048  # max(max_num_seqs, 2048)
        assert prefill.options.use_cuda_graphs is False and prefill.options.prompt_graphs is True
    finally:
        close_heaps(uid, heaps)
