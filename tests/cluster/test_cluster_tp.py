"""Tensor-parallel instances on CPU actors (gloo, the shm heap): tiny-tp2-1p1d.yaml at
``instances.tensor_parallel`` (prefill, decode) = (2, 2), (1, 2) and (2, 1), one launch each.

Every rank is its own Ray actor and PE of the shm heap with a replica of the engine. tiny has 2 KV
heads: at (2, 2) prefill rank i pushes head i into decode rank i's pages; at (1, 2) the one
prefill rank writes head 0 into decode rank 0's pages and head 1 into decode rank 1's; at (2, 1)
both prefill ranks write into the one decode rank's pages, each its own head, and the decode rank
admits a request once both rang. The tokens must equal an unsharded colocated engine's (greedy,
float32) with chunked prompts, prefix hits on both sides and aborts mid-push and mid-decode, and
after every test every page is free on every rank (read off each rank's engine, not only the
leader's). Each launch ends by killing a decode rank where there are two: the instance dies as
a whole, and what fails names the instance and the rank. SmolLM2-135M (3 KV heads) at (1, 3) and
(3, 1): test_cluster_tp_more.py.
"""

from __future__ import annotations

import random
import time

import pytest
from cluster_helpers import BackgroundStream, every_rank_free, launch, mixed_prompts, reference_tokens, wait_all_free
from hooked_actor import HookedInstanceActor

from disagg.sampling import SamplingParams

LEASE_S = 8.0  # the lease runs from the reservation: generous for 11 prompts queued on interpreted TP ranks
PAIRS = [(2, 2), (1, 2), (2, 1)]


@pytest.fixture(scope="module", params=PAIRS, ids=lambda pair: f"P{pair[0]}-D{pair[1]}")
def cluster(request, ray_local):
    prefill, decode = request.param
    cluster = launch("tiny-tp2-1p1d", HookedInstanceActor, router__lease_s=LEASE_S, cluster__restart=False,
                     instances__tensor_parallel={"prefill": prefill, "decode": decode})
    cluster.pair = request.param
    yield cluster
    cluster.shutdown()


@pytest.fixture(autouse=True)
def pages_free_after(cluster, ray_local):
    yield
    if any(inst.alive for inst in cluster.fleet.instances):
        wait_all_free(cluster, timeout_s=LEASE_S + 15)
        every_rank_free(cluster, ray_local, timeout_s=30)


def test_the_fleet_reports_each_instance_s_ranks(cluster):
    prefill, decode = cluster.pair
    stats = cluster.stats()
    by_name = {inst["name"]: inst for inst in stats["instances"]}
    assert {name: inst["tensor_parallel"] for name, inst in by_name.items()} == {"prefill-0": prefill,
                                                                                 "decode-0": decode}
    assert [r["pe"] for r in by_name["prefill-0"]["ranks"]] == list(range(prefill))
    assert [r["pe"] for r in by_name["decode-0"]["ranks"]] == list(range(prefill, prefill + decode))
    assert all(r["device"] == "cpu" for inst in by_name.values() for r in inst["ranks"])
    assert set(stats["paths"]) == {f"{p}->{d}" for p in range(prefill) for d in range(prefill, prefill + decode)}
    # Every PE allocates the fleet's pages of its widest side; a side with fewer heads per rank
    # views those bytes as proportionally more pages (tiny: 2 KV heads).
    heads = {"prefill-0": 2 // prefill, "decode-0": 2 // decode}
    widest = max(heads.values())
    assert {name: inst["total_pages"] for name, inst in by_name.items()} == \
        {name: stats["num_pages"] * widest // h for name, h in heads.items()}


def test_disagg_check_and_metrics_show_every_rank(cluster):
    if cluster.pair != (2, 2):
        pytest.skip("one fleet's lines suffice")
    from prometheus_client import CollectorRegistry, generate_latest

    from disagg.cluster.cli.app import describe
    from disagg.cluster.serve.metrics import ClusterCollector

    text = describe(cluster)
    assert "prefill-0 TP 2: rank 0 PE 0 on cpu, rank 1 PE 1 on cpu;" in text, text
    assert "decode-0 TP 2: rank 0 PE 2 on cpu, rank 1 PE 3 on cpu;" in text, text
    registry = CollectorRegistry()
    registry.register(ClusterCollector(cluster.stats))
    scraped = generate_latest(registry).decode()
    assert 'disagg:instance_tensor_parallel{instance="decode-0",role="decode"} 2.0' in scraped
    assert 'disagg:instance_rank_info{device="cpu",instance="decode-0",pe="3",rank="1",role="decode"} 1.0' in scraped


def test_mixed_and_chunked_prompts_match_one_unsharded_engine(cluster):
    prompts = mixed_prompts(10, seed=3) + [[random.Random(4).randrange(3, 256) for _ in range(300)]]
    max_tokens = [1, 2, 5, 16, 31, 9, 3, 7, 12, 4, 6]  # the 300-token prompt takes two chunks of 256
    want = reference_tokens(prompts, max_tokens)
    got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    for i, (completion, tokens) in enumerate(zip(got, want)):
        assert completion.error is None and completion.token_ids == tokens, f"request {i}"
        assert (completion.metrics.prefill_instance, completion.metrics.decode_instance) == ("prefill-0", "decode-0")


def test_a_shared_prefix_is_reused_on_both_sides(cluster):
    rng = random.Random(8)
    system = [rng.randrange(3, 256) for _ in range(50)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(5)] for _ in range(3)]
    want = reference_tokens(prompts, [4] * 3)
    before = {i["name"]: i["prefix_hit_tokens"] for i in cluster.stats()["instances"]}
    for prompt, tokens in zip(prompts, want):
        assert cluster.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids == tokens
    after = {i["name"]: i["prefix_hit_tokens"] for i in cluster.stats()["instances"]}
    assert {name: after[name] - before[name] for name in after} == {"prefill-0": 100, "decode-0": 96}


def test_abort_while_decoding(cluster):
    stream = BackgroundStream(cluster, list(range(3, 40)), SamplingParams(max_tokens=2000, ignore_eos=True),
                              stop_after=3)
    stream.done.wait(60)
    assert stream.error is None and 1 <= len(stream.token_ids) < 2000


def test_abort_before_the_prompt_ran_frees_every_rank_s_reservation(cluster):
    cluster.instance("prefill-0").actor.drop_next.remote(1)
    stream = BackgroundStream(cluster, list(range(3, 40)), SamplingParams(max_tokens=8), request_id="pre")
    deadline = time.monotonic() + 30
    while not cluster.router_stats()["stages"].get("prefilling"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cluster.abort("pre")
    last = stream.result()
    assert last.finish_reason == "abort" and last.token_ids == []


def test_many_requests_abort_mid_push_and_mid_decode(cluster):
    """Requests aborted at random points (during their prompt's push, or while decoding) leave
    nothing behind on any rank; the others' tokens are right."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(20, 200))] for _ in range(12)]
    streams = [BackgroundStream(cluster, p, SamplingParams(max_tokens=24, ignore_eos=True), request_id=f"m{i}",
                                stop_after=rng.choice([None, 1, 5])) for i, p in enumerate(prompts)]
    want = reference_tokens(prompts, [24] * len(prompts))
    for stream, tokens in zip(streams, want):
        stream.done.wait(120)
        assert stream.error is None
        assert stream.token_ids == tokens[:len(stream.token_ids)]


def test_a_killed_rank_takes_its_instance_down_and_is_named(cluster, ray_local):
    """Last of each launch: decode-0's rank 1 is killed; decode-0 dies as a whole (its leader's
    next collective fails), and what fails names the instance and the rank."""
    if cluster.pair[1] < 2:
        pytest.skip("the decode instance has one rank")
    decode = cluster.instance("decode-0")
    ray_local.kill(decode.ranks[1].actor, no_restart=True)
    deadline = time.monotonic() + 60
    outcome = None
    while time.monotonic() < deadline and decode.alive:
        outcome = cluster.generate([[5, 6, 7] * 5], SamplingParams(max_tokens=8))[0]
        time.sleep(0.2)
    assert not decode.alive, "decode-0 still serving with a dead rank"
    assert "decode-0" in decode.error and "rank(s) [1]" in decode.error, decode.error
    assert outcome is not None
