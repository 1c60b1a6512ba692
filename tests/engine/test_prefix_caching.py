"""Automatic prefix caching in the engines (dummy:tiny, fp32, CPU torch reference): greedy tokens
equal an uncached engine's for hits that end on a page boundary, mid page, at the whole prompt (one
token still computed), after the conversation so far (outputs cached too), and after eviction;
concurrent requests under page pressure keep the cache intact after every step and leave every page
free (free pages plus evictable cached ones) at the end."""

from __future__ import annotations

import pytest
from engine_helpers import assert_all_free, drain, torch_kernels

from disagg.engine import ColocatedEngine, EngineOptions
from disagg.sampling import SamplingParams

P = 4
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
A = [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21, 8, 30, 31]  # 14 tokens: 3 full pages and 2


def engine(tiny_model, prefix_caching: bool, num_pages: int = 32, max_num_seqs: int = 4,
           budget: int = 64) -> ColocatedEngine:
    return ColocatedEngine(tiny_model, num_pages=num_pages, page_size=P, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=budget,
                           options=EngineOptions(use_cuda_graphs=False, prefix_caching=prefix_caching))


def uncached(tiny_model, prompts: dict, params=GREEDY) -> dict:
    eng = engine(tiny_model, False)
    for rid, prompt in prompts.items():
        eng.add(rid, prompt, params)
    return {rid: r["tokens"] for rid, r in drain(eng).items()}


def run_one(eng, rid, prompt, params=GREEDY) -> tuple[list[int], int]:
    """Tokens of one request run alone, and the prompt tokens it found cached."""
    hits = eng.stats()["prefix_hit_tokens"]
    eng.add(rid, prompt, params)
    out = drain(eng)[rid]["tokens"]
    eng.cache.check_integrity()
    return out, eng.stats()["prefix_hit_tokens"] - hits


@pytest.fixture(scope="module")
def a_tokens(tiny_model):
    with torch_kernels():
        return uncached(tiny_model, {"a": A})["a"]


@pytest.mark.parametrize("name, prompt, hit", [
    ("page boundary", A[:8] + [1, 2, 3], 8),
    ("mid page", A[:10] + [99, 98, 97, 96, 95], 10),
    ("whole prompt", A, len(A) - 1),
    ("a longer prompt", A + [4, 4, 4], len(A)),
])
def test_hits_give_the_uncached_tokens(tiny_model, torch_reference, a_tokens, name, prompt, hit):
    eng = engine(tiny_model, True)
    assert run_one(eng, "a", A) == (a_tokens, 0)
    stats = eng.stats()
    assert stats["prefix_cached_pages"] == 5 and stats["free_pages"] == stats["total_pages"]
    tokens, found = run_one(eng, "b", prompt)
    assert found == hit, name
    assert tokens == uncached(tiny_model, {"b": prompt})["b"], name
    assert eng.stats()["prefix_query_tokens"] == len(A) + len(prompt)
    assert_all_free(eng)


def test_next_turn_reuses_the_outputs_kv(tiny_model, torch_reference, a_tokens):
    eng = engine(tiny_model, True)
    run_one(eng, "turn1", A)
    turn2 = A + a_tokens + [7, 7]  # the conversation so far, resent, plus the next message
    tokens, found = run_one(eng, "turn2", turn2)
    assert found == len(A) + len(a_tokens) - 1  # the last output token was never computed
    assert tokens == uncached(tiny_model, {"turn2": turn2})["turn2"]


def test_hit_after_eviction_and_after_a_miss(tiny_model, torch_reference, a_tokens):
    eng = engine(tiny_model, True, num_pages=8)
    run_one(eng, "a", A)  # 5 cached pages (prompt + 4 outputs: 18 tokens)
    other = [100 + i for i in range(24)]
    tokens, found = run_one(eng, "other", other)  # needs 7 pages: evicts 4 of a's, last first
    assert found == 0 and eng.stats()["prefix_evicted_pages"] == 4
    assert tokens == uncached(tiny_model, {"other": other})["other"]
    tokens, found = run_one(eng, "a again", A)  # a's first page is still there
    assert (tokens, found) == (a_tokens, P)
    tokens, found = run_one(eng, "a thrice", A)
    assert (tokens, found) == (a_tokens, len(A) - 1)
    assert_all_free(eng)


def test_off_computes_everything(tiny_model, torch_reference, a_tokens):
    eng = engine(tiny_model, False)
    run_one(eng, "a", A)
    assert run_one(eng, "b", A) == (a_tokens, 0)
    stats = eng.stats()
    assert stats["prefix_query_tokens"] == stats["prefix_hit_tokens"] == stats["prefix_cached_pages"] == 0


def test_concurrent_requests_under_page_pressure(tiny_model, torch_reference):
    """Shared prefixes, chunked prompts, preemption and eviction at once: integrity after every step."""
    system = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    prompts = {f"r{i}": system[: 5 + i % 5] + [40 + i] * (1 + i % 3) for i in range(10)}
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    eng = engine(tiny_model, True, num_pages=10, max_num_seqs=4, budget=8)
    results: dict = {}
    pending = list(prompts.items())
    for _ in range(500):
        if pending and len(eng.requests) < 5:
            rid, prompt = pending.pop(0)
            eng.add(rid, prompt, params)
        if not eng.has_work() and not pending:
            break
        for out in eng.step():
            results.setdefault(out.request_id, []).append(out.token_id)
        eng.cache.check_integrity()
        stats = eng.stats()
        assert 0 <= stats["free_pages"] <= stats["total_pages"]
    assert {rid: tokens for rid, tokens in results.items()} == uncached(tiny_model, prompts, params)
    stats = eng.stats()
    assert stats["prefix_hit_tokens"] > 0 and stats["prefix_evicted_pages"] > 0 and stats["num_preemptions"] > 0
    assert_all_free(eng)
    assert eng.cache.num_cached_pages == stats["prefix_cached_pages"] > 0


def test_a_preempted_request_finding_its_own_kv_again_is_counted_apart(tiny_model, torch_reference):
    """Prompts that share nothing (a random workload's) hit nothing: what a preempted request finds
    again when it re-enters, its own prompt and output, is counted apart (vLLM's preempted_hits)."""
    prompts = {f"r{i}": [100 + 12 * i + j for j in range(12)] for i in range(6)}
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    eng = engine(tiny_model, True, num_pages=12, max_num_seqs=4, budget=8)
    for rid, prompt in prompts.items():
        eng.add(rid, prompt, params)
    results = {rid: r["tokens"] for rid, r in drain(eng).items()}
    assert results == uncached(tiny_model, prompts, params)
    stats = eng.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["prefix_query_tokens"], stats["prefix_hit_tokens"]) == (6 * 12, 0)  # each prompt once
    assert 0 < stats["prefix_preempted_hit_tokens"] < stats["prefix_preempted_query_tokens"]
    assert_all_free(eng)
