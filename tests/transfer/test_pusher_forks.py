"""Fork chains through the KV pusher: what a cache plan's fork copies leave in real KV memory.

`KVPusher.begin_forward` applies a plan's fork copies in ONE `copy_slots` launch (parallel
pairs); the cache resolves chains (a fork of a fork before any forward) to original sources, and
the pusher refuses a plan whose copies would race. Runs the torch reference path and the Triton
kernel (interpreter on CPU); the GPU variant is in tests/kernels/test_kernels_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from heap_threads import collective

from disagg.cache import PagedKVCache
from disagg.transfer import KVPusher

LAYERS, PAGES, HEADS, PAGE, DIM = 2, 8, 2, 4, 8
SHAPE = (LAYERS, PAGES, 2, HEADS, PAGE, DIM)


@pytest.fixture(params=["reference", "triton"])
def path(request, monkeypatch):
    """The torch reference (TRITON_INTERPRET=0 on CPU) or the Triton kernel in the interpreter."""
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU needs TRITON_INTERPRET=1 set before triton is imported")
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


@pytest.fixture
def sender(heap_pair):
    h0, h1 = heap_pair
    kv0, _ = collective([lambda: h0.alloc(SHAPE, torch.float16), lambda: h1.alloc(SHAPE, torch.float16)])
    return KVPusher(h0, kv0), kv0


def layer_kv(num_tokens: int, layer: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100 + layer)
    x = torch.randn(2, num_tokens, HEADS, DIM, generator=gen).half()
    return x[0], x[1]


def run(pusher: KVPusher, cache: PagedKVCache, seq_ids: list[int], lens: list[int], seed: int):
    """One forward through cache and pusher; returns each layer's new (k, v)."""
    plan = cache.begin_forward(seq_ids, lens)
    pusher.begin_forward(plan)
    new = [layer_kv(plan.num_tokens, layer, seed) for layer in range(LAYERS)]
    for layer in range(LAYERS):
        pusher.push_layer_async(layer, *new[layer])
    pusher.end_forward()
    cache.end_forward()
    return new


def keys(kv: torch.Tensor, cache: PagedKVCache, seq_id: int) -> torch.Tensor:
    """K of every layer at ``seq_id``'s slots: ``[L, n, H, D]``."""
    slots = torch.from_numpy(cache.slots(seq_id).astype(np.int64))
    return torch.stack([kv[layer, slots // PAGE, 0, :, slots % PAGE] for layer in range(LAYERS)])


def test_fork_of_a_fork_then_a_forward_lands_the_original_kv(path, sender):
    """The review's repro: 3-token seq 0; fork 0 -> 1; fork 1 -> 2; append one token to 2."""
    pusher, kv = sender
    cache = PagedKVCache(PAGES, PAGE)
    cache.add_sequence(0)
    prompt = run(pusher, cache, [0], [3], seed=1)
    cache.fork_sequence(0, 1)
    cache.fork_sequence(1, 2)
    cache.fork_sequence(2, 3, 2)
    step = run(pusher, cache, [2], [1], seed=2)
    want = torch.stack([prompt[layer][0] for layer in range(LAYERS)])  # [L, 3, H, D]
    assert torch.equal(keys(kv, cache, 1), want)
    got = keys(kv, cache, 2)
    assert torch.equal(got[:, :3], want), "seq 2 reads stale KV where the chain should have copied"
    assert torch.equal(got[:, 3], torch.stack([step[layer][0][0] for layer in range(LAYERS)]))
    assert torch.equal(keys(kv, cache, 3), want[:, :2])


def test_a_plan_whose_fork_copies_would_race_is_refused_before_any_write(path, sender):
    pusher, kv = sender
    cache = PagedKVCache(PAGES, PAGE)
    cache.add_sequence(0)
    plan = cache.begin_forward([0], [1])
    chained = dataclasses.replace(plan, fork_src_slots=np.array([0, 4], np.int32),
                                  fork_dst_slots=np.array([4, 8], np.int32))
    before = kv.clone()
    with pytest.raises(ValueError, match="written and read"):
        pusher.begin_forward(chained)
    assert torch.equal(kv, before)
    cache.end_forward()
