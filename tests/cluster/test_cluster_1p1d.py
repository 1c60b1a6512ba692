"""tiny-1p1d.yaml on two CPU actors over the shm heap: parity with ColocatedEngine, and faults.

One launch for the module (router.lease_s lowered to 2 s so that lease expiries are quick).
After every test, every instance's pages are all free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.errors import QueueFull, RequestRefused, RequestTimedOut, SignalTimeout
from disagg.sampling import SamplingParams

LEASE_S = 2.0


@pytest.fixture(scope="module")
def cluster(ray_local):
    cluster = launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S)
    yield cluster
    cluster.shutdown()


@pytest.fixture(autouse=True)
def pages_free_after(cluster):
    yield
    wait_all_free(cluster, timeout_s=LEASE_S + 15)


def test_launch_reports_the_fleet(cluster):
    stats = cluster.stats()
    assert (stats["mode"], stats["device"], stats["backend"]) == ("disaggregated", "cpu", "shm")
    roles = {inst["name"]: (inst["role"], inst["pe"]) for inst in stats["instances"]}
    assert roles == {"prefill-0": ("prefill", 0), "decode-0": ("decode", 1)}
    assert stats["paths"] == {"0->1": "load/store"}
    assert cluster.model_name == "dummy:tiny" and cluster.tokenizer is None and cluster.healthy
    assert cluster.max_model_len == 4096
    # Every engine warmed up before serving (kernels compiled, decode graphs captured on GPUs).
    warmed = {inst["name"]: sorted(k for k, v in inst["warmup_s"].items() if v > 0) for inst in stats["instances"]}
    assert warmed == {"prefill-0": ["prefill"], "decode-0": ["decode"]}, warmed


def test_router_cpu_is_its_own_thread(cluster):
    """`bench`'s host_cpu: the router thread's CPU seconds exclude the caller's; the process's include them."""
    before = cluster.router_stats()["cpu_s"]
    spin_until = time.thread_time() + 0.3
    while time.thread_time() < spin_until:  # 0.3 s of CPU in this (the caller's) thread, the router idle
        pass
    after = cluster.router_stats()["cpu_s"]
    assert after["process"] - before["process"] >= 0.3
    assert after["router_thread"] - before["router_thread"] < 0.15


def test_24_mixed_requests_match_the_colocated_engine(cluster):
    prompts = mixed_prompts(24, seed=1)
    max_tokens = [1, 2, 5, 16, 31, 9] * 4
    want = reference_tokens(prompts, max_tokens)
    # 8 one after the other, then 16 at once (interleaved on both actors).
    got = [cluster.generate([p], SamplingParams(max_tokens=n))[0] for p, n in zip(prompts[:8], max_tokens[:8])]
    got += cluster.generate(prompts[8:], [SamplingParams(max_tokens=n) for n in max_tokens[8:]])
    for i, (completion, tokens) in enumerate(zip(got, want)):
        assert completion.token_ids == tokens, f"request {i} (prompt {len(prompts[i])} tokens)"
        assert completion.prompt_token_ids == prompts[i]
        assert completion.finish_reason in ("length", "stop") and completion.error is None
        assert completion.text is None
        m = completion.metrics
        assert len(m.token_times) == len(tokens) and m.token_times == sorted(m.token_times)
        assert 0 <= m.ttft_s <= m.e2el_s
        assert (m.prefill_instance, m.decode_instance) == ("prefill-0", "decode-0")


def test_a_shared_prefix_is_computed_and_pushed_once(cluster):
    """Prefix caching on both instances (the default): later requests sharing a 50-token system
    prompt compute only their own tokens and receive only the pages past the decode side's match
    (3 whole pages of 16)."""
    import random

    rng = random.Random(7)
    system = [rng.randrange(3, 256) for _ in range(50)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(5)] for _ in range(3)]
    want = reference_tokens(prompts, [4] * 3)

    def totals() -> dict:
        return {i["name"]: i for i in cluster.stats()["instances"]}

    seen = [totals()]
    for prompt, tokens in zip(prompts, want):
        assert cluster.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids == tokens
        seen.append(totals())
    steps = list(zip(seen, seen[1:]))
    pushed = [after["prefill-0"]["pushed_bytes"] - before["prefill-0"]["pushed_bytes"] for before, after in steps]
    assert pushed[1] == pushed[2] == pushed[0] * (55 - 48) // 55  # 7 of 55 prompt tokens cross
    hits = [{name: after[name]["prefix_hit_tokens"] - before[name]["prefix_hit_tokens"] for name in after}
            for before, after in steps]
    assert hits == [{"prefill-0": 0, "decode-0": 0}] + [{"prefill-0": 50, "decode-0": 48}] * 2


def test_stream_from_other_threads_and_loops(cluster):
    prompts = mixed_prompts(4, seed=2)
    streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    want = reference_tokens(prompts, [12] * 4)
    for stream, tokens in zip(streams, want):
        last = stream.result()
        assert last.finished and last.finish_reason == "length"
        assert stream.token_ids == tokens
        times = [t for d in stream.deltas for t in d.emit_times]
        assert len(times) == len(tokens) and times == sorted(times)
        # The last delta carries the request's metrics (the server's phase histograms read them).
        assert all(d.metrics is None for d in stream.deltas[:-1])
        m = last.metrics
        assert m.arrival_time <= m.dispatch_time <= m.first_token_time <= m.token_times[-1]
        assert m.token_times == times and m.prefill_instance == "prefill-0"


def test_push_that_never_lands_fails_after_the_lease(cluster):
    cluster.instance("prefill-0").actor.drop_next.remote(1)
    failed_before = cluster.router_stats()["failures"].get("signal_timeout", 0)
    start = time.monotonic()
    stream = BackgroundStream(cluster, [5, 6, 7] * 10, SamplingParams(max_tokens=4))
    last = stream.result()
    assert last.finish_reason == "error" and "did not land within" in last.error, last
    assert isinstance(last.cause, SignalTimeout) and (last.cause.src_pe, last.cause.dst_pe) == (0, 1)
    assert cluster.router_stats()["failures"]["signal_timeout"] == failed_before + 1
    assert time.monotonic() - start >= LEASE_S * 0.9
    # The decode pages come back once the decode engine's own lease closes (checked after the test),
    # and the next request runs normally.
    ok = cluster.generate([[9, 9, 9]], SamplingParams(max_tokens=3))[0]
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3


def test_abort_while_prefilling(cluster):
    cluster.instance("prefill-0").actor.drop_next.remote(1)
    stream = BackgroundStream(cluster, list(range(3, 40)), SamplingParams(max_tokens=8), request_id="pre")
    _wait_stage(cluster, "prefilling")
    cluster.abort("pre")
    last = stream.result()
    assert last.finish_reason == "abort" and last.token_ids == []
    # The decode pages stay quarantined until the decode engine's lease closes (no ring comes).
    wait_all_free(cluster, timeout_s=LEASE_S + 3.0)


def test_abort_while_reserving_decode_pages(cluster, ray_local):
    decode = cluster.instance("decode-0").actor
    ray_local.get(decode.stall.remote(60.0))  # from now on its reserve() waits behind the stall
    stream = BackgroundStream(cluster, list(range(3, 30)), SamplingParams(max_tokens=8), request_id="res")
    _wait_stage(cluster, "reserving")
    cluster.abort("res")
    ray_local.get(decode.unstall.remote())
    last = stream.result()
    assert last.finish_reason == "abort" and last.token_ids == []
    # The reservation made after the abort is released (at once: its dest never left the router).
    wait_all_free(cluster, timeout_s=LEASE_S + 4.0)


def test_abort_while_decoding_by_closing_the_stream(cluster):
    stream = BackgroundStream(cluster, list(range(3, 20)), SamplingParams(max_tokens=2000, ignore_eos=True),
                              stop_after=2)
    stream.done.wait(60)
    assert stream.error is None and 1 <= len(stream.token_ids) < 2000
    assert not stream.deltas[-1].finished  # the caller walked away; the router aborted it
    wait_all_free(cluster, timeout_s=3.0)  # freed at once, long before 2000 tokens could finish


def test_abort_by_cancelling_the_consumer_task(cluster):
    async def run() -> int:
        got = []

        async def consume():
            async for delta in cluster.stream([3, 4, 5], SamplingParams(max_tokens=2000, ignore_eos=True)):
                got.extend(delta.token_ids)

        task = asyncio.ensure_future(consume())
        while not got:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return len(got)

    assert 1 <= asyncio.run(run()) < 2000
    wait_all_free(cluster, timeout_s=3.0)


def test_abort_while_queued_for_decode_pages(cluster):
    # The first request commits 251 of the decode instance's 256 pages for its whole life.
    hog = BackgroundStream(cluster, [3] * 8, SamplingParams(max_tokens=4000, ignore_eos=True), request_id="hog")
    hog.started.wait(60)
    waiting = BackgroundStream(cluster, [4] * 8, SamplingParams(max_tokens=100), request_id="waiting")
    _wait_until(lambda: cluster.router_stats()["queued"] == 1)
    time.sleep(0.3)
    assert not waiting.deltas  # still queued: no pages for it
    cluster.abort("waiting")
    assert waiting.result().finish_reason == "abort"
    assert cluster.stats()["router"]["queued"] == 0
    cluster.abort("hog")
    assert hog.result().finish_reason == "abort"
    wait_all_free(cluster, timeout_s=3.0)


def test_queued_request_runs_once_pages_free(cluster):
    hog = BackgroundStream(cluster, [3] * 8, SamplingParams(max_tokens=4000, ignore_eos=True), request_id="hog2")
    hog.started.wait(60)
    waiting = BackgroundStream(cluster, [4] * 8, SamplingParams(max_tokens=90, ignore_eos=True))
    _wait_until(lambda: cluster.router_stats()["queued"] == 1)
    cluster.abort("hog2")
    last = waiting.result()
    assert last.finish_reason == "length" and len(waiting.token_ids) == 90


def test_request_timeout_aborts(cluster):
    router = cluster._router
    saved = router.settings
    router.settings = saved.model_copy(update={"request_timeout_s": 1.0})
    try:
        cluster.instance("prefill-0").actor.drop_next.remote(1)  # never prefilled: it can only time out
        last = BackgroundStream(cluster, [7] * 20, SamplingParams(max_tokens=8)).result()
    finally:
        router.settings = saved
    assert last.finish_reason == "abort" and "timed out after 1.0 s" in last.error, last
    assert isinstance(last.cause, RequestTimedOut) and last.cause.timeout_s == 1.0
    assert cluster.router_stats()["aborts"]["request_timed_out"] >= 1


def test_full_queue_raises_queue_full(cluster):
    router = cluster._router
    saved = router.settings
    router.settings = saved.model_copy(update={"max_queue": 0})
    try:
        with pytest.raises(QueueFull, match="router.max_queue"):
            cluster.generate([[3, 4, 5]], SamplingParams(max_tokens=2))
    finally:
        router.settings = saved
    assert cluster.generate([[3, 4, 5]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_bad_requests_are_refused_before_queueing(cluster):
    with pytest.raises(ValueError, match="prompt is empty"):  # the first is aborted, not left running
        cluster.generate([[3, 4] * 20, []], SamplingParams(max_tokens=2000, ignore_eos=True))
    _wait_until(lambda: cluster.stats()["router"]["live"] == 0, timeout_s=3.0)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        cluster.generate([[3] * 4000], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        cluster.generate(["hello"], SamplingParams(max_tokens=2))
    first = BackgroundStream(cluster, [3, 4], SamplingParams(max_tokens=500, ignore_eos=True), request_id="dup")
    first.started.wait(60)
    second = BackgroundStream(cluster, [3, 4], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="already in flight"):
        second.result()
    cluster.abort("dup")
    assert first.result().finish_reason == "abort"


def test_an_engine_refusal_names_its_argument_as_a_field(cluster):
    """The decode engine refuses a token id outside the vocabulary (tiny: 256); the router's
    RequestRefused carries the argument the engine's InvalidArgument named, not parsed text."""
    last = BackgroundStream(cluster, [3, 999], SamplingParams(max_tokens=2), request_id="bad-id").result()
    assert last.finish_reason == "error" and isinstance(last.cause, RequestRefused), last
    assert last.cause.argument == "prompt_token_ids" and "[0, 256)" in last.error


def _wait_stage(cluster, stage: str, timeout_s: float = 30.0) -> None:
    _wait_until(lambda: cluster.router_stats()["stages"].get(stage, 0) >= 1, timeout_s)


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize("async_scheduling", [None, False], ids=["default", "off"])
def test_async_scheduling_from_the_config_gives_the_same_tokens(cluster, async_scheduling):
    """`scheduler.async_scheduling` (default true) reaches the decode and colocated engines (steps
    launched ahead, or none when false), and tokens equal the reference, stop ids (EOS-like ends)
    included. The default 1P1D is the module's fleet (its scheduler section is the default one)."""
    prompts = mixed_prompts(12, seed=5)
    max_tokens = [3, 16, 31, 9] * 3
    want = reference_tokens(prompts, max_tokens)
    stop = {i: want[i][2] for i in (1, 5)}  # two requests end early on a stop id
    params = [SamplingParams(max_tokens=n, stop_token_ids=(stop[i],) if i in stop else ())
              for i, n in enumerate(max_tokens)]
    overrides = {} if async_scheduling is None else {"scheduler__async_scheduling": async_scheduling}
    own = bool(overrides)  # else the module's fleet, launched with the default scheduler section
    with launch("tiny-1p1d", **overrides) if own else contextlib.nullcontext(cluster) as fleet:
        before = _steps_ahead(fleet)
        got = fleet.generate(prompts, params)
        ahead = _steps_ahead(fleet)["decode-0"] - before["decode-0"]  # this test's steps only
        wait_all_free(fleet)
    assert (ahead > 0) == (async_scheduling is None)
    with launch("tiny-colocated", **overrides) as twin_fleet:
        colocated = twin_fleet.generate(prompts, params)
        ahead = sum(_steps_ahead(twin_fleet).values())
        wait_all_free(twin_fleet)
    assert (ahead > 0) == (async_scheduling is None)
    for i, (completion, twin, tokens) in enumerate(zip(got, colocated, want)):
        expected = tokens[:tokens.index(stop[i]) + 1] if i in stop else tokens
        assert completion.token_ids == expected == twin.token_ids, f"request {i}"


def _steps_ahead(cluster) -> dict[str, int]:
    """Each instance's steps launched ahead since its launch, by name."""
    return {inst["name"]: inst["num_steps_ahead"] for inst in cluster.stats()["instances"]}


def test_reservations_overlapping_forwards_give_the_same_tokens(ray_local):
    """`scheduler.overlap_reservations: true`: the decode instance may answer reservations while
    its forward runs (`StepLoop.while_gpu_runs`); tokens equal the reference, every page comes back."""
    prompts = mixed_prompts(12, seed=7)
    max_tokens = [3, 16, 31, 9] * 3
    want = reference_tokens(prompts, max_tokens)
    with launch("tiny-1p1d", scheduler__overlap_reservations=True) as cluster:
        got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
        stats = {inst["name"]: inst for inst in cluster.stats()["instances"]}
        wait_all_free(cluster)
    assert [c.token_ids for c in got] == want
    assert stats["decode-0"]["overlaps_reservations"] and not stats["prefill-0"]["overlaps_reservations"]
    assert stats["prefill-0"]["num_mid_step_calls"] == 0
