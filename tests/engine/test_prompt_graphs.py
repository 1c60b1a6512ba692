"""Piecewise prompt graphs (`disagg.engine.prompt_graphs`) on the CPU: the pieces run eagerly over
the static, padded buffers (``capture=False``), which is everything but the capture itself: the
bucket choice, the padding rows, the buffer hand-offs between pieces and attention. The same
forwards replayed as CUDA graphs are checked in tests/engine/test_engine_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import assert_all_free, drain, plan_after_prefix

from disagg.engine import ColocatedEngine
from disagg.engine.prompt_graphs import MAX_GRAPH_TOKENS, PromptGraphs, prompt_buckets
from disagg.model.batch import AttentionBatch
from disagg.sampling import SamplingParams


def test_buckets_stop_at_the_budget_or_the_cap():
    assert prompt_buckets(8) == [8]
    assert prompt_buckets(16) == [16]
    assert prompt_buckets(100) == [16, 32, 64, 100]
    assert prompt_buckets(8192)[-1] == MAX_GRAPH_TOKENS
    graphs_buckets = prompt_buckets(600)
    assert graphs_buckets[-1] == 600 and graphs_buckets[-2] == 512


def _forward(model, kv, lengths: list[int], prefix: list[int], pieces) -> torch.Tensor:
    """One forward over sequences with ``prefix`` tokens cached and ``lengths`` new ones."""
    cache, plan = plan_after_prefix(kv.shape[1], kv.shape[4], lengths, prefix)
    batch = AttentionBatch.from_plan(plan, model.device)
    ids = torch.arange(sum(lengths), dtype=torch.int64) % model.config.vocab_size
    logits = model.forward(ids, batch, kv, pieces=pieces)
    cache.end_forward()
    return logits


@pytest.mark.parametrize("lengths,prefix", [([1], [0]), ([5], [0]), ([16], [0]), ([17], [3]),
                                            ([1, 1, 9], [6, 2, 0]), ([1, 7, 30], [4, 0, 5])],
                         ids=["one-token", "short", "a-bucket", "past-a-bucket", "mixed", "mixed-chunks"])
def test_pieces_over_padded_buffers_equal_the_eager_forward(tiny_model, torch_reference, lengths, prefix):
    graphs = PromptGraphs(tiny_model, 64, capture=False)
    shape = tiny_model.kv_shape(32, 4)
    # Stale rows past the forward's tokens must not reach it: fill the buffers with garbage.
    for buffer in (graphs.qkv, graphs.o, graphs.residual, graphs.hidden):
        buffer.fill_(1e4)
    graphs.ids.fill_(3)
    kv_eager = torch.zeros(shape, dtype=tiny_model.dtype)
    kv_pieces = torch.zeros(shape, dtype=tiny_model.dtype)
    eager = _forward(tiny_model, kv_eager, lengths, prefix, None)
    pieces = graphs.pieces(sum(lengths))
    assert pieces is not None and graphs.bucket(sum(lengths)) >= sum(lengths)
    piecewise = _forward(tiny_model, kv_pieces, lengths, prefix, pieces)
    torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_pieces, kv_eager, rtol=1e-5, atol=1e-5)
    assert graphs.num_replays == 1


def test_a_forward_over_the_largest_bucket_has_no_pieces(tiny_model):
    graphs = PromptGraphs(tiny_model, 32, capture=False)
    assert graphs.pieces(33) is None and graphs.pieces(0) is None
    assert graphs.num_replays == 0


def test_an_engine_with_prompt_pieces_decodes_as_without(tiny_model, torch_reference):
    """Chunked prompts, mixed steps and decodes: the same greedy tokens through the pieces, which
    served every step with prompt tokens."""
    prompts = [[5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21], [42], list(range(7, 40)), [150, 151, 3, 4, 90]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = []
    for with_pieces in (False, True):
        engine = ColocatedEngine(tiny_model, num_pages=64, page_size=4, max_num_seqs=4,
                                 max_num_batched_tokens=16)
        if with_pieces:
            engine.runner.prompt_graphs = PromptGraphs(tiny_model, 16, capture=False)
        for i, prompt in enumerate(prompts):
            engine.add(f"r{i}", prompt, params)
        results.append(drain(engine))
        if with_pieces:
            stats = engine.stats()
            assert stats["num_prompt_graph_replays"] > 0
            assert stats["num_prompt_graph_replays"] + stats["num_graph_replays"] <= stats["num_forwards"]
        assert_all_free(engine)
    assert results[1] == results[0]
    assert all(len(r["tokens"]) == 6 for r in results[1].values())
    np.testing.assert_equal(sorted(results[1]), [f"r{i}" for i in range(len(prompts))])
