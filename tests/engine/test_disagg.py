"""PrefillEngine + DecodeEngine in one process over a two-PE shm heap (dummy:tiny, CPU): tokens equal
the full-recompute loop with prompts chunked across forwards; admission only after the doorbell;
leases, quarantine and aborts at every stage free every page; bad inputs are refused."""

from __future__ import annotations

import pytest
from engine_helpers import FakeClock, assert_all_free, close_heaps, collective, reference_tokens

from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine
from disagg.errors import OutOfPages
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap

PROMPTS = {"a": [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21], "b": [42], "c": [150, 151, 3, 4, 90, 12, 8]}
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
NUM_PAGES, PAGE_SIZE = 24, 4


@pytest.fixture(params=[(False, "graphs"), (True, "graphs"), (True, "always")],
                ids=["sync", "async", "async-push-after"])
def engines(tiny_model, torch_reference, request):
    """(prefill on PE 0, decode on PE 1, the decode engine's lease clock); heaps closed after.
    Every test runs with the decode engine's async scheduling off and on, and once with the
    prefill engine pushing after each forward (`transfer.push_after: always`, the path of the
    forwards a whole-forward CUDA graph runs; "graphs" on the CPU pushes layer by layer)."""
    async_scheduling, push_after = request.param
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                              num_signals=16, timeout_s=10.0) for r in range(2)])
    clock = FakeClock()
    sizes = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=4)
    prefill, decode = collective([
        lambda: PrefillEngine(tiny_model, heaps[0], max_num_batched_tokens=5, **sizes,
                              options=EngineOptions(use_cuda_graphs=False, push_after=push_after)),
        lambda: DecodeEngine(tiny_model, heaps[1], **sizes, options=EngineOptions(
            lease_s=5.0, clock=clock, async_scheduling=async_scheduling))])
    yield prefill, decode, clock
    close_heaps(uid, heaps)


@pytest.fixture(scope="module")
def expected(tiny_model):
    return reference_tokens(tiny_model, PROMPTS, GREEDY.max_tokens)


def run(prefill, decode, max_steps: int = 200, until_done: list | None = None) -> dict:
    """Relay first tokens from prefill to decode (as the router does) until both are idle (or
    the requests of ``until_done`` finished)."""
    results: dict = {}
    for _ in range(max_steps):
        if until_done and all(results.get(r) and results[r][-1].finished for r in until_done):
            return results
        if not (prefill.has_work() or decode.has_work()):
            return results
        for out in prefill.step():
            results.setdefault(out.request_id, []).append(out)
            if out.token_id is not None and out.request_id in decode.requests:  # not aborted there
                decode.start(out.request_id, out.token_id)
        for out in decode.step():
            results.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"still busy: {prefill.stats()} {decode.stats()}")


def send(prefill, decode, rid, params=GREEDY, prompt=None):
    prompt = PROMPTS[rid] if prompt is None else prompt
    prefill.add(rid, prompt, params, decode.reserve(rid, len(prompt), params))


def test_tokens_equal_full_recompute(engines, expected):
    prefill, decode, _ = engines
    for rid in PROMPTS:
        send(prefill, decode, rid)
    results = run(prefill, decode)
    for rid in PROMPTS:
        assert [o.token_id for o in results[rid]] == expected[rid], rid
        assert results[rid][-1].finish_reason == "length"
    assert prefill.runner.num_forwards >= 4  # 19 prompt tokens, 5 per forward: "a" was chunked
    pushed_after = prefill.runner.num_pushes_after
    assert pushed_after == (prefill.runner.num_forwards if prefill.runner.push_after == "always" else 0)
    assert_all_free(prefill)
    assert_all_free(decode)
    assert decode.stats()["committed_pages"] == 0


def test_push_and_doorbell_counters_move(engines, expected):
    prefill, decode, clock = engines
    assert (prefill.stats()["pushed_bytes"], decode.stats()["num_doorbells_rung"]) == (0, 0)
    send(prefill, decode, "a")
    send(prefill, decode, "b")
    clock.now = 1.5  # on the lease clock, both reservations wait 1.5 s before a step sees their rings
    results = run(prefill, decode)
    assert [o.token_id for o in results["a"]] == expected["a"]
    kv = prefill.kv  # [L, N, 2, H, P, D]: one token is L * 2 * H * D elements
    token_bytes = kv.element_size() * kv[:, 0].numel() // PAGE_SIZE
    stats = prefill.stats()
    assert stats["pushed_bytes"] == (len(PROMPTS["a"]) + len(PROMPTS["b"])) * token_bytes
    assert stats["push_s"] > 0 and stats["push_gbps"] == pytest.approx(stats["pushed_bytes"] / stats["push_s"] / 1e9)
    stats = decode.stats()
    assert stats["num_doorbells_rung"] == 2 and stats["doorbell_wait_s"] == pytest.approx(3.0)
    assert stats["num_preemptions"] == prefill.stats()["num_preemptions"] == 0


def test_decode_admits_only_after_the_doorbell(engines, expected):
    prefill, decode, _ = engines
    dest = decode.reserve("a", len(PROMPTS["a"]), GREEDY)
    decode.start("a", expected["a"][0])  # the router may be early: nothing runs before the ring
    assert decode.step() == [] and decode.stats()["running"] == 0
    prefill.add("a", PROMPTS["a"], GREEDY, dest)
    prefill.step()  # 5 of 11 tokens pushed: not rung yet
    assert decode.step() == [] and decode.stats()["running"] == 0
    outputs = prefill.step() + prefill.step()
    assert [o.token_id for o in outputs] == expected["a"][:1]
    assert [o.token_id for o in decode.step()] == expected["a"][1:2]
    run(prefill, decode)
    assert_all_free(prefill)
    assert_all_free(decode)


def test_lease_expiry_fails_the_request_and_frees_pages(engines):
    prefill, decode, clock = engines
    decode.reserve("lost", 9, GREEDY)
    decode.start("lost", 3)
    assert decode.stats()["free_pages"] < NUM_PAGES
    clock.now = 4.9
    assert decode.step() == []
    clock.now = 5.0
    (out,) = decode.step()
    assert (out.request_id, out.token_id, out.finished, out.finish_reason) == ("lost", None, True, "error")
    assert "lease expired" in out.error
    assert not decode.has_work()
    assert_all_free(decode)


def test_abort_before_the_ring_quarantines_pages_until_it(engines):
    prefill, decode, clock = engines
    send(prefill, decode, "a")
    assert decode.abort("a")
    assert decode.stats()["quarantined"] == 1 and decode.stats()["free_pages"] < NUM_PAGES
    decode.step()
    assert decode.stats()["free_pages"] < NUM_PAGES  # the sender may still write them
    run(prefill, decode)  # the push completes and rings: the quarantine ends
    assert decode.stats()["quarantined"] == 0
    assert_all_free(prefill)
    assert_all_free(decode)
    # A quarantine whose sender never rings ends at the lease deadline, silently.
    decode.reserve("b", 1, GREEDY)
    decode.abort("b")
    clock.now += 5.0
    assert [o.finish_reason for o in decode.step()] == ["abort"]
    assert_all_free(decode)


def test_abort_at_every_stage(engines, expected):
    prefill, decode, clock = engines
    for rid in PROMPTS:
        send(prefill, decode, rid)
    send(prefill, decode, "queued", prompt=[1, 2, 3])
    assert prefill.abort("queued") and decode.abort("queued")  # before any push
    prefill.step()  # "a" mid-prompt (5 of 11 pushed)
    assert prefill.abort("a") and decode.abort("a")  # mid-push: decode quarantines
    for _ in range(4):
        for out in prefill.step():
            if out.token_id is not None:
                decode.start(out.request_id, out.token_id)
        decode.step()
    assert decode.abort("b")  # mid-decode
    assert not decode.abort("b") and not prefill.abort("b")
    clock.now += 5.0  # the lease of "a" (never rung) ends
    rest = run(prefill, decode)
    assert [o.token_id for o in rest["c"]][-1] == expected["c"][-1]
    assert_all_free(prefill)
    assert_all_free(decode)


def test_first_token_that_ends_the_request(engines, expected):
    prefill, decode, _ = engines
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    send(prefill, decode, "c", params=one)
    results = run(prefill, decode)
    assert [(o.token_id, o.finish_reason) for o in results["c"]] == [(expected["c"][0], "length")]
    assert_all_free(prefill)
    assert_all_free(decode)


def test_out_of_pages_at_reserve_changes_nothing(engines):
    prefill, decode, clock = engines
    decode.reserve("big", 60, SamplingParams(max_tokens=20))  # 20 of 24 pages committed
    before = decode.stats()
    with pytest.raises(OutOfPages, match="needs 6 pages"):
        decode.reserve("next", 10, SamplingParams(max_tokens=12))
    assert decode.stats() == before
    decode.abort("big")  # quarantined: the 15 pages its push may still write stay taken until
    # the lease ends; its promise of 5 more pages for decoding is void at once
    with pytest.raises(OutOfPages, match="needs 10 pages.*9 are free"):
        decode.reserve("next", 30, SamplingParams(max_tokens=10))
    assert decode.reserve("next", 10, SamplingParams(max_tokens=12)).request_id == "next"
    clock.now += 5.0
    decode.step()
    assert decode.stats()["free_pages"] == 24  # both leases expired: every page is back


@pytest.mark.parametrize("call,kind,match", [
    (lambda p, d: d.reserve("x", 0, GREEDY), ValueError, "prompt_len.*got 0"),
    (lambda p, d: d.reserve("x", 4096, GREEDY), ValueError, "prompt_len"),
    (lambda p, d: d.reserve("x", 3, SamplingParams(top_k=-1)), ValueError, "top_k"),
    (lambda p, d: d.reserve("x", 3, SamplingParams(max_tokens=200)), ValueError, "max_tokens.*pages"),
    (lambda p, d: d.reserve("a", 3, GREEDY), ValueError, "already in this engine"),
    (lambda p, d: d.start("nope", 3), ValueError, "no reservation"),
    (lambda p, d: d.start("a", 999), ValueError, "first_token_id"),
    (lambda p, d: p.add("x", [1, 2], GREEDY, d.reserve("x", 3, GREEDY)), ValueError, "dest.cmap.*got 3"),
    (lambda p, d: p.add("y", [1, 2], GREEDY, {"cmap": [1, 0, 2]}), TypeError, "dest"),
    (lambda p, d: p.add("x", [], GREEDY, None), ValueError, "prompt_token_ids"),
])
def test_bad_input_is_refused_and_others_keep_running(engines, expected, call, kind, match):
    prefill, decode, clock = engines
    send(prefill, decode, "a")
    with pytest.raises(kind, match=match):
        call(prefill, decode)
    decode.abort("x")  # a reservation the failed add left behind is the router's to drop
    results = run(prefill, decode, until_done=["a"])
    assert [o.token_id for o in results["a"]] == expected["a"]
    clock.now += 5.0  # the lease of the quarantined "x" ends
    decode.step()
    assert_all_free(prefill)
    assert_all_free(decode)


def test_warmup_then_serve(engines, expected):
    prefill, decode, _ = engines
    assert prefill.warmup()["prefill"] > 0 and decode.warmup()["decode"] > 0
    assert_all_free(prefill)
    assert_all_free(decode)
    send(prefill, decode, "c")
    assert [o.token_id for o in run(prefill, decode)["c"]] == expected["c"]
