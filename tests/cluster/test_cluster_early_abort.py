"""An abort that reaches the router before its request's submit is not lost (tiny-1p1d, CPU actors).

`Cluster.abort(rid)` sent before `stream(..., request_id=rid)` ran its submit on the router's
loop: the router remembers it, and that submit ends at once as aborted, with no token and
nothing sent to an engine. The remembered abort is used once: a later request reusing the id
runs; an abort that comes after its request ended is dropped and kills no later request with
the id. To order things exactly, the router's loop is held (`cluster_helpers.hold_router_loop`)
while the caller's calls queue up behind it.
"""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import hold_router_loop, launch, reference_tokens, wait_all_free

from disagg.cluster.cluster import _async
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 9, 13, 17, 21, 25]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_local):
    cluster = launch("tiny-1p1d")
    yield cluster
    cluster.shutdown()


@pytest.fixture(autouse=True)
def pages_free_after(cluster):
    yield
    wait_all_free(cluster, timeout_s=15)


async def _collect(stream) -> tuple[list[int], object]:
    tokens, last = [], None
    async for delta in stream:
        tokens.extend(delta.token_ids)
        last = delta
    return tokens, last


def _num_forwards(cluster) -> int:
    return sum(i["num_forwards"] for i in cluster.stats()["instances"])


def test_abort_right_after_the_stream_started_is_not_lost(cluster):
    async def run():
        stream = cluster.stream(PROMPT, PARAMS, request_id="started")
        with hold_router_loop(cluster):
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.2)  # the stream sent its submit; the router has not run it
            assert not first.done()
            cluster.abort("started")
        delta = await first
        tokens, last = await _collect(stream)
        return delta, tokens, last

    before = cluster.router_stats()["counts"].get("abort", 0)
    delta, tokens, last = asyncio.run(run())
    assert delta.finished and delta.finish_reason == "abort" and delta.error is None, delta
    assert delta.token_ids == [] and tokens == [] and last is None
    assert cluster.router_stats()["counts"]["abort"] == before + 1


def test_stream_cancelled_before_its_submit_ran_leaves_nothing(cluster):
    """The submit is dropped (its future was cancelled first) and no abort is left remembered:
    the id runs normally right after."""
    (want,) = reference_tokens([PROMPT], [PARAMS.max_tokens])

    async def run():
        with hold_router_loop(cluster):
            first = asyncio.ensure_future(cluster.stream(PROMPT, PARAMS, request_id="cancelled").__anext__())
            await asyncio.sleep(0.2)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        return await _collect(cluster.stream(PROMPT, PARAMS, request_id="cancelled"))

    submitted = cluster.router_stats()["counts"]["submitted"]
    tokens, last = asyncio.run(run())
    assert (last.finish_reason, tokens) == ("length", want), last
    assert cluster.router_stats()["counts"]["submitted"] == submitted + 1  # the cancelled one never was
    assert cluster._call(_async(lambda: len(cluster._router.early_aborts))) == 0


def test_remembered_abort_is_used_once_and_late_aborts_are_dropped(cluster):
    (want,) = reference_tokens([PROMPT], [PARAMS.max_tokens])
    forwards = _num_forwards(cluster)

    async def run():
        stream = cluster.stream(PROMPT, PARAMS, request_id="reused")  # nothing sent until iterated
        cluster.abort("reused")  # reaches the router before the submit: remembered
        aborted = await _collect(stream)
        assert _num_forwards(cluster) == forwards  # nothing reached an engine
        again = await _collect(cluster.stream(PROMPT, PARAMS, request_id="reused"))  # the abort was used
        cluster.abort("reused")  # late: that request ended
        after_late = await _collect(cluster.stream(PROMPT, PARAMS, request_id="reused"))
        return aborted, again, after_late

    (tokens, last), again, after_late = asyncio.run(run())
    assert tokens == [] and last.finished and last.finish_reason == "abort", last
    for got, end in (again, after_late):
        assert (end.finish_reason, end.error) == ("length", None) and got == want, (end, got)
    remembered = cluster._call(_async(lambda: len(cluster._router.early_aborts)))  # read on the router's loop
    assert remembered == 0

