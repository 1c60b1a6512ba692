"""Reservations answered while a decode engine's forward is on the GPU (`StepLoop.while_gpu_runs`,
`scheduler.overlap_reservations`): a real decode engine (dummy:tiny, CPU, two-PE shm heap) on its
step loop, its forward's readiness held open by the test, as a long GPU step would hold it.
"""

from __future__ import annotations

import threading

import pytest
from engine_helpers import assert_all_free, close_heaps, collective
from test_disagg import FakeClock

from disagg.cluster.launch.step_loop import StepLoop
from disagg.engine import DecodeEngine, EngineOptions, PrefillEngine
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap

LONG = SamplingParams(max_tokens=150, ignore_eos=True)


@pytest.fixture
def decode_loop(tiny_model, torch_reference):
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=1 << 20,
                                              num_signals=16, timeout_s=10.0) for r in range(2)])
    sizes = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    prefill, decode = collective([lambda: PrefillEngine(tiny_model, heaps[0], **sizes),
                                  lambda: DecodeEngine(tiny_model, heaps[1], **sizes, options=EngineOptions(
                                      lease_s=30.0, clock=FakeClock()))])
    loop = StepLoop("decode-0")
    yield loop, decode
    loop.stop()
    close_heaps(uid, heaps)


def test_a_reservation_runs_while_the_forward_is_out_and_queue_order_holds(decode_loop):
    loop, engine = decode_loop
    gpu_done, waiting = threading.Event(), threading.Event()

    def hold_the_forward(is_ready):  # the step's ids "arrive" only when the test says so
        waiting.set()
        loop.while_gpu_runs(lambda: is_ready() and gpu_done.is_set())

    engine.on_gpu_wait = hold_the_forward
    loop.call(setattr, loop, "engine", engine).result(5)
    loop.call(engine.add, "busy", [5, 9, 17, 3], LONG).result(5)  # a local request: the loop keeps stepping
    assert waiting.wait(5)  # a step is inside its forward now, and stays there

    reserved = loop.call_mid_step(engine.reserve, "r1", 8, SamplingParams(max_tokens=4)).result(5)
    assert reserved.request_id == "r1" and not gpu_done.is_set() and loop.num_mid_step_calls == 1
    between = loop.call(engine.stats)  # an ordinary call waits for the step to end ...
    after = loop.call_mid_step(engine.reserve, "r2", 8, SamplingParams(max_tokens=4))  # ... and so does one behind it
    assert not between.done() and not after.done()
    assert loop.num_mid_step_calls == 1

    gpu_done.set()
    assert between.result(5)["running"] >= 1 and after.result(5).request_id == "r2"
    engine.on_gpu_wait = None
    for rid, dest in (("r1", reserved), ("r2", after.result())):
        loop.call(engine.cancel_reservation, dest).result(5)
    loop.call(engine.abort, "busy").result(5)
    loop.call(lambda: None).result(5)
    assert loop.fatal is None
    assert loop.call(lambda: (engine.has_work(), engine.stats()["free_pages"])).result(5)[1] == 64
    assert_all_free(engine)


def test_without_the_hook_a_reservation_waits_for_the_step(decode_loop):
    """`scheduler.overlap_reservations` off: the engine has no `on_gpu_wait`, so a
    mid-step call runs between steps like any other."""
    loop, engine = decode_loop
    assert engine.on_gpu_wait is None
    loop.call(setattr, loop, "engine", engine).result(5)
    loop.call(engine.add, "busy", [5, 9, 17, 3], SamplingParams(max_tokens=8, ignore_eos=True)).result(5)
    dest = loop.call_mid_step(engine.reserve, "r1", 8, SamplingParams(max_tokens=4)).result(5)
    assert dest.request_id == "r1" and loop.num_mid_step_calls == 0
    loop.call(engine.cancel_reservation, dest).result(5)
