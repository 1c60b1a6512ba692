"""copy_slots against the torch reference: bit-exact over dtypes, layers, runs and skips."""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import copy_slots, reference

FP8 = torch.float8_e4m3fn


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("num_heads,page_size,head_dim", [(2, 4, 32), (3, 1, 64), (1, 16, 48)])
def test_copy_all_layers_matches_reference(device, dtype, num_heads, page_size, head_dim):
    src = torch.randn(3, 5, 2, num_heads, page_size, head_dim).to(dtype).to(device)
    dst = torch.randn(3, 7, 2, num_heads, page_size, head_dim).to(dtype).to(device)
    # a whole page as one run, scattered single slots, and skips on either side
    src_slots = torch.cat([torch.arange(page_size), torch.tensor([5 * page_size - 1, 0, -1, 2])])
    dst_slots = torch.cat([torch.arange(page_size) + 3 * page_size, torch.tensor([0, -1, 1, 7 * page_size - 1])])
    want = dst.cpu().clone()
    copy_slots(src, src_slots.to(device), dst, dst_slots.to(device))
    reference.copy_slots(src.cpu(), src_slots, want, dst_slots)
    assert _same_bits(dst.cpu(), want)


def test_copy_one_layer_view_and_fork_within_cache(device):
    """Per-layer views of one cache: a fork copies a partial page to a fresh page, layer 1 only."""
    cache = torch.randn(2, 4, 2, 2, 4, 16, device=device)
    before = cache.clone()
    copy_slots(cache[1], torch.tensor([4, 5, 6], device=device), cache[1],
               torch.tensor([12, 13, 14], device=device))
    assert torch.equal(cache[1, 3, :, :, :3], before[1, 1, :, :, :3])
    assert torch.equal(cache[0], before[0]) and torch.equal(cache[1, :3], before[1, :3])


def test_copy_bad_inputs(device):
    src = torch.zeros(2, 3, 2, 1, 4, 16, device=device)
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="dst: expected src's shape"):
        copy_slots(src, slots, src[:1], slots)
    with pytest.raises(ValueError, match="dst: expected src's shape"):
        copy_slots(src, slots, src.half(), slots)
    with pytest.raises(ValueError, match=r"dst_slots: expected shape"):
        copy_slots(src, slots, src, slots[:1])
    with pytest.raises(ValueError, match=r"src_slots: expected slots in \[-1, 12\)"):
        copy_slots(src, torch.tensor([0, 12], device=device), src, slots)
    with pytest.raises(ValueError, match=r"dst_slots: expected slots in \[-1, 12\)"):
        copy_slots(src, slots, src, torch.tensor([-3, 1], device=device))
    with pytest.raises(ValueError, match="src: expected each page packed"):
        copy_slots(src.transpose(-1, -2), slots, src.transpose(-1, -2), slots)
    with pytest.raises(ValueError, match="collapse into one stride"):
        copy_slots(src.expand(2, 2, 3, 2, 1, 4, 16).transpose(0, 1), slots,
                   src.expand(2, 2, 3, 2, 1, 4, 16).transpose(0, 1), slots)


@pytest.mark.parametrize("layers", [None, 1])
def test_copy_within_one_cache_refuses_a_chain_or_a_repeated_destination(device, layers):
    """Pairs run in parallel: a destination that is also a source would race, so it is refused
    (with check_indices, the default on CPU), and nothing is written."""
    cache = torch.randn(2, 4, 2, 2, 4, 16, device=device)
    view = cache if layers is None else cache[layers]
    before = cache.clone()
    chain_src, chain_dst = torch.tensor([0, 4], device=device), torch.tensor([4, 8], device=device)
    with pytest.raises(ValueError, match="slot 4 at pair 0 written and read"):
        copy_slots(view, chain_src, view, chain_dst)
    with pytest.raises(ValueError, match="expected distinct destination slots, got slot 8"):
        copy_slots(view, torch.tensor([0, 1], device=device), view, torch.tensor([8, 8], device=device))
    assert torch.equal(cache, before)
    # The same slots between two caches, or a resolved chain (both read slot 0), are fine.
    other = torch.zeros_like(view)
    copy_slots(view, chain_src, other, chain_dst)
    copy_slots(view, torch.tensor([0, 0], device=device), view, chain_dst)
    before_view = before if layers is None else before[layers]
    for page in (1, 2):  # slot 0 landed in slot 4 (page 1) and slot 8 (page 2), offset 0
        assert torch.equal(view[..., page, :, :, 0, :], before_view[..., 0, :, :, 0, :])
