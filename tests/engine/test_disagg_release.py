"""Decode pages come back as soon as no sender can write them, never earlier (dummy:tiny, CPU,
PrefillEngine on PE 0 and DecodeEngine on PE 1 of a two-PE shm heap, one process).

`PrefillEngine.abort` says whether a push of the request may still land (`PushState`);
`DecodeEngine.cancel_reservation` frees a reservation at once on the caller's word. The lease
clock never moves in these tests: every page freed here is freed long before a lease would end.
"""

from __future__ import annotations

import pytest
from engine_helpers import assert_all_free, close_heaps, collective, reference_greedy

from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine, PushState
from disagg.errors import OutOfPages
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap

PROMPTS = {"a": [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21], "c": [150, 151, 3, 4, 90, 12, 8]}
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
NUM_PAGES, PAGE_SIZE = 24, 4
ALL_PAGES = SamplingParams(max_tokens=NUM_PAGES * PAGE_SIZE - 8, ignore_eos=True)  # 8-token prompt


class FrozenClock:
    """The decode engine's lease clock: it never reaches a deadline here."""

    def __call__(self) -> float:
        return 0.0


class FakeFence:
    """Stands for the CUDA event after an aborted request's in-flight pushes (CPU pushes run inline)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def engines(tiny_model, torch_reference):
    """(prefill on PE 0, decode on PE 1) with a 5-token prefill budget; heaps closed after."""
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                              num_signals=16, timeout_s=10.0) for r in range(2)])
    sizes = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=4)
    prefill, decode = collective([
        lambda: PrefillEngine(tiny_model, heaps[0], max_num_batched_tokens=5, **sizes),
        lambda: DecodeEngine(tiny_model, heaps[1], **sizes,
                             options=EngineOptions(lease_s=60.0, clock=FrozenClock()))])
    yield prefill, decode
    close_heaps(uid, heaps)


def send(prefill, decode, rid):
    dest = decode.reserve(rid, len(PROMPTS[rid]), GREEDY)
    prefill.add(rid, PROMPTS[rid], GREEDY, dest)
    return dest


def serve(prefill, decode, rid, prompt) -> list[int]:
    """Run one request to the end (the router's relay of the first token); return its tokens."""
    prefill.add(rid, prompt, GREEDY, decode.reserve(rid, len(prompt), GREEDY))
    tokens = []
    for _ in range(100):
        for out in prefill.step():
            if out.request_id == rid and out.token_id is not None:
                decode.start(rid, out.token_id)
                tokens.append(out.token_id)
        for out in decode.step():
            if out.request_id == rid:
                tokens.append(out.token_id)
                if out.finished:
                    return tokens
    raise AssertionError(f"request {rid!r} did not finish: {prefill.stats()} {decode.stats()}")


def test_refused_add_frees_the_reservation_at_once(engines):
    prefill, decode = engines
    dest = decode.reserve("x", 3, GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        prefill.add("x", [1, 2, 10**6], GREEDY, dest)  # a token id outside the vocabulary
    decode.cancel_reservation(dest)  # the prefill side never took it: no sender
    assert [(o.request_id, o.token_id, o.finish_reason) for o in decode.step()] == [("x", None, "abort")]
    assert decode.stats()["num_reservations_cancelled"] == 1 and len(decode.receiver) == 0
    assert decode.receiver.num_armed == 0
    assert not decode.has_work()
    assert_all_free(decode)


def test_abort_before_any_push_is_quiesced(engines, tiny_model):
    prefill, decode = engines
    dests = {rid: send(prefill, decode, rid) for rid in ("a", "c")}
    assert prefill.abort("c") is PushState.QUIESCED  # queued
    dests["q"] = decode.reserve("q", 3, GREEDY)
    prefill.add("q", [1, 2, 3], GREEDY, dests["q"])
    ended = [o.request_id for o in prefill.step()]  # "a" takes the whole 5-token budget:
    assert ended == ["c"]                            # "q" waits (it enters the cache when scheduled)
    stats = prefill.stats()
    assert (stats["running"], stats["waiting"], stats["pushed_bytes"]) == (1, 1, 5 * prefill.token_bytes)
    assert prefill.abort("q") is PushState.QUIESCED
    for rid in ("c", "q"):
        assert decode.abort(rid)  # quarantined, as the router does first
        decode.cancel_reservation(dests[rid])  # then freed on the prefill side's word
    assert decode.stats()["quarantined"] == 0
    assert [(o.request_id, o.finish_reason) for o in prefill.step() if o.token_id is None] == [("q", "abort")]
    # Mid-prompt on the CPU: the forward that pushed 5 of its 11 tokens has completed.
    assert prefill.abort("a") is PushState.QUIESCED
    decode.cancel_reservation(dests["a"])  # a live reservation: it ends here too
    assert [(o.request_id, o.finish_reason) for o in decode.step()] == [(r, "abort") for r in ("c", "q", "a")]
    assert_all_free(decode)
    assert decode.receiver.num_armed == 0
    # The freed pages serve the next request correctly.
    assert serve(prefill, decode, "a2", PROMPTS["a"]) == reference_greedy(tiny_model, PROMPTS["a"], 6)
    assert_all_free(prefill)
    assert_all_free(decode)


def test_abort_mid_push_keeps_pages_until_the_forward_completed(engines, monkeypatch):
    prefill, decode = engines
    dest = send(prefill, decode, "a")
    prefill.step()  # 5 of 11 tokens pushed into decode's pages
    fence = FakeFence()  # that forward's transfers have not completed (as on a GPU)
    monkeypatch.setattr(prefill.sender, "fence", lambda: fence)
    assert prefill.abort("a") is PushState.IN_FLIGHT
    assert decode.abort("a") and decode.stats()["quarantined"] == 1
    with pytest.raises(ValueError, match="may still be in flight"):
        prefill.add("a", PROMPTS["a"], GREEDY, dest)
    for _ in range(3):
        assert prefill.step() == [] and prefill.has_work()  # no word on "a" while it may land
        decode.step()
        with pytest.raises(OutOfPages):  # a page is never handed out while a push may land on it
            decode.reserve("next", 8, ALL_PAGES)
    assert prefill.stats()["quiescing"] == 1
    fence.done = True
    assert [(o.request_id, o.token_id, o.finish_reason) for o in prefill.step()] == [("a", None, "abort")]
    assert prefill.stats()["quiescing"] == 0 and not prefill.has_work()
    decode.cancel_reservation(dest)
    nxt = decode.reserve("next", 8, ALL_PAGES)  # every page, at once
    decode.cancel_reservation(nxt)
    assert_all_free(decode)
    assert_all_free(prefill)


@pytest.mark.parametrize("case", ["unknown", "rung", "reserved_again", "not_a_dest"])
def test_cancel_reservation_misuse_is_refused_and_changes_nothing(engines, case):
    prefill, decode = engines
    if case == "unknown":
        dest, kind, match = decode.reserve("x", 3, GREEDY), ValueError, "no open reservation"
        decode.cancel_reservation(dest)  # freed: a second cancel finds nothing
    elif case == "rung":
        dest, kind, match = send(prefill, decode, "c"), ValueError, "has rung.*call abort"
        prefill.step()
        prefill.step()  # 7 prompt tokens in two forwards: the doorbell rings
        decode.step()
    elif case == "reserved_again":
        old = decode.reserve("x", 3, GREEDY)
        decode.cancel_reservation(old)
        decode.reserve("x", 3, GREEDY)
        dest, kind, match = old, ValueError, "dest.ticket.*earlier reservation"
    else:
        decode.reserve("x", 3, GREEDY)
        dest, kind, match = {"request_id": "x"}, TypeError, "dest: expected the RecvDest"
    before = decode.stats()
    with pytest.raises(kind, match=match):
        decode.cancel_reservation(dest)
    assert decode.stats() == before
