"""dummy:tiny end to end on CPU: the Triton kernels (interpreter) against the torch references,
one-shot vs chunked prefill, mixed batches, static decode batches, fp8 KV, input checks."""

from __future__ import annotations

import os

import pytest
import torch

from disagg.model import AttentionBatch, load_model
from paged_runner import PagedRunner

PROMPTS = [[5, 17, 33, 2, 9, 11, 40, 41, 42, 7], [100, 3, 8], [250, 251, 4, 60, 61, 62, 63]]
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels: needs TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def tiny():
    return load_model("dummy:tiny", device="cpu")


def _generate(model, prompts, steps, chunk=None, page_size=4):
    """Prefill logits then `steps` greedy decode logits, `[steps + 1, n, vocab]`."""
    runner = PagedRunner(model, page_size=page_size)
    logits = [runner.prefill(prompts, chunk)]
    for _ in range(steps):
        logits.append(runner.decode(logits[-1].argmax(-1).tolist()))
    return torch.stack(logits)


def test_tiny_shapes_and_varied_greedy(tiny, reference_kernels):
    c = tiny.config
    assert (c.num_layers, c.hidden_size, c.num_qo_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        2, 64, 4, 2, 16, 256)
    assert tiny.dtype == torch.float32 and tiny.kv_shape(8, 4) == (2, 8, 2, 2, 4, 16)
    logits = _generate(tiny, PROMPTS, 12)
    assert torch.isfinite(logits).all()
    tokens = logits.argmax(-1)  # [steps, n]
    for seq in range(len(PROMPTS)):
        assert len(set(tokens[:, seq].tolist())) > 4, "greedy decode collapsed onto few tokens"


@needs_interpreter
def test_triton_interpreter_matches_reference(tiny, monkeypatch):
    kernels = _generate(tiny, PROMPTS, 3, chunk=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reference = _generate(tiny, PROMPTS, 3, chunk=4)
    torch.testing.assert_close(kernels, reference, atol=2e-4, rtol=1e-4)


def test_chunked_prefill_and_page_sizes_agree(tiny, reference_kernels):
    whole = _generate(tiny, PROMPTS, 4)
    for chunk, page_size in ((3, 4), (1, 2), (5, 16)):
        torch.testing.assert_close(_generate(tiny, PROMPTS, 4, chunk, page_size), whole,
                                   atol=2e-5, rtol=1e-5)


def test_mixed_batch_matches_separate_forwards(tiny, reference_kernels):
    """A decode of one sequence and a prompt chunk of another in the same forward."""
    alone = PagedRunner(tiny)
    alone.prefill([PROMPTS[0]])
    expected_decode = alone.decode([7])
    expected_chunk = PagedRunner(tiny).prefill([PROMPTS[2]])
    mixed = PagedRunner(tiny)
    mixed.prefill([PROMPTS[0]])
    logits = mixed.forward({0: [7], 1: PROMPTS[2]})
    torch.testing.assert_close(logits[0], expected_decode[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], expected_chunk[0], atol=2e-5, rtol=1e-5)


def test_static_decode_batch_matches_from_plan(tiny, reference_kernels):
    """A padded static batch (prefix view) gives the same logits as an eager decode batch."""
    runner = PagedRunner(tiny)
    runner.prefill(PROMPTS[:2])
    static = tiny.static_decode_batch(max_batch_size=4, max_pages=16, max_kv_len=64)
    bucket = static.view(3)
    for step, tokens in enumerate(([3, 4], [5, 6])):
        plan = runner.cache.begin_forward([0, 1], [1, 1])
        try:
            eager_kv = runner.kv.clone()
            eager = tiny.forward(torch.tensor(tokens), AttentionBatch.from_plan(plan, "cpu"), eager_kv)
            static.copy_from_plan(plan, tokens)
            logits = tiny.forward(bucket.input_ids, bucket, runner.kv)
        finally:
            runner.cache.end_forward()
        torch.testing.assert_close(logits[:2], eager, atol=1e-6, rtol=1e-6)
        assert torch.isfinite(logits[2]).all()  # the padding row attends to nothing
        # The real rows' K/V may round differently (a 3-row GEMM against a 2-row one), so their
        # slots are compared within rounding; every other slot must be bit-identical.
        pages, offsets = (torch.as_tensor(plan.append_slots) // runner.cache.page_size,
                          torch.as_tensor(plan.append_slots) % runner.cache.page_size)
        written = (slice(None), pages, slice(None), slice(None), offsets)
        torch.testing.assert_close(runner.kv[written], eager_kv[written], atol=1e-6, rtol=1e-6)
        runner.kv[written] = eager_kv[written]
        assert torch.equal(runner.kv, eager_kv), "padding rows must not write the cache"


def test_cleared_static_batch_writes_no_page(tiny, reference_kernels):
    """After `clear_static`, a forward over the static batch (what a CUDA-graph capture's
    warm-up runs) leaves the cache alone, though the last plan's rows had real append slots."""
    runner = PagedRunner(tiny)
    runner.prefill(PROMPTS[:2])
    static = tiny.static_decode_batch(max_batch_size=4, max_pages=16, max_kv_len=64)
    plan = runner.cache.begin_forward([0, 1], [1, 1])
    static.copy_from_plan(plan, [3, 4])
    runner.cache.end_forward()
    before = runner.kv.clone()
    tiny.forward(static.input_ids, static, runner.kv)  # the stale rows write their slots
    assert not torch.equal(runner.kv, before)
    runner.kv.copy_(before)
    static.clear_static()
    assert static.append_slots.tolist() == [-1] * 4 and static.page_indptr.tolist() == [0] * 5
    tiny.forward(static.input_ids, static, runner.kv)
    assert torch.equal(runner.kv, before)


def test_fp8_kv_cache_close_to_fp32(tiny, reference_kernels):
    runner = PagedRunner(tiny, kv_dtype=torch.float8_e4m3fn)
    fp8 = runner.prefill(PROMPTS)
    exact = PagedRunner(tiny).prefill(PROMPTS)
    assert (fp8 - exact).abs().max() < 0.1 * exact.abs().max()
    assert torch.equal(fp8.argmax(-1), exact.argmax(-1))


class RecordingWriter:
    """A `LayerKVWriter` that records its calls and appends locally (what a sender does, minus
    the receivers)."""

    def __init__(self, kv):
        self.kv = kv
        self.calls = []

    def save_layer(self, layer, k, v, *, k_scale=None, v_scale=None):
        self.calls.append(("save", layer, tuple(k.shape), tuple(v.shape)))
        from disagg.kernels import append_kv

        append_kv(k, v, self.kv[layer], self.slots)


def test_kv_writer_gets_every_layer_in_order(tiny, reference_kernels):
    """With a writer on the batch (`AttentionBatch.kv_writer`), each layer's K/V go through its
    save_layer, in layer order (no local append by the model), and the logits equal a forward
    without one."""
    expected = PagedRunner(tiny).prefill(PROMPTS)
    runner = PagedRunner(tiny)
    writer = RecordingWriter(runner.kv)
    for seq in range(len(PROMPTS)):
        runner.cache.add_sequence(seq)
    plan = runner.cache.begin_forward([0, 1, 2], [len(p) for p in PROMPTS])
    writer.slots = torch.from_numpy(plan.append_slots)
    batch = AttentionBatch.from_plan(plan, "cpu", kv_writer=writer)
    logits = tiny.forward(torch.tensor(sum(PROMPTS, [])), batch, runner.kv)
    runner.cache.end_forward()
    num_tokens = sum(map(len, PROMPTS))
    assert writer.calls == [("save", layer, (num_tokens, 2, 16), (num_tokens, 2, 16)) for layer in range(2)]
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-6)


def test_fork_copies_applied_before_appends(tiny, reference_kernels):
    """A child forked mid-page continues exactly like its parent (the plan's fork copies of the
    partial page run before the forward's appends)."""
    runner = PagedRunner(tiny, page_size=4)
    runner.prefill([PROMPTS[0]])  # 10 tokens: the last page holds 2
    runner.cache.fork_sequence(0, 1)
    logits = runner.forward({0: [9], 1: [9]})
    torch.testing.assert_close(logits[1], logits[0], atol=1e-6, rtol=1e-6)
    logits = runner.forward({0: [3], 1: [4]})
    assert not torch.allclose(logits[0], logits[1])


def test_forward_rejects_bad_inputs(tiny):
    runner = PagedRunner(tiny)
    runner.cache.add_sequence(0)
    plan = runner.cache.begin_forward([0], [3])
    batch = AttentionBatch.from_plan(plan, "cpu")
    with pytest.raises(ValueError, match="input_ids: expected 3 tokens"):
        tiny.forward(torch.tensor([1, 2]), batch, runner.kv)
    with pytest.raises(ValueError, match=r"kv: expected \[L, N, 2, H_kv, P, D\]"):
        tiny.forward(torch.tensor([1, 2, 3]), batch, runner.kv[:1])
    with pytest.raises(TypeError, match="kv: expected torch.float32"):
        tiny.forward(torch.tensor([1, 2, 3]), batch, runner.kv.half())
    with pytest.raises(ValueError, match="kv_scales: only for"):
        tiny.forward(torch.tensor([1, 2, 3]), batch, runner.kv, kv_scales=(1.0, 1.0))
    runner.cache.end_forward()


@pytest.mark.parametrize("num_decodes", [0, 1, 3])
def test_batch_index_views_are_16_byte_aligned(num_decodes):
    """Triton specializes pointers on 16-byte alignment: index views whose offsets followed the
    batch size compiled new kernel variants mid-serving. Mixed batches (leading decodes) carry
    the prefill rows' tables as views of their own, rebased to 0."""
    from disagg.cache import PagedKVCache

    names = ["qo_indptr", "page_indptr", "page_indices", "last_page_len", "append_slots", "positions"]
    if num_decodes:
        names += ["prefill_qo_indptr", "prefill_page_indptr", "prefill_page_indices",
                  "prefill_last_page_len"]
    for batch_size in range(num_decodes + 1, num_decodes + 7):
        cache = PagedKVCache(64, 4)
        for seq in range(batch_size):
            cache.add_sequence(seq)
        cache.begin_forward(list(range(batch_size)), [seq + 3 for seq in range(batch_size)])
        cache.end_forward()
        appends = [1 if seq < num_decodes else seq + 2 for seq in range(batch_size)]
        plan = cache.begin_forward(list(range(batch_size)), appends)
        try:
            batch = AttentionBatch.from_plan(plan, "cpu")
        finally:
            cache.end_forward()
        assert batch.num_decodes == num_decodes
        for name in names:
            view = getattr(batch, name)
            assert view.data_ptr() % 16 == 0, (batch_size, name)
        assert batch.page_indptr.tolist() == list(plan.page_indptr)
        if num_decodes:
            d, pages = num_decodes, list(plan.page_indptr)
            assert batch.prefill_qo_indptr.tolist() == [q - plan.qo_indptr[d] for q in plan.qo_indptr[d:]]
            assert batch.prefill_page_indptr.tolist() == [p - pages[d] for p in pages[d:]]
            assert batch.prefill_page_indices.tolist() == list(plan.page_indices[pages[d]:])
            assert batch.prefill_last_page_len.tolist() == list(plan.last_page_len[d:])


def test_mixed_batch_splits_decode_and_prefill_kernels(tiny, reference_kernels, monkeypatch):
    """A forward of two decodes and a prompt chunk runs `paged_decode` over the two decode rows
    and `paged_prefill` over the chunk's, and its logits equal the forwards run apart."""
    from disagg.model import llama

    alone = PagedRunner(tiny)
    alone.prefill(PROMPTS[:2])
    expected_decodes = alone.decode([7, 8])
    expected_chunk = PagedRunner(tiny).prefill([PROMPTS[2]])
    calls = []
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(llama, name)
        monkeypatch.setattr(llama, name, lambda q, *a, _n=name, _f=real, **kw: calls.append((_n, q.shape[0])) or _f(q, *a, **kw))
    mixed = PagedRunner(tiny)
    mixed.prefill(PROMPTS[:2])
    calls.clear()
    logits = mixed.forward({0: [7], 1: [8], 2: PROMPTS[2]})
    layers_ = tiny.config.num_layers
    assert sorted(set(calls)) == [("paged_decode", 2), ("paged_prefill", len(PROMPTS[2]))]
    assert len(calls) == 2 * layers_
    torch.testing.assert_close(logits[:2], expected_decodes, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[2], expected_chunk[0], atol=2e-5, rtol=1e-5)
