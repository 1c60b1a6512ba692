"""Decode-side prefix reuse across the push (PrefillEngine + DecodeEngine over a two-PE shm heap,
dummy:tiny, CPU): a reservation made with the prompt's ids forks from the decode instance's cached
prefix (whole pages), its map covers only the rest, and the prefill side pushes exactly the tokens
past that match (fewer by exactly the matched length) with tokens equal to the uncached run; the
prefill side's own cache may hold more or less of the prompt than the decode side's. Aborts and
lease expiry free the reservation's own pages and keep the cached ones."""

from __future__ import annotations

import pytest
from engine_helpers import FakeClock, assert_all_free, close_heaps, collective, reference_tokens

from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap

P = 4
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
A = [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21, 8, 30, 31]  # 14 tokens
B = A[:12] + [1, 2, 3, 4, 5]  # shares 3 pages of A


@pytest.fixture(params=[(True, "graphs"), (False, "graphs"), (True, "always")],
                ids=["prefill-cache", "prefill-nocache", "prefill-cache-push-after"])
def engines(tiny_model, torch_reference, request):
    """(prefill on PE 0, with or without its own prefix cache, pushing layer by layer or after each
    forward (`transfer.push_after`: its forks, the existing KV's copies); decode on PE 1; the lease
    clock)."""
    prefix_caching, push_after = request.param
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                              num_signals=16, timeout_s=10.0) for r in range(2)])
    clock = FakeClock()
    sizes = dict(num_pages=24, page_size=P, max_num_seqs=4)
    prefill, decode = collective([
        lambda: PrefillEngine(tiny_model, heaps[0], max_num_batched_tokens=6, **sizes, options=EngineOptions(
            use_cuda_graphs=False, prefix_caching=prefix_caching, push_after=push_after)),
        lambda: DecodeEngine(tiny_model, heaps[1], **sizes, options=EngineOptions(lease_s=5.0, clock=clock))])
    yield prefill, decode, clock
    close_heaps(uid, heaps)


@pytest.fixture(scope="module")
def expected(tiny_model):
    return reference_tokens(tiny_model, {"a": A, "b": B}, GREEDY.max_tokens)


def serve(prefill, decode, rid, prompt, known=True) -> tuple[list[int], int, int]:
    """One request through both engines; returns (tokens, decode-side cached tokens, pushed tokens)."""
    kv = prefill.kv
    token_bytes = kv.element_size() * kv[:, 0].numel() // P
    pushed = prefill.stats()["pushed_bytes"]
    dest = decode.reserve(rid, len(prompt), GREEDY, prompt_token_ids=prompt if known else None)
    prefill.add(rid, prompt, GREEDY, dest)
    tokens = []
    while prefill.has_work() or decode.has_work():
        for out in prefill.step():
            tokens.append(out.token_id)
            decode.start(rid, out.token_id)
        tokens += [out.token_id for out in decode.step()]
    prefill.cache.check_integrity()
    decode.cache.check_integrity()
    return tokens, dest.num_cached_tokens, (prefill.stats()["pushed_bytes"] - pushed) // token_bytes


def test_decode_hit_cuts_the_push_by_the_matched_length(engines, expected):
    prefill, decode, _ = engines
    assert serve(prefill, decode, "a", A) == (expected["a"], 0, len(A))
    tokens, cached, pushed = serve(prefill, decode, "b", B)
    assert (tokens, cached, pushed) == (expected["b"], 12, len(B) - 12)
    assert decode.stats()["prefix_hit_tokens"] == 12
    tokens, cached, pushed = serve(prefill, decode, "b unknown", B, known=False)  # no ids: no match
    assert (tokens, cached, pushed) == (expected["b"], 0, len(B))
    assert_all_free(prefill)
    assert_all_free(decode)


def test_whole_prompt_cached_on_decode_still_pushes_its_last_page(engines, expected):
    prefill, decode, _ = engines
    serve(prefill, decode, "a", A)
    tokens, cached, pushed = serve(prefill, decode, "a again", A)
    assert (tokens, cached, pushed) == (expected["a"], 12, 2)  # 13 found, cut to whole pages


def test_prefill_hit_beyond_the_decode_hit_copies_existing_kv_page_to_page(engines, expected):
    """Decode has only A's first pages cached (the rest evicted); prefill holds all of A."""
    prefill, decode, _ = engines
    serve(prefill, decode, "a", A)
    decode.cache.add_sequence(10**6)  # take every page but one of A's 5 cached ones (its first)
    decode.cache.begin_forward([10**6], [P * (decode.cache.num_free_pages - 1)])
    decode.cache.end_forward()
    decode.cache.remove_sequence(10**6)
    assert decode.stats()["prefix_cached_pages"] == 1
    tokens, cached, pushed = serve(prefill, decode, "b", B)
    assert (tokens, cached, pushed) == (expected["b"], P, len(B) - P)
    assert_all_free(prefill)
    assert_all_free(decode)


@pytest.mark.parametrize("end", ["abort", "lease expiry", "cancel"])
def test_dropped_reservation_frees_its_pages_and_keeps_the_cached_ones(engines, expected, end):
    prefill, decode, clock = engines
    serve(prefill, decode, "a", A)
    cached_before = decode.stats()["prefix_cached_pages"]
    dest = decode.reserve("b", len(B), GREEDY, prompt_token_ids=B)
    assert dest.num_cached_tokens == 12
    assert decode.stats()["prefix_cached_pages"] == cached_before - 3  # pinned by the reservation
    if end == "abort":
        decode.abort("b")
    elif end == "cancel":
        decode.cancel_reservation(dest)
    clock.now += 5.0
    while decode.has_work():
        decode.step()
    assert decode.stats()["prefix_cached_pages"] == cached_before
    assert decode.cache.match_prefix(A).num_tokens == len(A) - 1
    assert_all_free(decode)
    tokens, cached, pushed = serve(prefill, decode, "b2", B)
    assert (tokens, cached, pushed) == (expected["b"], 12, len(B) - 12)


def test_bad_cached_length_in_dest_is_refused(engines):
    prefill, decode, _ = engines
    serve(prefill, decode, "a", A)
    dest = decode.reserve("b", len(B), GREEDY, prompt_token_ids=B)
    with pytest.raises(ValueError, match="dest.cmap.*12 of them cached"):
        prefill.add("b", B[:16], GREEDY, dest)
    with pytest.raises(ValueError, match="prompt_token_ids.*expected 3 ids.*got 2"):
        decode.reserve("c", 3, GREEDY, prompt_token_ids=[1, 2])
    decode.cancel_reservation(dest)
    while decode.has_work():
        decode.step()
    assert_all_free(decode)
