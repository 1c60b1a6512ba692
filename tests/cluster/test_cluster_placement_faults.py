"""Killing an instance mid-request under the adaptive placement migrates exactly the requests of
the paths it takes part in (tiny-1p1d, CPU actors, decisions forced to remote / local / kept).

Kill the prefill instance: its kept requests migrate (to the decode instance, with the tokens they
streamed in their prompt); local ones (on the decode instance) and remote ones already decoding
there are left alone. Kill the decode instance: its local and remote requests migrate to the
prefill instance; kept ones are left alone. Every request finishes with the colocated engine's
tokens, none repeated or lost, and the survivor's pages all come back.
"""

from __future__ import annotations

import time

import pytest
from cluster_helpers import BackgroundStream, force_paths, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# The first request must still decode when the last one starts, even on a loaded CI host
# (48 let remote-0 finish first there); 4 x (prompt + 800) fit decode-0's 4096 slots.
TOKENS = 800
PATHS = ["remote", "local", "kept"] * 2
PROMPTS = mixed_prompts(len(PATHS), seed=11)


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    """The colocated engine's tokens for PROMPTS: one reference for both victims (~4 s each)."""
    return reference_tokens(PROMPTS, [TOKENS] * len(PROMPTS))


@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_a_killed_instance_migrates_only_the_placements_it_takes_part_in(ray_local, monkeypatch, want, victim):
    with launch("tiny-1p1d", HookedInstanceActor, router__placement="adaptive", router__lease_s=2.0,
                cluster__restart=False) as cluster:
        force_paths(cluster, monkeypatch, PATHS)
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        streams = []
        for i, prompt in enumerate(PROMPTS):  # one at a time: each takes the path given in turn
            streams.append(BackgroundStream(cluster, prompt, params, request_id=f"{PATHS[i]}-{i}"))
            _wait_until(lambda: len(streams[-1].token_ids) >= 2)  # decoding (a remote one's KV landed)
        others = [name for name in ("prefill-0", "decode-0") if name != victim]
        for name in (victim, *others):  # hold both: nobody finishes before the kill
            ray_local.get(cluster.instance(name).actor.pause_steps.remote(0))
        ray_local.kill(cluster.instance(victim).actor, no_restart=True)
        ray_local.get(cluster.instance(others[0]).actor.resume_steps.remote())
        involved = {"prefill-0": {"kept"}, "decode-0": {"remote", "local"}}[victim]
        for i, (stream, tokens) in enumerate(zip(streams, want)):
            last = stream.result()
            assert (last.finish_reason, last.error) == ("length", None), (PATHS[i], last)
            assert stream.token_ids == tokens, PATHS[i]
        stats = wait_all_free(cluster, timeout_s=20)
        assert [inst["name"] for inst in stats["instances"] if not inst["alive"]] == [victim]
        assert stats["router"]["failures"] == {}
        assert stats["router"]["counts"]["migrated"] == 2 * len(involved)


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
