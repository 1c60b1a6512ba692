"""One engine core, every request state on every instance (dummy:tiny, CPU, two-PE shm heap).

A decode engine prefills local requests beside received ones (the "local" placement); a prefill
engine keeps a request and decodes it itself (the "kept" placement) beside prompts it pushes
("remote"). Tokens equal the full-recompute reference; under page pressure only local requests
are preempted (a received or pushed one never is); every page is free at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_all_free, close_heaps, collective, reference_tokens
from test_disagg import FakeClock

from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine
from disagg.engine.request import PushState, pages_for
from disagg.engine.scheduler import Scheduler
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap
from disagg.transfer.shm_heap import shm_leftovers

PROMPTS = {"r1": [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21], "l1": [42, 7, 7], "l2": [150, 151, 3, 4, 90, 12, 8],
           "k1": [11, 12, 13, 14, 15, 16, 17, 18, 19], "r2": [3, 1, 4, 1, 5, 9, 2, 6], "l3": [99]}
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PAGE_SIZE = 4
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def make_engines(tiny_model, num_pages: int, async_scheduling: bool):
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                              num_signals=16, timeout_s=10.0) for r in range(2)])
    sizes = dict(num_pages=num_pages, page_size=PAGE_SIZE, max_num_seqs=4)
    prefill, decode = collective([
        lambda: PrefillEngine(tiny_model, heaps[0], max_num_batched_tokens=6, **sizes),
        lambda: DecodeEngine(tiny_model, heaps[1], max_num_batched_tokens=6, **sizes, options=EngineOptions(
            lease_s=5.0, clock=FakeClock(), async_scheduling=async_scheduling))])
    return uid, heaps, prefill, decode


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def engines(tiny_model, torch_reference, request):
    uid, heaps, prefill, decode = make_engines(tiny_model, 24, request.param)
    yield prefill, decode
    close_heaps(uid, heaps)


@pytest.fixture(scope="module")
def expected(tiny_model):
    return reference_tokens(tiny_model, PROMPTS, GREEDY.max_tokens)


def relay(prefill, decode, max_steps: int = 400) -> dict:
    """Step both engines, handing first tokens of pushed prompts to the decode side."""
    results: dict = {}
    for _ in range(max_steps):
        if not (prefill.has_work() or decode.has_work()):
            return results
        for out in prefill.step():
            results.setdefault(out.request_id, []).append(out)
            if out.request_id in decode.requests and out.token_id is not None:
                decode.start(out.request_id, out.token_id)
        for out in decode.step():
            results.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"still busy: {prefill.stats()} {decode.stats()}")


def tokens(results: dict) -> dict:
    return {rid: [o.token_id for o in outs if o.token_id is not None] for rid, outs in results.items()}


def remote(prefill, decode, rid):
    prompt = PROMPTS[rid]
    prefill.add(rid, prompt, GREEDY, decode.reserve(rid, len(prompt), GREEDY))


def test_every_placement_on_two_engines_equals_the_reference(engines, expected):
    prefill, decode = engines
    remote(prefill, decode, "r1")
    decode.add("l1", PROMPTS["l1"], GREEDY)       # local: the decode engine prefills it
    prefill.add("k1", PROMPTS["k1"], GREEDY, None)  # kept: the prefill engine decodes it
    decode.add("l2", PROMPTS["l2"], GREEDY)
    remote(prefill, decode, "r2")
    decode.add("l3", PROMPTS["l3"], GREEDY)
    got = tokens(relay(prefill, decode))
    assert got == expected
    assert prefill.stats()["pushed_bytes"] == (len(PROMPTS["r1"]) + len(PROMPTS["r2"])) * prefill.token_bytes
    assert_all_free(prefill)
    assert_all_free(decode)


def test_page_pressure_preempts_local_requests_only(tiny_model, torch_reference, expected):
    """10 pages of 4 tokens: a received request's 17 tokens (5 pages) are promised before it
    lands; local requests run in what is left and are preempted (recomputed) when they outgrow it."""
    uid, heaps, prefill, decode = make_engines(tiny_model, 10, async_scheduling=True)
    try:
        remote(prefill, decode, "r1")
        for rid in ("l1", "l2", "l3"):
            decode.add(rid, PROMPTS[rid], GREEDY)
        seen_preemption = False
        results: dict = {}
        for _ in range(400):
            if not (prefill.has_work() or decode.has_work()):
                break
            for out in prefill.step():
                results.setdefault(out.request_id, []).append(out)
                decode.start(out.request_id, out.token_id)
            for out in decode.step():
                results.setdefault(out.request_id, []).append(out)
            decode.cache.check_integrity()
            assert decode.scheduler.free_pages() >= 0, "promised pages were handed to local requests"
            seen_preemption |= decode.stats()["num_preemptions"] > 0
        assert tokens(results) == {rid: expected[rid] for rid in ("r1", "l1", "l2", "l3")}
        assert seen_preemption, "the cache was not tight enough to preempt"
        assert_all_free(prefill)
        assert_all_free(decode)
    finally:
        for heap in heaps:
            heap.close()
    assert shm_leftovers(uid) == []


@pytest.fixture
def fresh_promises(monkeypatch):
    """Every `Scheduler.outstanding_pages` read checked against a count made afresh (its count
    is kept per cache version: a promise changed without a cache call must drop it)."""
    kept = Scheduler.outstanding_pages

    def checked(self) -> int:
        size = self.cache.page_size
        fresh = sum(max(0, r.committed_pages - pages_for(self.cache.seq_length(r.seq_id), size))
                    for r in self.committed.values())
        assert kept(self) == fresh, f"outstanding pages kept {kept(self)}, counted afresh {fresh}"
        return fresh

    monkeypatch.setattr(Scheduler, "outstanding_pages", checked)


def test_aborts_in_every_state_free_every_page(engines, fresh_promises):
    prefill, decode = engines
    dest = decode.reserve("r1", len(PROMPTS["r1"]), GREEDY)
    prefill.add("r1", PROMPTS["r1"], GREEDY, dest)
    decode.add("l1", PROMPTS["l1"], GREEDY)
    prefill.add("k1", PROMPTS["k1"], GREEDY, None)
    prefill.step()
    decode.step()
    assert prefill.abort("k1") is PushState.QUIESCED  # a kept request never pushed
    assert decode.abort("l1")
    assert prefill.abort("r1") is PushState.QUIESCED  # CPU: its pushes ran inline
    promised = decode.scheduler.outstanding_pages()
    assert decode.abort("r1") and decode.stats()["quarantined"] == 1  # until the prefill side's word
    assert decode.scheduler.outstanding_pages() < promised  # it draws no more pages
    decode.cancel_reservation(dest)
    ended = [(o.request_id, o.finish_reason) for o in prefill.step() + decode.step()]
    assert sorted(ended) == [("k1", "abort"), ("l1", "abort"), ("r1", "abort"), ("r1", "abort")]  # both sides
    assert prefill.abort("k1") is None and not decode.abort("l1")
    assert not (prefill.has_work() or decode.has_work())
    assert_all_free(prefill)
    assert_all_free(decode)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_scheduler_settings_reach_a_prefill_engine_that_keeps_requests(tiny_model, torch_reference,
                                                                          async_scheduling):
    """`scheduler.async_scheduling` (and `async_prompts`) reach every role `make_engine` builds: a
    prefill instance decodes the requests the adaptive router keeps there, and launched its
    decode steps ahead whatever the setting said."""
    from disagg.cluster.launch.engines import make_engine
    from disagg.config import Config

    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml").override({
        "router.placement": "adaptive", "scheduler.async_scheduling": async_scheduling,
        "scheduler.async_prompts": async_scheduling, "cache.page_size": PAGE_SIZE})
    uid = new_unique_id("shm")
    heap = open_heap("shm", uid=uid, rank=0, world_size=1, size_bytes=1 << 20, num_signals=16, timeout_s=10.0)
    try:
        prefill = make_engine("prefill", tiny_model, heap, 24, config)
        assert (prefill.async_scheduling, prefill.async_prompts) == (async_scheduling, async_scheduling)
        prefill.add("k1", PROMPTS["k1"], GREEDY, None)  # kept: it decodes here
        tokens = []
        while prefill.has_work():
            tokens += [out.token_id for out in prefill.step() if out.token_id is not None]
        assert len(tokens) == GREEDY.max_tokens
        assert (prefill.num_steps_ahead > 0) is async_scheduling
    finally:
        close_heaps(uid, [heap])
