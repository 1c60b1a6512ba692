"""DecodeEngine with async scheduling (the next step launched before this step's tokens are read):
the same tokens as without it for greedy, seeded and stop-id requests; a token sampled after a stop
is discarded; the pages of a request that ends or is aborted while a launched step still writes
them are freed only after that step (dummy:tiny, one process, two-PE shm heap, CPU)."""

from __future__ import annotations

import pytest
from engine_helpers import assert_all_free, collective, reference_greedy

from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap
from disagg.transfer.shm_heap import shm_leftovers

PROMPTS = {"a": [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21], "b": [42], "c": [150, 151, 3, 4, 90, 12, 8]}
NUM_PAGES, PAGE_SIZE = 32, 4


@pytest.fixture
def pair(tiny_model, torch_reference):
    """make(async_scheduling) -> (prefill, decode) over one two-PE heap per call; all closed after."""
    opened = []

    def make(async_scheduling: bool):
        uid = new_unique_id("shm")
        heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                                  num_signals=16, timeout_s=10.0) for r in range(2)])
        opened.append((uid, heaps))
        sizes = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=4)
        return collective([
            lambda: PrefillEngine(tiny_model, heaps[0], max_num_batched_tokens=32, **sizes),
            lambda: DecodeEngine(tiny_model, heaps[1], **sizes,
                                      options=EngineOptions(async_scheduling=async_scheduling))])

    yield make
    for uid, heaps in opened:
        for heap in heaps:
            heap.close()
        assert shm_leftovers(uid) == []


def serve(prefill, decode, params: dict[str, SamplingParams], hook=None, max_steps: int = 200) -> dict:
    """Send every prompt, then step both engines (relaying first tokens) until idle; the tokens
    and finish reason per request. ``hook(step, decode)`` runs after each decode step."""
    for rid, prompt in PROMPTS.items():
        if rid in params:
            prefill.add(rid, prompt, params[rid], decode.reserve(rid, len(prompt), params[rid]))
    out: dict = {rid: ([], None) for rid in params}
    for step in range(max_steps):
        if not (prefill.has_work() or decode.has_work()):
            return out
        for o in prefill.step():
            if o.token_id is not None and o.request_id in decode.requests:
                decode.start(o.request_id, o.token_id)
            if o.token_id is not None:
                out[o.request_id][0].append(o.token_id)
        for o in decode.step():
            tokens, reason = out[o.request_id]
            assert reason is None, f"output after the end of {o.request_id}: {o}"
            if o.token_id is not None:
                tokens.append(o.token_id)
            out[o.request_id] = (tokens, o.finish_reason if o.finished else None)
        if hook is not None:
            hook(step, decode)
    raise AssertionError("still busy")


def test_greedy_and_seeded_tokens_equal_sync(pair):
    params = {"a": SamplingParams(max_tokens=12, ignore_eos=True),
              "b": SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=3, ignore_eos=True),
              "c": SamplingParams(max_tokens=12, temperature=0.7, top_p=0.8, seed=11, ignore_eos=True)}
    results = {}
    for mode in (False, True):
        prefill, decode = pair(mode)
        results[mode] = serve(prefill, decode, params)
        assert_all_free(prefill)
        assert_all_free(decode)
        assert (decode.stats()["num_steps_ahead"] > 0) == mode
    assert results[True] == results[False]
    assert all(reason == "length" and len(tokens) == 12 for tokens, reason in results[True].values())


def test_stop_token_ends_the_request_and_the_token_after_it_is_discarded(pair, tiny_model):
    greedy = reference_greedy(tiny_model, PROMPTS["a"], 12)
    stop = greedy[4]
    first = greedy.index(stop)
    params = {"a": SamplingParams(max_tokens=12, stop_token_ids=(stop,), ignore_eos=True),
              "c": SamplingParams(max_tokens=12, ignore_eos=True)}
    prefill, decode = pair(True)
    out = serve(prefill, decode, params)
    assert out["a"] == (greedy[:first + 1], "stop")
    assert out["c"] == (reference_greedy(tiny_model, PROMPTS["c"], 12), "length")
    assert decode.stats()["num_steps_ahead"] > 0
    assert_all_free(decode)


def test_abort_while_a_step_is_launched_ahead_frees_after_it(pair, tiny_model):
    params = {"a": SamplingParams(max_tokens=12, ignore_eos=True),
              "c": SamplingParams(max_tokens=12, ignore_eos=True)}
    prefill, decode = pair(True)
    seen = {}

    def abort_once_ahead(step, engine):
        if seen or engine._inflight is None or len(engine.running) < 2:
            return
        req = engine.requests["a"]
        assert req.seq_id in engine._inflight.seq_ids
        before = engine.cache.num_free_pages
        assert engine.abort("a")
        # The step launched ahead still appends to "a"'s pages: they are not free yet.
        assert req.seq_id in engine.cache and engine.cache.num_free_pages == before
        seen["deferred"] = len(engine._deferred)
        seen["step"] = step

    out = serve(prefill, decode, params, hook=abort_once_ahead)
    assert seen.get("deferred") == 1, seen
    assert out["a"][1] == "abort" and len(out["a"][0]) < 12
    assert out["c"] == (reference_greedy(tiny_model, PROMPTS["c"], 12), "length")
    assert_all_free(decode)
    assert decode.stats()["committed_pages"] == 0
