"""ColocatedEngine under random traffic (adds, aborts, steps) with a cache small enough to preempt
often: never a crash, page tables intact after every step, every finished request's greedy tokens
equal the full-recompute loop, and every page free at the end."""

from __future__ import annotations

import random

import pytest
from engine_helpers import assert_all_free, reference_greedy

from disagg.engine import ColocatedEngine, EngineOptions
from disagg.sampling import SamplingParams


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic(tiny_model, torch_reference, seed, async_scheduling):
    rng = random.Random(seed)
    engine = ColocatedEngine(tiny_model, num_pages=10, page_size=4, max_num_seqs=rng.choice([2, 3, 5]),
                             max_num_batched_tokens=rng.choice([4, 7, 16]),
                             options=EngineOptions(async_scheduling=async_scheduling))
    prompts, params, tokens, ended = {}, {}, {}, {}
    for step in range(80):
        action = rng.random()
        if action < 0.45 and len(prompts) < 16:
            rid = f"r{len(prompts)}"
            prompts[rid] = [rng.randrange(256) for _ in range(rng.randint(1, 20))]
            params[rid] = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True)
            engine.add(rid, prompts[rid], params[rid])
        elif action < 0.5 and prompts:
            rid = rng.choice(sorted(prompts))
            if engine.abort(rid):
                ended.setdefault(rid, "abort")
        for out in engine.step():
            if out.token_id is not None:
                tokens.setdefault(out.request_id, []).append(out.token_id)
            if out.finished:
                ended.setdefault(out.request_id, out.finish_reason)
        engine.cache.check_integrity()
    while engine.has_work():
        for out in engine.step():
            if out.token_id is not None:
                tokens.setdefault(out.request_id, []).append(out.token_id)
            if out.finished:
                ended.setdefault(out.request_id, out.finish_reason)
    assert_all_free(engine)
    assert engine.stats()["num_preemptions"] > 0
    assert (engine.stats()["num_steps_ahead"] > 0) == async_scheduling
    assert set(ended) == set(prompts)
    for rid, reason in ended.items():
        if reason == "length":
            want = reference_greedy(tiny_model, prompts[rid], params[rid].max_tokens)
            assert tokens[rid] == want, rid
