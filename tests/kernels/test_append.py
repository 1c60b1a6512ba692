"""append_kv / append_push_kv against the torch reference: bit-exact, skips, fp8, bad input; the
prepared per-layer launcher (`prepare_append_push`) against the one-shot one, and its misuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg.kernels import append_kv, append_push_kv, build_dst_table, reference
from disagg.kernels.append import prepare_append_push

FP8 = torch.float8_e4m3fn


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _new_kv(num_tokens, num_heads, head_dim, cache_dtype, device, *, stride_pad=0):
    """k, v inputs; for fp8 caches, values that scale exactly onto e4m3 (the interpreter's
    float->fp8 rounding differs from torch on ties across a binade, so exact inputs keep the
    comparison bit-exact on every backend)."""
    src = torch.float16 if cache_dtype == FP8 else cache_dtype
    shape = (num_tokens, num_heads + stride_pad, head_dim)
    if cache_dtype == FP8:
        k = torch.randn(shape).to(FP8).to(src) * 2.0
        v = torch.randn(shape).to(FP8).to(src) * 0.5
    else:
        k, v = torch.randn(shape).to(src), torch.randn(shape).to(src)
    # A padded head axis gives a strided view, as from a fused qkv projection.
    return k[:, :num_heads].to(device), v[:, :num_heads].to(device)


def _scales(cache_dtype):
    return {"k_scale": 2.0, "v_scale": 0.5} if cache_dtype == FP8 else {}


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("num_heads,page_size,head_dim", [(2, 4, 64), (3, 16, 32), (1, 1, 128)])
def test_append_matches_reference(device, cache_dtype, num_heads, page_size, head_dim):
    num_pages, num_tokens = 16, 11
    kv = torch.randn(num_pages, 2, num_heads, page_size, head_dim).to(cache_dtype).to(device)
    expected = kv.cpu().clone()
    k, v = _new_kv(num_tokens, num_heads, head_dim, cache_dtype, device, stride_pad=1)
    slots = torch.randperm(num_pages * page_size)[:num_tokens]
    slots[3] = -1
    append_kv(k, v, kv, slots.to(device), **_scales(cache_dtype))
    reference.append_kv(k.cpu(), v.cpu(), expected, slots, *_scales(cache_dtype).values() or (1.0, 1.0))
    assert _same_bits(kv.cpu(), expected)


def test_append_fp8_tensor_scales_and_saturation(device):
    kv = torch.zeros(2, 2, 1, 4, 16, dtype=FP8, device=device)
    k = torch.full((3, 1, 16), 1000.0, device=device)  # saturates at 448 instead of NaN
    v = torch.full((3, 1, 16), -8.0, device=device)
    scale = lambda x: torch.tensor([x], dtype=torch.float32, device=device)
    append_kv(k, v, kv, torch.tensor([0, 5, 7], device=device), k_scale=scale(1.0), v_scale=scale(4.0))
    assert kv[0, 0, 0, 0].float().eq(448.0).all()
    assert kv[1, 1, 0, 3].float().eq(-2.0).all()


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, FP8])
def test_append_push_matches_reference(device, cache_dtype):
    num_heads, page_size, head_dim, num_tokens = 2, 4, 32, 13
    geometry = (2, num_heads, page_size, head_dim)
    kv = torch.zeros(6, *geometry).to(cache_dtype).to(device)
    # Receivers of different sizes, allocated separately (peer views in the real system).
    dsts = [torch.zeros(n, *geometry).to(cache_dtype).to(device) for n in (5, 9, 4)]
    k, v = _new_kv(num_tokens, num_heads, head_dim, cache_dtype, device)
    slots = torch.randperm(24)[:num_tokens]
    slots[0] = -1
    dst_index = torch.tensor([0, 1, 2, 1, -1, 0, 2, 1, 1, 0, -1, 2, 1])
    dst_slots = torch.tensor([0, 35, 15, 3, 7, 19, 2, -1, 8, 1, 3, 14, 20])
    ref_kv, ref_dsts = kv.cpu().clone(), [d.cpu().clone() for d in dsts]
    append_push_kv(k, v, kv, slots.to(device), dsts, dst_slots.to(device), dst_index.to(device),
                   **_scales(cache_dtype))
    reference.append_push_kv(k.cpu(), v.cpu(), ref_kv, slots, ref_dsts, dst_slots, dst_index,
                             *_scales(cache_dtype).values() or (1.0, 1.0))
    assert _same_bits(kv.cpu(), ref_kv)
    for got, want in zip(dsts, ref_dsts):
        assert _same_bits(got.cpu(), want)
        assert got.float().abs().sum() > 0


def test_append_push_prebuilt_table_serves_every_layer(device):
    """One table built from layer 0 works for all layers of two same-shape caches."""
    local = torch.zeros(3, 4, 2, 2, 4, 16, device=device)
    remote = torch.zeros(3, 4, 2, 2, 4, 16, device=device)
    table = build_dst_table(local[0], [remote[0]])
    for layer in range(3):
        k, v = torch.randn(2, 2, 16, device=device), torch.randn(2, 2, 16, device=device)
        append_push_kv(k, v, local[layer], torch.tensor([1, 6], device=device), [remote[layer]],
                       torch.tensor([9, 2], device=device), torch.tensor([0, 0], device=device),
                       dst_table=table)
        assert torch.equal(remote[layer, 2, 0, :, 1], k[0]) and torch.equal(remote[layer, 0, 1, :, 2], v[1])


def test_append_push_into_shared_file(device, tmp_path):
    """A receiver cache that is a file mapping, as the CPU shm heap hands out."""
    if device.type != "cpu":
        pytest.skip("file mappings are CPU tensors")
    path = str(tmp_path / "pe1")
    shape, numel = (4, 2, 1, 4, 16), 4 * 2 * 4 * 16
    torch.zeros(numel).numpy().tofile(path)
    writer = torch.from_file(path, shared=True, size=numel).view(shape)
    kv = torch.zeros(shape)
    k, v = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    append_push_kv(k, v, kv, torch.tensor([0, 1, 2]), [writer], torch.tensor([15, -1, 4]),
                   torch.tensor([0, 0, 0]))
    reader = torch.from_file(path, shared=True, size=numel).view(shape)
    assert torch.equal(reader[3, 0, 0, 3], k[0, 0]) and torch.equal(reader[1, 1, 0, 0], v[2, 0])
    assert reader.count_nonzero() == 2 * 2 * 16


def test_append_out_of_range_raises_and_writes_nothing(device):
    kv = torch.zeros(2, 2, 1, 4, 16, device=device)
    k = torch.ones(2, 1, 16, device=device)
    for bad in ([0, 8], [-2, 1]):
        with pytest.raises(ValueError, match="slots"):
            append_kv(k, k, kv, torch.tensor(bad, device=device))
    with pytest.raises(ValueError, match="dst_slots"):
        append_push_kv(k, k, kv, torch.tensor([0, 1], device=device), [kv.clone()],
                       torch.tensor([0, 8], device=device), torch.tensor([0, 0], device=device))
    with pytest.raises(ValueError, match="dst_index"):
        append_push_kv(k, k, kv, torch.tensor([0, 1], device=device), [kv.clone()],
                       torch.tensor([0, 1], device=device), torch.tensor([0, 1], device=device))
    assert kv.count_nonzero() == 0


def test_append_bad_shapes_and_dtypes(device):
    kv = torch.zeros(2, 2, 2, 4, 16, device=device)
    k = torch.ones(3, 2, 16, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match=r"k: expected shape"):
        append_kv(k[:, :1], k[:, :1], kv, slots)
    with pytest.raises(ValueError, match=r"slots: expected shape"):
        append_kv(k, k, kv, slots[:2])
    with pytest.raises(TypeError, match="slots: expected dtype"):
        append_kv(k, k, kv, slots.float())
    with pytest.raises(TypeError, match="k: expected the cache's dtype"):
        append_kv(k.half(), k.half(), kv, slots)
    with pytest.raises(ValueError, match="kv_layer: expected each page packed"):
        append_kv(k, k, kv.transpose(3, 4).contiguous().transpose(3, 4), slots)
    with pytest.raises(ValueError, match="k_scale"):
        append_kv(k, k, kv, slots, k_scale=2.0)
    with pytest.raises(ValueError, match=r"dst_layers\[0\]: expected kv_layer's geometry"):
        append_push_kv(k, k, kv, slots, [kv.half()], slots, slots)


def test_cpu_without_interpreter_runs_reference(monkeypatch):
    """The dispatch reads TRITON_INTERPRET at call time: unset, CPU tensors take the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kv = torch.zeros(2, 2, 1, 4, 16)
    k = torch.randn(1, 1, 16)
    append_kv(k, -k, kv, torch.tensor([6]))
    assert torch.equal(kv[1, 0, 0, 2], k[0, 0]) and torch.equal(kv[1, 1, 0, 2], -k[0, 0])


# ---------------------------------------------------------------- prepared (per-forward) launcher
def _stacks(device, cache_dtype, layers=3, heads=2, page=4, dim=32, receivers=(5, 9)):
    """A local [L, 6, ...] cache and receiver stacks of other page counts (so other layer strides)."""
    geometry = (2, heads, page, dim)
    make = lambda pages: torch.randn(layers, pages, *geometry).to(cache_dtype).to(device)  # noqa: E731
    return make(6), [make(n) for n in receivers]


def _push_indices():
    slots = np.array([3, -1, 7, 0, 22, 9, 14], dtype=np.int32)
    dst_index = np.array([0, 1, -1, 1, 0, 0, 1], dtype=np.int32)
    dst_slots = np.array([19, 35, 4, 0, -1, 2, 8], dtype=np.int64)
    return slots, dst_slots, dst_index


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("host_indices", [True, False], ids=["numpy", "tensors"])
def test_prepared_writes_the_same_bytes_as_the_one_shot_launcher(device, cache_dtype, host_indices):
    kv, dsts = _stacks(device, cache_dtype)
    want_kv, want_dsts = kv.clone(), [d.clone() for d in dsts]
    slots, dst_slots, dst_index = _push_indices()
    as_dev = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    indices = (slots, dst_slots, dst_index) if host_indices else tuple(map(as_dev, (slots, dst_slots, dst_index)))
    prepared = prepare_append_push(kv, indices[0], dsts, *indices[1:])
    assert (prepared.num_layers, prepared.num_tokens, prepared.num_receivers) == (3, 7, 2)
    for layer in (2, 0, 1):
        k, v = _new_kv(7, 2, 32, cache_dtype, device, stride_pad=1)
        prepared(layer, k, v, **_scales(cache_dtype))
        append_push_kv(k, v, want_kv[layer], as_dev(slots), [d[layer] for d in want_dsts], as_dev(dst_slots),
                       as_dev(dst_index), **_scales(cache_dtype))
    assert _same_bits(kv.cpu(), want_kv.cpu())
    for got, want in zip(dsts, want_dsts):
        assert _same_bits(got.cpu(), want.cpu())


def test_prepared_without_receivers_is_append_kv_and_takes_tensor_scales(device):
    kv = torch.zeros(2, 4, 2, 1, 4, 16, dtype=FP8, device=device)
    want = kv.clone()
    slots = torch.tensor([5, 0, 9], device=device)
    prepared = prepare_append_push(kv, slots)
    scale = lambda x: torch.tensor([x], dtype=torch.float32, device=device)  # noqa: E731
    k, v = _new_kv(3, 1, 16, FP8, device)
    prepared(1, k, v, k_scale=scale(2.0), v_scale=scale(0.5))
    append_kv(k, v, want[1], slots, k_scale=scale(2.0), v_scale=scale(0.5))
    assert _same_bits(kv.cpu(), want.cpu()) and kv[1].float().abs().sum() > 0


def test_prepared_follows_k_v_of_other_strides_and_alignment(device):
    """k/v as a 2-byte-offset view and as a slice of a fused projection: each new kind is checked
    and launched with its own specialization, every layer lands right."""
    kv, dsts = _stacks(device, torch.float16, layers=4, dim=16, receivers=(6,))
    slots = torch.tensor([0, 5, 11], device=device)
    prepared = prepare_append_push(kv, slots, dsts, torch.tensor([1, 2, 3], device=device),
                                   torch.tensor([0, 0, 0], device=device))
    flat = torch.randn(1 + 3 * 2 * 16, device=device).half()
    fused = torch.randn(3, 5, 16, device=device).half()
    kinds = [(flat[1:].view(3, 2, 16), flat[1:].view(3, 2, 16) * 2), (fused[:, 1:3], fused[:, 3:5])]
    for layer, (k, v) in enumerate(kinds + kinds[::-1]):
        prepared(layer, k, v)
        assert torch.equal(kv[layer, 1, 0, :, 1], k[1]) and torch.equal(kv[layer, 1, 1, :, 1], v[1])
        assert torch.equal(dsts[0][layer, 0, 0, :, 3], k[2]) and torch.equal(dsts[0][layer, 0, 1, :, 1], v[0])


def _layer_misuses(device):
    k = torch.randn(3, 2, 16, device=device)
    return {
        "layer past the end": ((3, k, k), {}, ValueError, r"layer: expected an int in \[0, 3\), got 3"),
        "negative layer": ((-1, k, k), {}, ValueError, r"layer: expected an int in \[0, 3\), got -1"),
        "layer not an int": (("1", k, k), {}, TypeError, "layer: expected an int, got str"),
        "other token count": ((0, k[:2], k[:2]), {}, ValueError, "k: expected 3 tokens .*got 2"),
        "other heads": ((0, k[:, :1], k[:, :1]), {}, ValueError, r"k: expected shape .*got \(3, 1, 16\)"),
        "v of another shape": ((0, k, k[:2]), {}, ValueError, r"v: expected shape"),
        "other dtype": ((0, k.half(), k.half()), {}, TypeError, "k: expected the cache's dtype"),
        "v of another dtype": ((0, k, k.double()), {}, TypeError, r"v: expected dtype in \(float32\)"),
        "other device": ((0, k.to("meta"), k.to("meta")), {}, ValueError, "k: expected a tensor on"),
        "not a tensor": ((0, k.tolist(), k), {}, TypeError, "k: expected a torch.Tensor"),
        "head_dim not contiguous": ((0, k.transpose(0, 2).contiguous().transpose(0, 2), k), {}, ValueError,
                                    "k: expected stride 1 along head_dim"),
        "scale for a float cache": ((0, k, k), {"k_scale": 2.0}, ValueError, "k_scale: scales apply"),
        "stream on a CPU cache": ((0, k, k), {"stream": object()}, ValueError, "stream: expected"),
    }


@pytest.mark.parametrize("case", list(_layer_misuses(torch.device("cpu"))))
def test_prepared_layer_misuse_raises_and_writes_nothing(device, case):
    kv, dsts = _stacks(device, torch.float32, layers=3, dim=16, receivers=(4,))
    before = [kv.clone(), dsts[0].clone()]
    slots = np.array([1, 2, 3], dtype=np.int32)
    prepared = prepare_append_push(kv, slots, dsts, np.array([4, 5, 6]), np.zeros(3, np.int32))
    args, kwargs, error, match = _layer_misuses(device)[case]
    if case == "stream on a CPU cache" and device.type == "cuda":
        kwargs = {"stream": torch.cuda.Stream(device=device).cuda_stream}  # a raw handle, not a Stream
    prepared(1, torch.ones(3, 2, 16, device=device), torch.ones(3, 2, 16, device=device))  # a kind seen before
    before[0][1, 0, :, :, 1:4] = 1.0
    before[1][1, 1, :, :, 0:3] = 1.0
    with pytest.raises(error, match=match):
        prepared(*args, **kwargs)
    assert torch.equal(kv, before[0]) and torch.equal(dsts[0], before[1])


def test_prepare_misuse_raises_naming_the_argument(device):
    kv, dsts = _stacks(device, torch.float32, layers=2, dim=16, receivers=(4,))
    before = kv.clone()
    s, d, i = np.array([0, 1]), np.array([2, 3]), np.array([0, 0])
    cases = [
        ((kv[0], s), ValueError, r"kv: expected shape \[num_layers"),
        ((kv, s, dsts, torch.from_numpy(d).to(device), i), TypeError, "expected all numpy arrays or all tensors"),
        ((kv, s, dsts), ValueError, "dst_slots, dst_index: expected both with receivers"),
        ((kv, s, [], d, i), ValueError, "expected both with receivers"),
        ((kv, np.array([0, 24]), dsts, d, i), ValueError, r"slots: expected slots in \[-1, 24\)"),
        ((kv, s, dsts, np.array([2, 16]), i), ValueError, r"dst_slots: expected -1 or a slot of receiver 0 in \[0, 16\)"),
        ((kv, s, dsts, d, np.array([0, 1])), ValueError, r"dst_index: expected slots in \[-1, 1\)"),
        ((kv, s, dsts, d[:1], i), ValueError, r"dst_slots: expected shape \[2\]"),
        ((kv, s.astype(np.float32), dsts, d, i), TypeError, "slots: expected dtype"),
        ((kv, s, [dsts[0][:1]], d, i), ValueError, r"dst_kv\[0\]: expected 2 layers"),
        ((kv, s, [dsts[0].half()], d, i), ValueError, r"dst_kv\[0\]: expected kv's geometry"),
        ((kv, s, dsts[0], d, i), TypeError, "dst_kv: expected a sequence of tensors"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            prepare_append_push(*args)
    assert torch.equal(kv, before)


def test_prepared_with_no_tokens_checks_and_writes_nothing(device):
    kv = torch.zeros(2, 2, 2, 1, 4, 16, device=device)
    prepared = prepare_append_push(kv, np.zeros(0, np.int32))
    prepared(1, torch.ones(0, 1, 16, device=device), torch.ones(0, 1, 16, device=device))
    with pytest.raises(ValueError, match="k: expected 0 tokens"):
        prepared(0, torch.ones(1, 1, 16, device=device), torch.ones(1, 1, 16, device=device))
    assert kv.count_nonzero() == 0


@pytest.mark.parametrize("receivers", [(5, 9), ()], ids=["push", "append-only"])
def test_rebind_writes_what_a_fresh_prepare_writes_and_leaves_the_original_intact(device, receivers):
    """A forward after the first rebinds the prepared append to its own indices (shared geometry,
    offset table and kernels): the bytes equal a fresh prepare's, a token count of its own is
    taken, and the original still writes at its own slots."""
    kv, dsts = _stacks(device, torch.float16, receivers=receivers)
    want_kv, want_dsts = kv.clone(), [d.clone() for d in dsts]
    first = _push_indices() if receivers else (_push_indices()[0], None, None)
    prepared = prepare_append_push(kv, first[0], dsts, *first[1:])
    second = (np.array([1, 2, 20, 21], np.int32),) + (
        (np.array([3, 4, 5, 6], np.int64), np.array([1, 0, -1, 1], np.int32)) if receivers else (None, None))
    fresh = prepare_append_push(want_kv, second[0], want_dsts, *second[1:])
    rebound = prepared.rebind(*second)
    assert (rebound.num_tokens, prepared.num_tokens) == (4, 7)
    for layer in (1, 0, 2):
        k, v = _new_kv(4, 2, 32, torch.float16, device)
        rebound(layer, k, v)
        fresh(layer, k, v)
    assert _same_bits(kv.cpu(), want_kv.cpu())
    for got, want in zip(dsts, want_dsts):
        assert _same_bits(got.cpu(), want.cpu())
    k, v = _new_kv(7, 2, 32, torch.float16, device)
    prepared(0, k, v)
    assert torch.equal(kv[0, 0, 0, :, 3], k[0]) and torch.equal(kv[0, 3, 1, :, 2], v[6])


def test_rebind_misuse_raises_and_writes_nothing(device):
    kv, dsts = _stacks(device, torch.float32, layers=2, dim=16, receivers=(4,))
    before = [kv.clone(), dsts[0].clone()]
    prepared = prepare_append_push(kv, np.array([0, 1]), dsts, np.array([2, 3]), np.array([0, 0]))
    cases = [((np.array([0, 1]),), ValueError, "dst_slots, dst_index: expected both with receivers"),
             ((np.array([0, 24]), np.array([2, 3]), np.array([0, 0])), ValueError, r"slots: expected slots in \[-1, 24\)"),
             ((np.array([0, 1]), np.array([2, 16]), np.array([0, 0])), ValueError, r"dst_slots: expected -1 or a slot"),
             ((np.array([0, 1]), np.array([2]), np.array([0, 0])), ValueError, r"dst_slots: expected shape \[2\]")]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            prepared.rebind(*args)
    assert torch.equal(kv, before[0]) and torch.equal(dsts[0], before[1])
    assert prepared.num_tokens == 2


@pytest.mark.parametrize("bad", [0.0, -2.0, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("form", ["float", "tensor"])
def test_append_refuses_non_finite_or_non_positive_scales_and_writes_nothing(device, bad, form):
    kv = torch.zeros(4, 2, 2, 4, 16, device=device).to(torch.float8_e4m3fn)
    k = torch.randn(3, 2, 16, device=device)
    slots = torch.tensor([0, 1, 5], device=device)
    as_form = (lambda x: torch.tensor([x], dtype=torch.float32, device=device)) if form == "tensor" else float
    with pytest.raises(ValueError, match="k_scale: expected a finite scale > 0, got"):
        append_kv(k, k, kv, slots, k_scale=as_form(bad), v_scale=as_form(1.0))
    assert not kv.view(torch.uint8).any()
