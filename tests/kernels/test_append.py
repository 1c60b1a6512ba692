"""append_kv / append_push_kv against the torch reference: bit-exact, skips, fp8, bad input."""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import append_kv, append_push_kv, build_dst_table, reference

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
