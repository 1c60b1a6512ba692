"""Workload and arrival generators: seeded, within their stated bounds, with the right mean rate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from disagg.cluster.bench.arrivals import arrival_offsets, parse_rates
from disagg.cluster.bench.workloads import DATASETS, WorkloadSpec, sample_requests


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_same_seed_same_workload(name):
    spec = WorkloadSpec(name, num_prompts=6, seed=3, vocab_size=500, max_model_len=40000)
    a, b = sample_requests(spec), sample_requests(spec)
    assert [(r.request_id, r.prompt_token_ids, r.expected_output_len) for r in a] == \
           [(r.request_id, r.prompt_token_ids, r.expected_output_len) for r in b]
    c = sample_requests(WorkloadSpec(name, num_prompts=6, seed=4, vocab_size=500, max_model_len=40000))
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_random_lengths_follow_vllm_bounds():
    spec = WorkloadSpec("random", 400, seed=0, vocab_size=1000, input_len=100, output_len=10, range_ratio=0.5)
    reqs = sample_requests(spec)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and min(outs) >= 5 and max(outs) <= 15
    assert min(ins) < 60 and max(ins) > 140     # the whole range is used
    fixed = sample_requests(WorkloadSpec("random", 5, vocab_size=1000, input_len=7, output_len=3))
    assert {r.prompt_len for r in fixed} == {7} and {r.expected_output_len for r in fixed} == {3}


def test_token_ids_in_vocab_and_avoid_list():
    reqs = sample_requests(WorkloadSpec("random", 50, vocab_size=20, input_len=64, output_len=2,
                                        avoid_token_ids=(0, 19, 7, 400)))
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert ids <= set(range(20)) - {0, 7, 19}
    assert len(ids) == 17


def test_context_limit_clips_prompt_then_output():
    reqs = sample_requests(WorkloadSpec("random", 10, vocab_size=100, max_model_len=64,
                                        input_len=100, output_len=16))
    assert all(r.prompt_len + r.expected_output_len <= 64 for r in reqs)
    assert {r.expected_output_len for r in reqs} == {16}
    long_out = sample_requests(WorkloadSpec("random", 2, vocab_size=100, max_model_len=8, input_len=4, output_len=50))
    assert all(r.expected_output_len == 7 and r.prompt_len == 1 for r in long_out)


def test_long_prompt_and_chat_shapes():
    long = sample_requests(WorkloadSpec("long-prompt", 30, vocab_size=128256))
    assert all(8192 <= r.prompt_len <= 32768 and 16 <= r.expected_output_len <= 64 for r in long)
    chat = sample_requests(WorkloadSpec("chat", 2000, vocab_size=1000))
    ins = np.array([r.prompt_len for r in chat])
    outs = np.array([r.expected_output_len for r in chat])
    assert abs(np.median(ins) / 1020 - 1) < 0.1 and abs(np.median(outs) / 129 - 1) < 0.1
    assert ins.min() >= 4 and ins.max() <= 8192 and outs.max() <= 2048
    heavy = sample_requests(WorkloadSpec("prefill-heavy", 50, vocab_size=1000))
    light = sample_requests(WorkloadSpec("decode-heavy", 50, vocab_size=1000))
    assert min(r.prompt_len for r in heavy) > max(r.prompt_len for r in light)
    assert max(r.expected_output_len for r in heavy) < min(r.expected_output_len for r in light)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    reqs = sample_requests(WorkloadSpec("shared-prefix", 40, seed=2, vocab_size=1000, input_len=64, output_len=8))
    assert all(r.prompt_len == 64 + 128 and r.expected_output_len == 8 for r in reqs)
    groups: dict[tuple, list] = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt_token_ids[:64]), []).append(r)
    assert sorted(len(g) for g in groups.values()) == [8, 16, 16]  # 40 = 16 + 16 + 8
    assert len({tuple(r.prompt_token_ids[64:]) for r in reqs}) == 40  # every question its own
    order = [next(i for i, g in enumerate(groups) if tuple(r.prompt_token_ids[:64]) == g) for r in reqs]
    assert order != sorted(order)  # the groups are interleaved, not one after the other
    clipped = sample_requests(WorkloadSpec("shared-prefix", 4, vocab_size=1000, max_model_len=100, output_len=8))
    assert all(r.prompt_len == 92 for r in clipped)


def test_multi_turn_resends_the_conversation():
    reqs = sample_requests(WorkloadSpec("multi-turn", 10, seed=5, vocab_size=1000, input_len=20, output_len=6))
    convs = 3  # ceil(10 / 4 turns); turn t of conversation c is request t * 3 + c
    for index in range(convs, 10):
        earlier, later = reqs[index - convs], reqs[index]
        resent = earlier.prompt_len + earlier.expected_output_len  # the prompt, then the stand-in answer
        assert later.prompt_token_ids[:earlier.prompt_len] == earlier.prompt_token_ids
        assert 10 <= later.prompt_len - resent <= 30  # the new message: 20 within r=0.5
    assert [r.prompt_len for r in reqs[:convs]] == [len(r.prompt_token_ids) for r in reqs[:convs]]


@pytest.mark.parametrize("field,value,match", [
    ("dataset_name", "sharegpt", "--dataset-name"), ("num_prompts", 0, "--num-prompts"),
    ("range_ratio", 1.0, "--random-range-ratio"), ("input_len", -3, "--random-input-len"),
    ("vocab_size", 0, "vocab_size")])
def test_bad_workload_arguments(field, value, match):
    with pytest.raises(ValueError, match=match):
        sample_requests(WorkloadSpec(**{"vocab_size": 100, field: value}))


def test_arrivals_seeded_and_normalized():
    a = arrival_offsets(50, 4.0, 0.5, seed=1)
    assert np.array_equal(a, arrival_offsets(50, 4.0, 0.5, seed=1))
    assert not np.array_equal(a, arrival_offsets(50, 4.0, 0.5, seed=2))
    assert np.all(np.diff(a) >= 0)
    assert a[-1] == pytest.approx(50 / 4.0)          # vLLM's rescaling: the run offers exactly N/rate


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_mean_rate_and_burstiness(burstiness):
    offsets = arrival_offsets(40000, 8.0, burstiness, seed=0, normalize=False)
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    # gamma(shape k): coefficient of variation 1/sqrt(k): burstier arrivals vary more
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrival_edge_cases():
    assert np.array_equal(arrival_offsets(3, math.inf), np.zeros(3))
    assert np.allclose(np.diff(arrival_offsets(5, 2.0, math.inf)), 0.5)
    for bad in [dict(request_rate=-1.0), dict(request_rate=0.0), dict(request_rate=1.0, burstiness=0.0)]:
        with pytest.raises(ValueError):
            arrival_offsets(4, **bad)
    with pytest.raises(ValueError, match="num_requests"):
        arrival_offsets(0, 1.0)


def test_parse_rates():
    assert parse_rates("1,2, 4,inf") == [1.0, 2.0, 4.0, math.inf]
    assert parse_rates("0.5") == [0.5]
    for bad in ["-1", "0", "1,abc", "", "nan"]:
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rates(bad)
