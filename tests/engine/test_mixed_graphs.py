"""Whole-forward graphs of prompt and mixed steps (`disagg.engine.mixed_graphs`) on the CPU: the
forward runs eagerly over the static, padded buffers (``capture=False``), which is everything
but the capture: the bucket choice, the row layout (decodes padded to their bucket, prompts
after them, padding rows and padding sequences), the logits order and the fork copies. The same
forwards replayed as CUDA graphs are checked in tests/engine/test_engine_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import assert_all_free, drain, plan_after_prefix

from disagg.engine import ColocatedEngine
from disagg.engine.mixed_graphs import MAX_GRAPH_PROMPTS, MixedGraphs
from disagg.model.batch import AttentionBatch
from disagg.sampling import SamplingParams


def _plan(kv, lengths: list[int], prefix: list[int]):
    cache, plan = plan_after_prefix(kv.shape[1], kv.shape[4], lengths, prefix)
    cache.end_forward()
    return plan


@pytest.mark.parametrize("lengths,prefix", [([5], [0]), ([16], [3]), ([1, 1, 9], [6, 2, 0]),
                                            ([1, 7, 30], [4, 0, 5]), ([1, 1, 1, 2, 3], [9, 1, 4, 0, 7])],
                         ids=["prompt", "prompt-with-history", "decodes+prompt", "decode+chunks",
                              "three-decodes+two-prompts"])
def test_a_graphed_forward_equals_the_eager_one(tiny_model, torch_reference, lengths, prefix):
    shape = tiny_model.kv_shape(48, 4)
    kv_eager = torch.randn(shape, dtype=tiny_model.dtype)  # the prefixes' KV: any values
    kv_graph = kv_eager.clone()
    graphs = MixedGraphs(tiny_model, kv_graph, max_num_seqs=8, max_num_batched_tokens=64, capture=False)
    # Stale values from an earlier, larger step must not reach this one.
    graphs.buffers.input_ids.fill_(7)
    graphs.logits.fill_(1e4)
    plan = _plan(kv_eager, lengths, prefix)
    ids = (np.arange(plan.num_tokens) * 7 + 3) % tiny_model.config.vocab_size
    bucket = graphs.bucket(plan)
    d = sum(1 for n in lengths[:next(i for i, n in enumerate(lengths + [2]) if n != 1)] if n == 1)
    assert bucket is not None and bucket[1] >= d and bucket[0] >= bucket[1] + plan.num_tokens - d
    eager = tiny_model.forward(torch.as_tensor(ids), AttentionBatch.from_plan(plan, "cpu"), kv_eager)
    graphed = graphs.run(plan, ids, bucket).clone()
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_graph, kv_eager, rtol=1e-5, atol=1e-5)  # padding rows wrote nothing
    assert graphs.num_replays == 1 and graphs.num_graphs == 1


def test_buckets_pad_the_decodes_and_refuse_what_fits_no_graph(tiny_model):
    kv = torch.zeros(tiny_model.kv_shape(512, 4), dtype=tiny_model.dtype)
    graphs = MixedGraphs(tiny_model, kv, max_num_seqs=64, max_num_batched_tokens=2048, capture=False)
    assert graphs.token_buckets[-1] == 512 and graphs.decode_buckets[:4] == [0, 1, 2, 4]
    assert graphs.bucket(_plan(kv, [1, 1, 1, 9], [3, 3, 3, 0])) == (16, 4)  # 4 decode rows + 9 = 13
    assert graphs.bucket(_plan(kv, [1, 1, 1, 14], [3, 3, 3, 0])) == (32, 4)  # 4 + 14 = 18
    assert graphs.bucket(_plan(kv, [12], [0])) == (16, 0)
    assert graphs.bucket(_plan(kv, [1, 1], [3, 3])) is None  # pure decode: the decode graphs
    assert graphs.bucket(_plan(kv, [1, 1, 1, 508], [3, 3, 3, 0])) == (512, 4)
    assert graphs.bucket(_plan(kv, [1, 1, 1, 510], [3, 3, 3, 0])) is None  # 4 decode rows + 510 > 512
    assert graphs.bucket(_plan(kv, [600], [0])) is None  # past the largest token bucket
    many = [2] * (MAX_GRAPH_PROMPTS + 1)
    assert graphs.bucket(_plan(kv, many, [0] * len(many))) is None  # too many prompts


def test_capture_all_counts_every_bucket_pair(tiny_model):
    kv = torch.zeros(tiny_model.kv_shape(64, 4), dtype=tiny_model.dtype)
    graphs = MixedGraphs(tiny_model, kv, max_num_seqs=4, max_num_batched_tokens=32, capture=False)
    graphs.capture_all()
    pairs = [(t, d) for t in graphs.token_buckets for d in graphs.decode_buckets if d < t]
    assert graphs.token_buckets == [16, 32, 36]  # a whole-budget step beside padded decodes fits
    assert graphs.num_graphs == len(pairs) == 3 * 4  # x decodes 0, 1, 2, 4


def test_an_engine_with_mixed_graphs_decodes_as_without(tiny_model, torch_reference):
    """Chunked prompts, mixed steps, prefix-cache hits that end mid page (fork copies), decodes:
    the same greedy tokens with the mixed graphs serving every step they fit, every page free."""
    shared = list(range(3, 17))  # 14 tokens: 3 whole pages of 4 and half a page
    prompts = [shared + [90, 91], [42], list(range(7, 40)), shared + [5], shared + [150, 151, 152]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = []
    for with_graphs in (False, True):
        engine = ColocatedEngine(tiny_model, num_pages=64, page_size=4, max_num_seqs=4,
                                 max_num_batched_tokens=16)
        if with_graphs:
            engine.runner.mixed_graphs = MixedGraphs(tiny_model, engine.kv, 4, 16, capture=False)
        engine.add("r0", prompts[0], params)
        drain(engine)  # r0 cached: the later shared prompts hit it (mid page: a fork copy)
        for i, prompt in enumerate(prompts[1:], 1):
            engine.add(f"r{i}", prompt, params)
        results.append(drain(engine))
        stats = engine.stats()
        assert stats["prefix_hit_tokens"] > 0
        if with_graphs:
            assert stats["num_mixed_graph_replays"] > 0
        assert_all_free(engine)
    assert results[1] == results[0]
    assert all(len(r["tokens"]) == 6 for r in results[1].values())
