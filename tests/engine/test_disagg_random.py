"""PrefillEngine + DecodeEngine (one process, two-PE shm heap) under random traffic: reserves that
may run out of pages, aborts on either side at any stage, leases that expire. Never a crash, page
tables intact after every step, finished requests' tokens equal the full-recompute loop, and every
page free on both sides at the end."""

from __future__ import annotations

import random

import pytest
from engine_helpers import assert_all_free, collective, reference_greedy

from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine
from disagg.errors import OutOfPages
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap
from disagg.transfer.shm_heap import shm_leftovers


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def pump(prefill, decode, tokens: dict, ended: dict) -> None:
    """One step of each engine, relaying first tokens as the router does; records outputs."""
    outputs = prefill.step()
    for out in outputs:
        if out.token_id is not None and out.request_id in decode.requests:
            decode.start(out.request_id, out.token_id)
    for out in outputs + decode.step():
        if out.token_id is not None:
            tokens.setdefault(out.request_id, []).append(out.token_id)
        if out.finished and not (out in outputs and out.finish_reason == "abort"):  # decode ends it
            ended.setdefault(out.request_id, out.finish_reason)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic(tiny_model, torch_reference, seed, async_scheduling):
    rng = random.Random(seed)
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                              num_signals=32, timeout_s=10.0) for r in range(2)])
    clock = Clock()
    sizes = dict(num_pages=16, page_size=4, max_num_seqs=3)
    prefill, decode = collective([
        lambda: PrefillEngine(tiny_model, heaps[0], max_num_batched_tokens=6, **sizes),
        lambda: DecodeEngine(tiny_model, heaps[1], **sizes, options=EngineOptions(
            lease_s=3.0, clock=clock, async_scheduling=async_scheduling))])
    prompts, params, tokens, ended, cut = {}, {}, {}, {}, set()
    try:
        for step in range(120):
            clock.now += 0.1
            action = rng.random()
            if action < 0.3:
                rid = f"r{len(prompts)}"
                prompt = [rng.randrange(256) for _ in range(rng.randint(1, 14))]
                p = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)
                try:
                    dest = decode.reserve(rid, len(prompt), p)
                except OutOfPages:
                    dest = None
                if dest is not None:
                    prompts[rid], params[rid] = prompt, p
                    prefill.add(rid, prompt, p, dest)
            elif action < 0.4 and set(prompts) - set(ended) - cut:
                rid = rng.choice(sorted(set(prompts) - set(ended) - cut))
                sides = rng.choice(["prefill", "decode", "both"])
                if sides != "decode" and prefill.abort(rid):
                    cut.add(rid)  # alone: the decode side's lease expires ("error")
                if sides != "prefill" and decode.abort(rid):  # alone: the push ends the quarantine
                    ended.setdefault(rid, "abort")
            pump(prefill, decode, tokens, ended)
            prefill.cache.check_integrity()
            decode.cache.check_integrity()
        for _ in range(500):
            if not (prefill.has_work() or decode.has_work()):
                break
            clock.now += 0.1
            pump(prefill, decode, tokens, ended)
        assert_all_free(prefill)
        assert_all_free(decode)
        assert decode.stats()["committed_pages"] == 0 and decode.receiver.num_armed == 0
        assert (decode.stats()["num_steps_ahead"] > 0) == async_scheduling
        finished = [rid for rid, reason in ended.items() if reason == "length"]
        reasons = sorted(ended.values())
        assert finished and "abort" in reasons and "error" in reasons, reasons  # every path taken
        for rid in finished:
            assert tokens[rid] == reference_greedy(tiny_model, prompts[rid], params[rid].max_tokens), rid
    finally:
        for heap in heaps:
            heap.close()
    assert shm_leftovers(uid) == []
