"""A killed instance fails exactly the requests it holds (`Request.holders`), on tiny-1p1d (CPU actors).

A request is held by the prefill and the decode instance while its prompt is with the prefill
side, and by the decode instance alone once the decode side produced a token of it (its KV
landed). Killing the prefill actor then fails the requests still queued or prefilling there, and
the ones whose first token came but no decode token yet; the ones already decoding finish with
the tokens of an in-process colocated engine, and every page of the decode instance comes back
(the reservations of the failed ones once their lease closes: their sender died mid-way).
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.errors import InstanceDied
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

LEASE_S = 2.0
DECODE_TOKENS = 64


def test_killed_prefill_fails_only_the_requests_it_holds(ray_local):
    with launch("tiny-1p1d", HookedInstanceActor, router__lease_s=LEASE_S) as cluster:
        prefill, decode = (cluster.instance(name).actor for name in ("prefill-0", "decode-0"))
        prompts = mixed_prompts(7, seed=6)
        params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
        want = reference_tokens(prompts[:3], [DECODE_TOKENS] * 3)

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
        for stream in [first_only, *queued]:
            last = stream.result()
            assert last.finish_reason == "error", (stream.deltas[-1], stream.token_ids)
            assert isinstance(last.cause, InstanceDied) and last.cause.instance == "prefill-0", last
            assert "prefill instance prefill-0 (PE 0) died" in last.error
        assert first_only.token_ids == reference_tokens([prompts[3]], [1])[0]
        assert all(s.token_ids == [] for s in queued)
        assert not any(s.done.is_set() for s in decoding)  # the prefill's death left them alone

        ray_local.get(decode.resume_steps.remote())
        for i, (stream, tokens) in enumerate(zip(decoding, want)):
            last = stream.result()
            assert (last.finish_reason, last.error) == ("length", None), f"request {i}: {last}"
            assert stream.token_ids == tokens, f"request {i}"
        stats = wait_all_free(cluster, timeout_s=LEASE_S + 15)  # the failed ones' reservations too
        assert [i["name"] for i in stats["instances"] if not i["alive"]] == ["prefill-0"]
        assert stats["router"]["failures"] == {"instance_died": 4}
        assert cluster.healthy and [d["name"] for d in stats["degraded"]] == ["prefill-0"]  # decode-0 serves


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
