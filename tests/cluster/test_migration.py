"""A request an instance held when it died goes on, on the survivors (`disagg.cluster.routing.migration`),
on tiny-1p1d (CPU actors).

The decode instance killed mid-decode: each streaming greedy request is routed again with its prompt
and the tokens it already streamed as the new prompt, and its stream ends with the tokens of an
in-process colocated engine, none repeated or lost (the concatenation of the stream's deltas),
whether the prefill instance takes it (kept, ``cluster.restart: false``) or a replacement is on its
way; a seeded sampled request's stream ends with the uninterrupted request's draws too (its
``draw_offset`` goes on from the tokens it streamed). The prefill instance killed while prompts
are pushing: those are routed again to the decode instance (local) and complete; the
reservations the dead sender was filling are quarantined until their lease, then every page of
the survivor is free. The decode instance killed while prompts
wait in the prefill queue for it: each leaves that queue (aborted) and comes back kept. A request
migrates at most `MAX_MIGRATIONS` times: the death that holds it next fails it with `InstanceDied`
naming that instance.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from cluster_helpers import (BackgroundStream, engine_tokens, environment, launch, mixed_prompts, reference_tokens,
                             wait_all_free)
from hooked_actor import HookedInstanceActor

from disagg.cluster.outputs import RequestMetrics
from disagg.cluster.routing import migration
from disagg.cluster.routing.requests import RoutedRequest
from disagg.errors import InstanceDied
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

LEASE_S = 2.0
MAX_TOKENS = 48
PROMPTS = mixed_prompts(4, seed=52)
LONG_PROMPTS = [[3 + (7 * i + 5 * j) % 250 for j in range(400 + 37 * i)] for i in range(3)]  # 2-3 chunks of 256


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    return reference_tokens(PROMPTS + LONG_PROMPTS, [MAX_TOKENS] * (len(PROMPTS) + len(LONG_PROMPTS)))


@pytest.mark.parametrize("restart", [False, True], ids=["restart-off", "restart-on"])
def test_streams_a_killed_decode_instance_held_continue_on_the_survivors(ray_local, want, restart):
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=restart,
                cluster__restart_backoff_s=0.1) as cluster:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        stats = _kill_decode_while_streaming(cluster, ray_local, [params] * len(PROMPTS), want, "r")
        assert stats["router"]["failures"] == {}
        assert cluster.healthy


def test_seeded_sampled_streams_a_killed_decode_instance_held_draw_on_as_uninterrupted(ray_local):
    """Sampled (temperature 1, a seed each): the full streams equal an uninterrupted in-process
    colocated engine's, which only a draw offset that goes on from the streamed tokens gives
    (restarted draws would give another continuation)."""
    from disagg.engine import ColocatedEngine
    from disagg.model import load_model

    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    with environment(TRITON_INTERPRET="0"):  # the kernels' torch references, as the actors run them
        engine = ColocatedEngine(load_model("dummy:tiny", dtype="float32", device="cpu"), num_pages=256,
                                 page_size=16, max_num_seqs=16, max_num_batched_tokens=256)
        want = engine_tokens(engine, PROMPTS, params)
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False) as cluster:
        _kill_decode_while_streaming(cluster, ray_local, params, want, "s")


def test_prompts_a_killed_prefill_instance_was_pushing_are_routed_again(ray_local, want):
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False,
                router__prefill_queue_tokens=4096) as cluster:  # every prompt queued on prefill-0 at once
        prefill = cluster.instance("prefill-0").actor
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        ray_local.get(prefill.pause_steps.remote(0))
        streams = [BackgroundStream(cluster, p, params, request_id=f"long-{i}") for i, p in enumerate(LONG_PROMPTS)]
        _wait_until(lambda: ray_local.get(prefill.stats.remote())["waiting"] == len(LONG_PROMPTS))
        steps = ray_local.get(prefill.stats.remote())["num_steps"]
        ray_local.get(prefill.pause_steps.remote(1))  # one chunk of 256 tokens computed and pushed
        _wait_until(lambda: ray_local.get(prefill.stats.remote())["num_steps"] == steps + 1)
        assert cluster.router_stats()["stages"] == {"prefilling": len(LONG_PROMPTS)}
        ray_local.kill(prefill, no_restart=True)
        for i, (stream, tokens) in enumerate(zip(streams, want[len(PROMPTS):])):
            last = stream.result()
            assert (last.finish_reason, last.error) == ("length", None), (i, last)
            assert stream.token_ids == tokens, i
        stats = wait_all_free(cluster, timeout_s=LEASE_S + 15)  # the quarantined reservations too
        assert [inst["name"] for inst in stats["instances"] if inst["alive"]] == ["decode-0"]
        assert stats["router"]["counts"]["migrated"] == len(LONG_PROMPTS)
        assert stats["router"]["placements"]["local"] == len(LONG_PROMPTS)
        assert stats["router"]["failures"] == {}


def test_prompts_queued_for_a_killed_decode_instance_come_back_kept(ray_local, want):
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False) as cluster:
        prefill, decode = (cluster.instance(name).actor for name in ("prefill-0", "decode-0"))
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        ray_local.get(prefill.pause_steps.remote(0))
        streams = [BackgroundStream(cluster, p, params, request_id=f"q{i}") for i, p in enumerate(PROMPTS)]
        _wait_until(lambda: ray_local.get(prefill.stats.remote())["waiting"] == len(PROMPTS))
        ray_local.kill(decode, no_restart=True)
        _wait_until(lambda: cluster.router_stats()["stages"] == {"running": len(PROMPTS)})  # kept on prefill-0
        # each pushed prompt was aborted there (its pushes had nowhere to land): only the kept ones
        # wait, once the router's adds of them reached the engine (its steps are held)
        _wait_until(lambda: ray_local.get(prefill.stats.remote())["waiting"] == len(PROMPTS), timeout_s=30)
        ray_local.get(prefill.resume_steps.remote())
        for i, (stream, tokens) in enumerate(zip(streams, want)):
            last = stream.result()
            assert (last.finish_reason, last.error, stream.token_ids) == ("length", None, tokens), (i, last)
        stats = wait_all_free(cluster)
        assert stats["router"]["placements"]["kept"] == len(PROMPTS)


@pytest.mark.parametrize("bound", [1, migration.MAX_MIGRATIONS], ids=["bound-1", "bound-default"])
def test_a_request_migrates_at_most_the_bound(ray_local, monkeypatch, want, bound):
    """Killed on decode-0, a request goes on kept on prefill-0 (its steps held); prefill-0 killed
    too: past the bound it fails naming prefill-0, within it it waits for a replacement."""
    monkeypatch.setattr(migration, "MAX_MIGRATIONS", bound)
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart_backoff_s=2.0) as cluster:
        prefill, decode = (cluster.instance(name).actor for name in ("prefill-0", "decode-0"))
        stream = BackgroundStream(cluster, PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        _wait_until(lambda: len(stream.token_ids) >= 3)
        for actor in (decode, prefill):
            ray_local.get(actor.pause_steps.remote(0))
        ray_local.kill(decode, no_restart=True)
        _wait_until(lambda: cluster.router_stats()["stages"] == {"running": 1})  # kept on prefill-0, held
        streamed = list(stream.token_ids)
        ray_local.kill(prefill, no_restart=True)
        last = stream.result(timeout_s=120)
        if bound == 1:
            assert last.finish_reason == "error" and isinstance(last.cause, InstanceDied), last
            assert last.cause.instance == "prefill-0", last
            assert stream.token_ids == streamed == want[0][:len(streamed)]
            assert cluster.router_stats()["counts"]["migrated"] == 1
        else:
            assert (last.finish_reason, last.error) == ("length", None), last
            assert stream.token_ids == want[0]
            assert cluster.router_stats()["counts"]["migrated"] == 2


def test_resume_moves_the_streamed_tokens_into_the_prompt_and_the_draw_offset():
    """Each migration adds the tokens streamed since the last one to the prompt and to
    ``draw_offset`` and takes them off ``max_tokens`` (no Ray: the request alone)."""
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    req = RoutedRequest("r", [1, 2], params, lambda *a: None, RequestMetrics(arrival_time=0.0))
    req.output_token_ids = [7, 8, 9]
    migration.resume(req)
    assert (req.prompt_token_ids, req.params.max_tokens, req.params.draw_offset) == ([1, 2, 7, 8, 9], 7, 3)
    req.output_token_ids += [10]
    migration.resume(req)
    assert (req.prompt_token_ids, req.params.max_tokens, req.params.draw_offset) == ([1, 2, 7, 8, 9, 10], 6, 4)
    assert req.params == dataclasses.replace(params, max_tokens=6, draw_offset=4)
    assert req.engine_id == ("r", 2)

def _kill_decode_while_streaming(cluster, ray_local, params: list, want: list, prefix: str) -> dict:
    """Stream `PROMPTS` (one ``params`` each), kill decode-0 once every stream decoded 3 tokens
    there (its steps held), and check that every stream ends as ``want`` with none lost or
    repeated, each migrated; the stats once every page is free."""
    decode = cluster.instance("decode-0").actor
    streams = [BackgroundStream(cluster, p, sp, request_id=f"{prefix}{i}")
               for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    _wait_until(lambda: all(len(s.token_ids) >= 3 for s in streams))  # decoding on decode-0
    ray_local.get(decode.pause_steps.remote(0))
    streamed = [len(s.token_ids) for s in streams]
    assert all(3 <= n < MAX_TOKENS for n in streamed), streamed
    ray_local.kill(decode, no_restart=True)
    for i, (stream, tokens) in enumerate(zip(streams, want)):
        last = stream.result()
        assert (last.finish_reason, last.error) == ("length", None), (i, last)
        assert stream.token_ids == tokens, f"request {i}: streamed {streamed[i]} before the kill"
    stats = wait_all_free(cluster)
    assert stats["router"]["counts"]["migrated"] == len(PROMPTS)
    return stats


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
