"""`router.placement` on tiny-1p1d (two CPU actors, shm heap): local, adaptive and a forced mix
of remote / local / kept give the colocated engine's tokens; placements are counted; every page
comes back, and aborts free pages on every path."""

from __future__ import annotations

import time

import pytest
from cluster_helpers import BackgroundStream, force_paths, launch, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.sampling import SamplingParams

# Prompt lengths: one token, page boundaries (page_size 16), several chunks (budget 256).
LENGTHS = [1, 15, 16, 17, 32, 33, 255, 256, 257, 600]


def prompts_of(lengths, seed=7):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["local", "adaptive"])
def cluster(ray_local, request):
    cluster = launch("tiny-1p1d", HookedInstanceActor, router__placement=request.param)
    yield cluster
    cluster.shutdown()


@pytest.fixture(autouse=True)
def pages_free_after(cluster):
    yield
    wait_all_free(cluster, timeout_s=20)


def test_every_placement_matches_the_colocated_engine(cluster):
    mode = cluster.config.router.placement
    prompts = prompts_of(LENGTHS)
    max_tokens = [1, 7, 16, 3, 20, 9, 2, 12, 5, 11]
    want = reference_tokens(prompts, max_tokens)
    before = dict(cluster.router_stats()["placements"])
    got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    for i, (completion, tokens) in enumerate(zip(got, want)):
        assert completion.error is None and completion.token_ids == tokens, f"request {i} ({LENGTHS[i]} tokens)"
    placed = cluster.router_stats()["placements"]
    delta = {path: placed[path] - before[path] for path in placed}
    assert sum(delta.values()) == len(prompts)
    if mode == "local":
        assert delta == {"remote": 0, "local": len(prompts), "kept": 0}
        assert {c.metrics.prefill_instance for c in got} == {"decode-0"}


def test_a_forced_mix_of_paths_matches_and_frees_every_page(cluster, monkeypatch):
    if cluster.config.router.placement != "adaptive":
        pytest.skip("forcing decisions needs the adaptive placement")
    force_paths(cluster, monkeypatch, ["remote", "local", "kept"])
    prompts = prompts_of(LENGTHS * 2, seed=8)
    max_tokens = [4, 9, 1, 17, 6, 2, 13, 8, 3, 10] * 2
    want = reference_tokens(prompts, max_tokens)
    before = dict(cluster.router_stats()["placements"])
    got = [cluster.generate([p], SamplingParams(max_tokens=n))[0] for p, n in zip(prompts[:6], max_tokens[:6])]
    got += cluster.generate(prompts[6:], [SamplingParams(max_tokens=n) for n in max_tokens[6:]])
    for i, (completion, tokens) in enumerate(zip(got, want)):
        assert completion.error is None and completion.token_ids == tokens, f"request {i}"
    placed = cluster.router_stats()["placements"]
    assert {path: placed[path] - before[path] for path in placed} == {"remote": 7, "local": 7, "kept": 6}
    # Consecutive requests took different paths: remote on P -> D, local on D, kept on P.
    assert [(c.metrics.prefill_instance, c.metrics.decode_instance) for c in got[:3]] == [
        ("prefill-0", "decode-0"), ("decode-0", "decode-0"), ("prefill-0", "prefill-0")]


def test_a_kept_request_goes_while_a_remote_one_waits_for_its_reservation(cluster, monkeypatch, ray_local):
    """The dispatcher does not hold the queue for a reservation's round trip: a request kept on
    P behind a remote one whose decode instance answers no call (stalled) is served meanwhile."""
    if cluster.config.router.placement != "adaptive":
        pytest.skip("forcing decisions needs the adaptive placement")
    force_paths(cluster, monkeypatch, ["remote", "kept"])
    remote_prompt, kept_prompt = prompts_of([40, 24], seed=10)
    want = reference_tokens([remote_prompt, kept_prompt], [6, 6])
    decode = cluster.instance("decode-0").actor
    ray_local.get(decode.stall.remote(60.0))  # from now on D's reserve() waits behind the stall
    try:
        remote = BackgroundStream(cluster, remote_prompt, SamplingParams(max_tokens=6), request_id="waits-remote")
        deadline = time.monotonic() + 30
        while not cluster.router_stats()["stages"].get("reserving"):
            assert time.monotonic() < deadline, "the remote request never reserved"
            time.sleep(0.05)
        kept = BackgroundStream(cluster, kept_prompt, SamplingParams(max_tokens=6), request_id="goes-kept")
        last = kept.result(timeout_s=30)
        assert (last.finish_reason, kept.token_ids) == ("length", want[1])
        assert not remote.done.is_set()  # still waiting for D
    finally:
        ray_local.get(decode.unstall.remote())
    assert remote.result().finish_reason == "length" and remote.token_ids == want[0]


def test_aborts_on_every_path_free_every_page(cluster, monkeypatch):
    if cluster.config.router.placement == "adaptive":
        force_paths(cluster, monkeypatch, ["remote", "local", "kept"])
    prompts = prompts_of([40, 300, 90, 17, 500, 64], seed=9)
    ids = [f"abort-{cluster.config.router.placement}-{i}" for i in range(len(prompts))]
    streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=400, ignore_eos=True), request_id=rid)
               for p, rid in zip(prompts, ids)]
    time.sleep(0.3)
    for rid in ids[::2]:
        cluster.abort(rid)
    for i, stream in enumerate(streams):
        last = stream.result()
        if i % 2 == 0:
            assert last.finish_reason == "abort", last
        else:
            assert last.finish_reason == "length" and len(stream.token_ids) == 400


def test_adaptive_decisions_are_inspectable(cluster):
    stats = cluster.router_stats()
    assert set(stats["placements"]) == {"remote", "local", "kept"}
    placement = stats["placement"]
    assert placement["mode"] == cluster.config.router.placement
    if placement["mode"] == "adaptive":
        cluster.generate(prompts_of([20, 200]), SamplingParams(max_tokens=8))
        placement = cluster.router_stats()["placement"]
        row = placement["decisions"][-1]
        assert row["path"] in ("remote", "local", "kept")
        assert {c["path"] for c in row["candidates"]} == {"remote", "local", "kept"}
        # The models learned from the instances' own steps.
        assert all(m["num_samples"] > 0 for m in placement["models"].values()), placement["models"]


def test_the_router_ledger_is_checked_and_a_missed_move_is_caught(cluster, monkeypatch, router_ledgers_checked):
    """The router's `Ledger` is checked against the sums over its live requests at every
    placement and end (tests/conftest.py): the checks run, and a ledger that misses the tokens
    of the requests decoding fails them."""
    from disagg.cluster.routing.ledger import Ledger

    checks = router_ledgers_checked
    before = checks.count
    cluster.generate(prompts_of([20, 70]), SamplingParams(max_tokens=6))
    assert checks.count >= before + 4 and not checks.failures  # two placements, two ends at least
    monkeypatch.setattr(Ledger, "advance", lambda self, req, num_tokens: None)
    cluster.generate(prompts_of([30, 90, 45]), SamplingParams(max_tokens=40, ignore_eos=True))
    found, checks.failures[:] = list(checks.failures), []
    assert found and "summed over the live requests" in found[0], found


def test_the_watchdogs_audit_rebuilds_a_ledger_out_of_step(cluster, caplog):
    """A ledger out of step with the live requests (a move the router did not report) is found
    by the watchdog's audit (`Router._audit_ledger`, every LEDGER_AUDIT_S), logged, counted and
    rebuilt from the live requests; a ledger in step is left alone."""
    import asyncio

    router = cluster._router

    def on_loop(fn):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), cluster._loop).result(30)

    before = cluster.router_stats()["ledger_rebuilds"]
    on_loop(router._audit_ledger)
    assert cluster.router_stats()["ledger_rebuilds"] == before  # in step: nothing to do

    def corrupt_and_audit():
        router.ledger.loads["decode-0"] += 7  # tokens no live request holds
        router.ledger.seats["prefill-0"] += 1
        router._audit_ledger()
        return router.flow.audit()

    with caplog.at_level("ERROR", logger="disagg.cluster.routing.router"):
        assert on_loop(corrupt_and_audit) is None  # rebuilt: in step again
    assert cluster.router_stats()["ledger_rebuilds"] == before + 1
    assert "out of step with its live requests" in caplog.text and "tracked loads" in caplog.text
    prompts = prompts_of([25, 300])
    want = reference_tokens(prompts, [5, 5])
    got = cluster.generate(prompts, SamplingParams(max_tokens=5))
    assert [c.token_ids for c in got] == want
