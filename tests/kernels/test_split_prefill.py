"""split_prefill and the paged kernel's prefix/LSE modes against the torch reference.

The split prefill computes a prompt chunk's attention as two parts merged by log-sum-exp: its
own tokens (dense, causal) and the prefix in pages (`paged_prefill(prefix_only=True)`). Every
case compares with `reference.paged_prefill`, the one-pass attention over the whole sequence:
prefixes of 0 tokens, of part of a page and of many pages, ragged batches, GQA ratios 1/4/8,
float32/float16 (the Triton interpreter's dots; bfloat16 through the CPU path) and fp8 caches.
Tolerances as in test_prefill.
"""

from __future__ import annotations

import math

import pytest
import torch

from disagg.kernels import paged_prefill, reference
from disagg.kernels import split_prefill as split_module
from disagg.kernels.fp8 import quantize
from disagg.kernels.split_prefill import SPLIT_MIN_TOKENS, split_prefill, use_split

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-2),
             torch.bfloat16: dict(atol=1.6e-2, rtol=2e-2)}
PAGE_SIZE = 4
# (q_lens, prefix lengths): one sequence without prefix; a prefix of part of a page; of many pages
# with a chunk ending mid-page; a one-token chunk behind a long prefix; a sequence with no queries.
RAGGED = ([7, 5, 9, 1, 0], [0, 3, 21, 30, 6])


def _case(page_table, dtype, num_kv_heads, group, head_dim, q_lens, prefix_lens, cache_dtype=None,
          seed=0):
    """A cache whose sequences hold prefix + own tokens, the own tokens' K/V as the layer appended
    them, and the batch's tables: (q, k, v, kv, qo_indptr, table)."""
    torch.manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    num_pages = sum(-(-n // PAGE_SIZE) for n in kv_lens) + 2
    kv = torch.randn(num_pages, 2, num_kv_heads, PAGE_SIZE, head_dim).to(cache_dtype)
    table = page_table(kv_lens, PAGE_SIZE, num_pages, device="cpu")
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype) for _ in range(2))
    start = 0
    for slots, p, n in zip(table.seq_slots, prefix_lens, q_lens):  # append the own tokens
        own = slots[p:p + n]
        kv[own // PAGE_SIZE, 0, :, own % PAGE_SIZE] = k[start:start + n].to(cache_dtype)
        kv[own // PAGE_SIZE, 1, :, own % PAGE_SIZE] = v[start:start + n].to(cache_dtype)
        start += n
    qo_indptr = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return q, k, v, kv, qo_indptr, table


def _tables(table):
    return table.page_indptr, table.page_indices, table.last_page_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_split_prefill_matches_one_pass_attention(device, page_table, dtype, group):
    q, k, v, kv, qo_indptr, table = _case(page_table, dtype, 2, group, 32, *RAGGED)
    want = reference.paged_prefill(q, kv, qo_indptr, *_tables(table), 32 ** -0.5)
    out = torch.full_like(q, float("nan")).to(device)
    got = split_prefill(q.to(device), k.to(device), v.to(device), kv.to(device), qo_indptr.to(device),
                        *(t.to(device) for t in _tables(table)), 32 ** -0.5, RAGGED[0], out=out)
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("prefix_len", [0, 3, 41])
def test_split_prefill_one_long_chunk(device, page_table, prefix_len):
    """The model's case on a GPU: one prompt chunk after no prefix, part of a page, many pages."""
    q, k, v, kv, qo_indptr, table = _case(page_table, torch.float32, 1, 4, 64, [37], [prefix_len])
    want = reference.paged_prefill(q, kv, qo_indptr, *_tables(table), 0.1)
    got = split_prefill(q.to(device), k.to(device), v.to(device), kv.to(device), qo_indptr.to(device),
                        *(t.to(device) for t in _tables(table)), 0.1, [37])
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


def test_split_prefill_bfloat16_on_the_cpu_path(page_table, monkeypatch):
    """bfloat16 (which the interpreter's dots get wrong) through the launchers' CPU path: the own
    part rounded to bfloat16 as cuDNN's output is, then merged in float32."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, kv, qo_indptr, table = _case(page_table, torch.bfloat16, 2, 4, 32, *RAGGED)
    want = reference.paged_prefill(q, kv, qo_indptr, *_tables(table), 32 ** -0.5)
    got = split_prefill(q, k, v, kv, qo_indptr, *_tables(table), 32 ** -0.5)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


def test_split_prefill_fp8_cache(device, page_table):
    """Over an fp8 cache the prefix is read quantized and the own tokens are not: the result is
    the merge of exactly those two parts, and near the one-pass attention over the fp8 cache."""
    scales = dict(k_scale=0.5, v_scale=1.5)
    q, k, v, kv16, qo_indptr, table = _case(page_table, torch.float16, 1, 4, 32, *RAGGED)
    kv = torch.stack([quantize(kv16[:, 0], 0.5), quantize(kv16[:, 1], 1.5)], dim=1)
    sm_scale = 32 ** -0.5
    got = split_prefill(q.to(device), k.to(device), v.to(device), kv.to(device), qo_indptr.to(device),
                        *(t.to(device) for t in _tables(table)), sm_scale, RAGGED[0], **scales).cpu()
    prefix_o, prefix_lse = reference.paged_prefill_lse(q, kv, qo_indptr, *_tables(table), sm_scale,
                                                       True, *scales.values(), prefix_only=True)
    own_o, own_lse = reference.causal_attention_lse(q, k, v, qo_indptr, sm_scale)
    want = reference.merge_state(prefix_o, prefix_lse, own_o.to(q.dtype), own_lse)
    torch.testing.assert_close(got, want.to(q.dtype), **TOLERANCE[torch.float16])
    one_pass = reference.paged_prefill(q, kv, qo_indptr, *_tables(table), sm_scale, True, *scales.values())
    assert (got.float() - one_pass.float()).abs().max() < 0.25  # the own tokens' fp8 rounding only


@pytest.mark.parametrize("prefix_only", [False, True])
def test_paged_prefill_returns_lse(device, page_table, prefix_only):
    """Mode "store": each query's log-sum-exp (-inf where a query sees no key, whose output is 0)."""
    q, _, _, kv, qo_indptr, table = _case(page_table, torch.float32, 2, 4, 32, *RAGGED)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=device)
    o = paged_prefill(q.to(device), kv.to(device), qo_indptr.to(device), *(t.to(device) for t in _tables(table)),
                      0.2, prefix_only=prefix_only, lse=lse)
    want_o, want_lse = reference.paged_prefill_lse(q, kv, qo_indptr, *_tables(table), 0.2,
                                                   prefix_only=prefix_only)
    torch.testing.assert_close(o.cpu(), want_o, **TOLERANCE[torch.float32])
    torch.testing.assert_close(lse.cpu(), want_lse, **TOLERANCE[torch.float32])
    if prefix_only:  # sequence 0 has no prefix
        assert lse[:, :7].eq(-math.inf).all() and o[:7].eq(0).all()


def test_merge_weighs_each_part_by_its_lse(device, page_table):
    """Mode "merge" with a made-up other part: out = (e^a o_prefix + e^b o_other) / (e^a + e^b).
    Its LSE dominates some rows (they come out as the other part) and is -inf in others (they
    come out as the prefix alone, or as 0 where there is no prefix either)."""
    q, _, _, kv, qo_indptr, table = _case(page_table, torch.float32, 2, 1, 32, *RAGGED)
    num_tokens, num_heads, _ = q.shape
    other = torch.randn_like(q)
    other_lse = torch.randn(num_heads, num_tokens) * 3
    other_lse[:, 7:9] = 1e4
    other_lse[:, 12:14] = -math.inf
    other_lse[:, 0:2] = -math.inf  # sequence 0 has no prefix: no key on either side
    got = paged_prefill(q.to(device), kv.to(device), qo_indptr.to(device), *(t.to(device) for t in _tables(table)),
                        0.2, prefix_only=True, lse=other_lse.to(device), merge_with=other.to(device)).cpu()
    prefix_o, prefix_lse = reference.paged_prefill_lse(q, kv, qo_indptr, *_tables(table), 0.2, prefix_only=True)
    torch.testing.assert_close(got, reference.merge_state(prefix_o, prefix_lse, other, other_lse), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[7:9], other[7:9])
    torch.testing.assert_close(got[12:14], prefix_o[12:14], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2:7], other[2:7])  # no prefix: the other part, as it was
    assert got[0:2].eq(0).all()


def test_merge_state_of_two_halves_is_the_whole():
    """The reference merge: attention over keys split in two parts, merged, equals attention over
    all keys; a part without keys (-inf) weighs nothing."""
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 16), torch.randn(2, 30, 16), torch.randn(2, 30, 16)
    whole, whole_lse = reference._attend_lse(q, k, v, 0.3, None)
    a, lse_a = reference._attend_lse(q, k[:, :11], v[:, :11], 0.3, None)
    b, lse_b = reference._attend_lse(q, k[:, 11:], v[:, 11:], 0.3, None)
    torch.testing.assert_close(reference.merge_state(a, lse_a, b, lse_b), whole)
    torch.testing.assert_close(torch.logaddexp(lse_a, lse_b), whole_lse)
    none = torch.full_like(lse_a, -math.inf)
    torch.testing.assert_close(reference.merge_state(a, lse_a, torch.randn_like(a), none), a)


def test_split_prefill_bad_inputs(page_table):
    q, k, v, kv, qo_indptr, table = _case(page_table, torch.float32, 2, 2, 32, [4, 3], [0, 2])
    args = (kv, qo_indptr, *_tables(table), 0.2)
    with pytest.raises(ValueError, match="q_lens: expected 2 non-negative lengths summing to num_tokens=7"):
        split_prefill(q, k, v, *args, [4, 4])
    with pytest.raises(ValueError, match="q_lens: expected qo_indptr's differences"):
        split_prefill(q, k, v, *args, [3, 4])
    with pytest.raises(ValueError, match="k: expected"):
        split_prefill(q, k[:5], v, *args)
    with pytest.raises(TypeError, match="v: expected"):
        split_prefill(q, k, v.half(), *args)
    with pytest.raises(ValueError, match="merge_with: needs lse"):
        paged_prefill(q, *args, prefix_only=True, merge_with=q)
    with pytest.raises(ValueError, match="lse: expected"):
        paged_prefill(q, *args, lse=torch.zeros(q.shape[0], q.shape[1]))


def test_use_split_follows_the_setting(monkeypatch):
    monkeypatch.setattr(split_module.dispatch, "is_capturing", lambda device: False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bf16 = torch.bfloat16
    long = dict(num_tokens=SPLIT_MIN_TOKENS * 2, num_seqs=2, q_lens_known=True)
    assert use_split("auto", device=cuda, dtype=bf16, kv_dtype=bf16, **long)
    assert not use_split("auto", device=cuda, dtype=bf16, kv_dtype=FP8, **long)  # fp8 stays paged
    assert not use_split("auto", device=cuda, dtype=torch.float32, kv_dtype=torch.float32, **long)
    assert not use_split("auto", device=cuda, dtype=bf16, kv_dtype=bf16, num_tokens=SPLIT_MIN_TOKENS * 2 - 1,
                         num_seqs=2, q_lens_known=True)
    assert not use_split("auto", device=cuda, dtype=bf16, kv_dtype=bf16, **dict(long, q_lens_known=False))
    assert not use_split("auto", device=cpu, dtype=bf16, kv_dtype=bf16, **long)
    assert not use_split("paged", device=cuda, dtype=bf16, kv_dtype=bf16, **long)
    assert use_split("split", device=cpu, dtype=torch.float32, kv_dtype=FP8, num_tokens=1, num_seqs=1,
                     q_lens_known=False)
    assert not use_split("split", device=cuda, dtype=bf16, kv_dtype=bf16, **dict(long, q_lens_known=False))
    monkeypatch.setattr(split_module.dispatch, "is_capturing", lambda device: True)
    assert not use_split("split", device=cuda, dtype=bf16, kv_dtype=bf16, **long)  # never in a capture
    assert use_split("split", device=cpu, dtype=bf16, kv_dtype=bf16, **long)
