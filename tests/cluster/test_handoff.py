"""`Handoff`: the router's deltas reach a caller's loop once per router loop turn, in order."""

from __future__ import annotations

import asyncio
import threading

import pytest

from disagg.cluster.cluster import Handoff


@pytest.fixture
def loops():
    router_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=router_loop.run_forever, daemon=True)
    thread.start()
    caller_loop = asyncio.new_event_loop()
    yield router_loop, caller_loop
    router_loop.call_soon_threadsafe(router_loop.stop)
    thread.join(5)
    router_loop.close()
    if not caller_loop.is_closed():
        caller_loop.close()


def test_one_router_turns_deltas_cross_in_one_call_and_in_order(loops):
    router_loop, caller_loop = loops
    handoff, queues = Handoff(router_loop, caller_loop), [asyncio.Queue() for _ in range(3)]
    crossings = []
    threadsafe = caller_loop.call_soon_threadsafe
    caller_loop.call_soon_threadsafe = lambda *a: (crossings.append(a), threadsafe(*a))[1]

    def batch(first: int) -> None:  # one engine batch: 2 deltas to each of 3 requests
        for n in range(first, first + 2):
            for queue in queues:
                handoff.put(queue, n)

    async def read_all() -> list[list[int]]:
        router_loop.call_soon_threadsafe(batch, 0)
        got = [[await q.get() for _ in range(2)] for q in queues]
        router_loop.call_soon_threadsafe(batch, 2)
        return [g + [await q.get() for _ in range(2)] for g, q in zip(got, queues)]

    assert caller_loop.run_until_complete(asyncio.wait_for(read_all(), 5)) == [[0, 1, 2, 3]] * 3
    assert len(crossings) == 2  # one per router turn, not one per delta (12)


def test_a_closed_caller_loop_refuses_at_once(loops):
    router_loop, caller_loop = loops
    handoff = Handoff(router_loop, caller_loop)
    caller_loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        handoff.put(asyncio.Queue(), 1)
