"""Prefill and decode at different tensor parallelism on CPU actors (gloo, the shm heap).

tiny-tp2-1p1d.yaml with ``instances.tensor_parallel`` {prefill: 1, decode: 2} and {prefill: 2,
decode: 1} (tiny: 2 KV heads): at (1, 2) the one prefill rank writes head 0 into decode rank 0's
pages and head 1 into decode rank 1's; at (2, 1) both prefill ranks write into the one decode
rank's pages, each its own head, and the decode rank admits a request once both rang. Tokens must
equal an unsharded colocated engine's (greedy, float32) with chunked prompts, prefix hits on both
sides and aborts mid-push, and every page is free afterwards on every rank. SmolLM2-135M (3 KV
heads) at (1, 3) and (3, 1): test_cluster_tp_split_smollm2.py.
"""

from __future__ import annotations

import random

import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor
from test_cluster_tp import every_rank_free

from disagg.sampling import SamplingParams

LEASE_S = 3.0
PAIRS = [(1, 2), (2, 1)]


@pytest.fixture(scope="module", params=PAIRS, ids=lambda pair: f"P{pair[0]}-D{pair[1]}")
def cluster(request, ray_local):
    prefill, decode = request.param
    cluster = launch("tiny-tp2-1p1d", HookedInstanceActor, router__lease_s=LEASE_S,
                     instances__tensor_parallel={"prefill": prefill, "decode": decode})
    cluster.pair = request.param
    yield cluster
    cluster.shutdown()


@pytest.fixture(autouse=True)
def pages_free_after(cluster, ray_local):
    yield
    wait_all_free(cluster, timeout_s=LEASE_S + 15)
    every_rank_free(cluster, ray_local)


def test_each_side_runs_at_its_own_tensor_parallelism(cluster):
    prefill, decode = cluster.pair
    by_name = {inst["name"]: inst for inst in cluster.stats()["instances"]}
    assert {name: inst["tensor_parallel"] for name, inst in by_name.items()} == {"prefill-0": prefill,
                                                                                 "decode-0": decode}
    assert len(cluster.stats()["paths"]) == prefill * decode


def test_mixed_and_chunked_prompts_match_one_unsharded_engine(cluster):
    prompts = mixed_prompts(8, seed=13) + [[random.Random(14).randrange(3, 256) for _ in range(300)]]
    max_tokens = [1, 2, 5, 16, 9, 3, 7, 4, 6]  # the 300-token prompt takes two chunks of 256
    want = reference_tokens(prompts, max_tokens)
    got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    for i, (completion, tokens) in enumerate(zip(got, want)):
        assert completion.error is None and completion.token_ids == tokens, f"request {i}: {completion.error}"
        assert (completion.metrics.prefill_instance, completion.metrics.decode_instance) == ("prefill-0", "decode-0")


def test_a_shared_prefix_is_reused_on_both_sides(cluster):
    rng = random.Random(18)
    system = [rng.randrange(3, 256) for _ in range(50)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(5)] for _ in range(3)]
    want = reference_tokens(prompts, [4] * 3)
    before = {i["name"]: i["prefix_hit_tokens"] for i in cluster.stats()["instances"]}
    for prompt, tokens in zip(prompts, want):
        assert cluster.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids == tokens
    after = {i["name"]: i["prefix_hit_tokens"] for i in cluster.stats()["instances"]}
    assert {name: after[name] - before[name] for name in after} == {"prefill-0": 100, "decode-0": 96}


def test_many_requests_abort_mid_push_and_mid_decode(cluster):
    """Requests aborted at random points leave nothing behind on any rank of either side (the
    autouse fixture); the others' tokens are right."""
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(20, 300))] for _ in range(10)]
    streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=16, ignore_eos=True), request_id=f"s{i}",
                                stop_after=rng.choice([None, 0, 1, 4])) for i, p in enumerate(prompts)]
    want = reference_tokens(prompts, [16] * len(prompts))
    for stream, tokens in zip(streams, want):
        stream.done.wait(120)
        assert stream.error is None
        assert stream.token_ids == tokens[:len(stream.token_ids)]


def test_abort_before_the_prompt_ran_frees_every_rank_s_reservation(cluster):
    import time

    cluster.instance("prefill-0").actor.drop_next.remote(1)
    stream = BackgroundStream(cluster, list(range(3, 40)), SamplingParams(max_tokens=8), request_id="pre")
    deadline = time.monotonic() + 30
    while not cluster.router_stats()["stages"].get("prefilling"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cluster.abort("pre")
    last = stream.result()
    assert last.finish_reason == "abort" and last.token_ids == []
