"""`RequestState`: the request's pipeline state and the transitions between them (CPU)."""

from __future__ import annotations

import pytest

from disagg.engine.request import RecvDest, RequestFactory, RequestState
from disagg.sampling import SamplingParams

S = RequestState


def new(**kw):
    return RequestFactory(()).new("r", [1, 2, 3], SamplingParams(max_tokens=4), **kw)


def flags(req) -> tuple:
    return req.state, req.in_cache, req.decoding, req.sending


def test_a_local_request_prefills_decodes_and_is_preempted():
    req = new()
    assert flags(req) == (S.WAITING, False, False, False)
    req.enter_cache(2)
    assert flags(req) == (S.PREFILLING, True, False, False) and req.num_computed == req.num_cached_tokens == 2
    req.start_decoding()
    assert flags(req) == (S.DECODING, True, True, False)
    req.leave_cache()  # preempted
    assert flags(req) == (S.WAITING, False, False, False) and req.num_computed == 0
    req.enter_cache(0)
    assert req.state is S.PREFILLING


def test_a_pushed_request_sends_and_a_received_one_decodes():
    pushed = new()
    pushed.dest = RecvDest("r", [1, 0, 3], pe=1, ticket=0)
    pushed.enter_cache(0)
    pushed.start_sending()
    assert flags(pushed) == (S.PUSHING, True, False, True) and not pushed.preemptible
    received = new()
    received.receive(3, 0, committed_pages=2, prompt_known=False)
    assert flags(received) == (S.RECEIVING, True, False, False)
    assert received.received and received.committed_pages == 2 and not received.prompt_known
    received.start_decoding()
    assert received.state is S.DECODING and received.received and not received.preemptible


@pytest.mark.parametrize("move", [
    lambda r: r.start_decoding(),           # WAITING -> DECODING
    lambda r: r.start_sending(),            # not pushed, not in the cache
    lambda r: (r.enter_cache(0), r.enter_cache(0)),
    lambda r: (r.enter_cache(0), r.start_decoding(), r.receive(3, 0, committed_pages=1, prompt_known=True)),
])
def test_no_other_transition(move):
    with pytest.raises(AssertionError, match="is no transition|only a pushed request"):
        move(new())
