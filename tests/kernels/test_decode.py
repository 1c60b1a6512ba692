"""paged_decode against the torch reference: GQA, page sizes, splits (empty ones too), fp8, errors.

Tolerances: float32 runs IEEE dots, so 1e-5; float16 rounds q, K, V and P to 11 bits, so
atol 2e-3 / rtol 1e-2 on outputs of magnitude ~1.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import decode_workspace, paged_decode, reference

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-2)}
# one token, partial last page, exact page boundary, a longer one; 0 = a sequence with no page
LENGTHS = [1, 7, 16, 45]


def _run(device, page_table, dtype, num_kv_heads, group, head_dim, page_size, lengths,
         num_splits=None, cache_dtype=None, scales=None):
    cache_dtype = cache_dtype or dtype
    num_pages = sum((n + page_size - 1) // page_size for n in lengths) + 3
    kv = torch.randn(num_pages, 2, num_kv_heads, page_size, head_dim).to(cache_dtype).to(device)
    table = page_table(lengths, page_size, num_pages, device=device)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim).to(dtype).to(device)
    scales = scales or {}
    out = paged_decode(q, kv, table.page_indptr, table.page_indices, table.last_page_len,
                       head_dim ** -0.5, num_splits=num_splits, **scales)
    want = reference.paged_decode(q.cpu(), kv.cpu(), table.page_indptr.cpu(),
                                  table.page_indices.cpu(), table.last_page_len.cpu(),
                                  head_dim ** -0.5, *scales.values())
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,page_size", [
    (2, 4, 64, 4),    # GQA 4
    (1, 1, 32, 1),    # MHA, one token per page
    (1, 8, 128, 16),  # GQA 8
    (2, 2, 48, 3),    # head_dim and page size not powers of two
    (1, 2, 256, 8),   # the widest head: float32 tiles must still fit in shared memory on a GPU
])
def test_decode_matches_reference(device, page_table, dtype, num_kv_heads, group, head_dim,
                                  page_size, num_splits):
    _run(device, page_table, dtype, num_kv_heads, group, head_dim, page_size, LENGTHS,
         num_splits=num_splits)


@pytest.mark.parametrize("num_splits,group", [(1, 4), (2, 4), (7, 4), (7, 16), (13, 8)])
def test_decode_splits_with_empty_shares(device, page_table, num_splits, group):
    """A short and an empty sequence next to a long one: most of their splits are empty; groups
    of 8 and 16 q heads per kv head merge wider partial tiles."""
    _run(device, page_table, torch.float32, 1, group, 32, 8, [200, 2, 0, 65], num_splits=num_splits)


def test_decode_large_group(device, page_table):
    """32 q heads per kv head: the group fills more than tl.dot's 16 rows."""
    _run(device, page_table, torch.float16, 1, 32, 32, 4, [9, 20])


@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("scales", [dict(k_scale=0.5, v_scale=2.0), None])
def test_decode_fp8_cache(device, page_table, scales, head_dim):
    """head_dim 32 takes the word loads (K/V widened in registers), 48 the cast at the dot."""
    _run(device, page_table, torch.float16, 2, 2, head_dim, 4, [5, 33], cache_dtype=FP8,
         scales=scales)


def test_decode_fp8_tensor_scales(device, page_table):
    scale = lambda x: torch.tensor([x], dtype=torch.float32, device=device)
    kv = torch.randn(4, 2, 1, 4, 32).to(FP8).to(device)
    table = page_table([13], 4, 4, device=device)
    q = torch.randn(1, 2, 32, dtype=torch.float16, device=device)
    args = (q, kv, table.page_indptr, table.page_indices, table.last_page_len, 0.2)
    got = paged_decode(*args, k_scale=scale(0.25), v_scale=scale(3.0))
    want = reference.paged_decode(*(a.cpu() for a in args[:5]), 0.2, 0.25, 3.0)
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float16])
    # The scales matter (a kernel ignoring the tensors would read 1.0 and land far off).
    unit = reference.paged_decode(*(a.cpu() for a in args[:5]), 0.2, 1.0, 1.0)
    assert not torch.allclose(got.cpu(), unit, **TOLERANCE[torch.float16])
    # The float form gives the same bits as the tensor form.
    torch.testing.assert_close(paged_decode(*args, k_scale=0.25, v_scale=3.0), got, atol=0, rtol=0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("form", ["float", "tensor"])
def test_decode_refuses_non_finite_or_non_positive_scales(device, page_table, bad, form):
    kv = torch.randn(4, 2, 1, 4, 32).to(FP8).to(device)
    table = page_table([13], 4, 4, device=device)
    q = torch.randn(1, 2, 32, dtype=torch.float16, device=device)
    args = (q, kv, table.page_indptr, table.page_indices, table.last_page_len, 0.2)
    as_form = (lambda x: torch.tensor([x], dtype=torch.float32, device=device)) if form == "tensor" else float
    with pytest.raises(ValueError, match="v_scale: expected a finite scale > 0, got"):
        paged_decode(*args, k_scale=as_form(0.5), v_scale=as_form(bad))


def test_decode_out_and_workspace_reused(device, page_table):
    """A caller's out and workspace; the workspace serves consecutive calls (counters reset)."""
    table = page_table([30, 3], 4, 10, device=device)
    kv = torch.randn(10, 2, 1, 4, 32, device=device)
    out = torch.full((2, 2, 32), float("nan"), device=device)
    workspace = decode_workspace(2, 2, 32, 4, device)
    workspace[: 2 * 2 * 4 * 33] = float("nan")  # partials need no initial value, counters do
    tables = (table.page_indptr, table.page_indices, table.last_page_len)
    for _ in range(2):
        q = torch.randn(2, 2, 32, device=device)
        got = paged_decode(q, kv, *tables, 0.1, out=out, num_splits=4, workspace=workspace)
        assert got is out
        want = reference.paged_decode(q.cpu(), kv.cpu(), *(t.cpu() for t in tables), 0.1)
        torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
    assert workspace[2 * 2 * 4 * 33:].view(torch.int32).eq(0).all()
    with pytest.raises(ValueError, match="workspace"):
        paged_decode(q, kv, *tables, 0.1, num_splits=4, workspace=workspace[:10])


def test_decode_bad_inputs(device, page_table):
    table = page_table([5, 9], 4, 6, device=device)
    kv = torch.randn(6, 2, 2, 4, 32, device=device)
    q = torch.randn(2, 6, 32, device=device)
    args = [q, kv, table.page_indptr, table.page_indices, table.last_page_len, 0.1]
    with pytest.raises(ValueError, match="num_qo_heads divisible"):
        paged_decode(q[:, :3], *args[1:])
    with pytest.raises(ValueError, match="q: expected shape"):
        paged_decode(q[..., :16], *args[1:])
    with pytest.raises(TypeError, match="q: expected the cache's dtype"):
        paged_decode(q.half(), *args[1:])
    with pytest.raises(TypeError, match="page_indices: expected dtype"):
        paged_decode(*args[:3], table.page_indices.float(), *args[4:])
    with pytest.raises(ValueError, match="last_page_len: expected shape"):
        paged_decode(*args[:4], table.last_page_len[:1], 0.1)
    bad_pages = table.page_indices.clone()
    bad_pages[1] = 6
    with pytest.raises(ValueError, match=r"page_indices: expected page ids in \[0, 6\)"):
        paged_decode(*args[:3], bad_pages, *args[4:])
    bad_last = table.last_page_len.clone()
    bad_last[0] = 5
    with pytest.raises(ValueError, match="last_page_len: expected values in"):
        paged_decode(*args[:4], bad_last, 0.1)
    with pytest.raises(ValueError, match="page_indptr"):
        paged_decode(q, kv, table.page_indptr.flip(0), *args[3:])
    for bad_scale in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="sm_scale: expected a positive finite float"):
            paged_decode(*args[:5], bad_scale)


# Launch variants that decode.CONFIGS can select (off by default; benchmarks/sweep_kernels.py
# times them): each must stay correct, so a tuning round can switch one on.
VARIANTS = {
    "swap-ab": dict(SWAP_AB=True),
    "swap-ab-pv-t": dict(SWAP_AB=True, PV_T=True),
    "swap-ab-deferred-sum": dict(SWAP_AB=True, DEFER_SUM=True),
    "fp8-k-cast-at-dot": dict(K_WORDS=False),
    "fp8-v-cast-at-dot": dict(V_WORDS=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_launch_variants_match_reference(device, page_table, monkeypatch, variant):
    from disagg.kernels import decode as decode_mod

    for key in decode_mod.CONFIGS:
        monkeypatch.setitem(decode_mod.CONFIGS, key, dict(decode_mod.CONFIGS[key], **VARIANTS[variant]))
    fp8 = variant.startswith("fp8")
    _run(device, page_table, torch.float16, 2, 4, 32, 4, [5, 40], num_splits=2,
         cache_dtype=FP8 if fp8 else None, scales=dict(k_scale=0.5, v_scale=2.0) if fp8 else None)


@pytest.mark.parametrize("batch,ctx,splits", [
    (8, 1024, 4),     # 64 programs: split to fill 132 SMs (15.8 us against 21-23 unsplit)
    (32, 32768, 4),   # 256 programs, long: 4 splits measured best
    (64, 4096, 2),    # 512 programs: 2 kept
    (64, 1024, 1),    # 512 programs, 1024 tokens: unsplit 68 us against 73-75 with 2
    (256, 1024, 1),
    (1, 16, 1),
])
def test_split_choice_on_an_h200_follows_the_measurements(batch, ctx, splits):
    """The split heuristic at the shapes measured on an H200 (132 SMs, 8 kv heads)."""
    from disagg.kernels import choose_num_splits

    assert choose_num_splits(batch, 8, ctx, 132) == splits
