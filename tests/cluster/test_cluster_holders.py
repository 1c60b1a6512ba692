"""A killed instance migrates exactly the requests it holds (`RoutedRequest.holders`), on tiny-1p1d (CPU actors).

A request is held by the prefill and the decode instance while its prompt is with the prefill
side, and by the decode instance alone once the decode side produced a token of it (its KV
landed). Killing the prefill actor then migrates the requests still queued or prefilling there,
and the one whose first token came but no decode token yet (`disagg.cluster.routing.migration`:
routed again, to the decode instance, with the tokens they streamed in their prompt); the ones
already decoding are left alone. Every request finishes with the tokens of an in-process
colocated engine, and every page of the decode instance comes back (the reservations the dead
sender was filling once their lease closes).
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

LEASE_S = 2.0
DECODE_TOKENS = 64


def test_killed_prefill_migrates_only_the_requests_it_holds(ray_local):
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False) as cluster:
        prefill, decode = (cluster.instance(name).actor for name in ("prefill-0", "decode-0"))
        prompts = mixed_prompts(7, seed=6)
        params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
        want = reference_tokens(prompts, [DECODE_TOKENS] * len(prompts))

        # Three requests decoding on decode-0 (a decode token came), then its steps held.
        decoding = [BackgroundStream(cluster, p, params, request_id=f"dec-{i}") for i, p in enumerate(prompts[:3])]
        _wait_until(lambda: all(len(s.token_ids) >= 2 for s in decoding))
        ray_local.get(decode.pause_steps.remote(0))
        # One whose first token came (prefill done) but no decode token: its push is not proven.
        first_only = BackgroundStream(cluster, prompts[3], params, request_id="first-only")
        _wait_until(lambda: len(first_only.token_ids) == 1)
        # Three queued in the prefill engine, which computes nothing from now on.
        ray_local.get(prefill.pause_steps.remote(0))
        queued = [BackgroundStream(cluster, p, params, request_id=f"pre-{i}") for i, p in enumerate(prompts[4:])]
        _wait_until(lambda: ray_local.get(prefill.stats.remote())["waiting"] == 3)
        assert cluster.router_stats()["stages"] == {"decoding": 4, "prefilling": 3}
        assert not any(s.done.is_set() for s in decoding)

        ray_local.kill(prefill, no_restart=True)
        _wait_until(lambda: cluster.router_stats()["counts"].get("migrated") == 4)
        assert first_only.token_ids == want[3][:1] and all(s.token_ids == [] for s in queued)
        assert not any(s.done.is_set() for s in [*decoding, first_only, *queued])  # decode-0 holds them all

        ray_local.get(decode.resume_steps.remote())
        for i, stream in enumerate([*decoding, first_only, *queued]):
            last = stream.result()
            assert (last.finish_reason, last.error) == ("length", None), f"request {i}: {last}"
            assert stream.token_ids == want[i], f"request {i}"
        stats = wait_all_free(cluster, timeout_s=LEASE_S + 15)  # the migrated ones' first reservations too
        assert [i["name"] for i in stats["instances"] if not i["alive"]] == ["prefill-0"]
        assert stats["router"]["failures"] == {} and stats["router"]["counts"]["migrated"] == 4
        assert cluster.healthy and [d["name"] for d in stats["degraded"]] == ["prefill-0"]  # decode-0 serves


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
