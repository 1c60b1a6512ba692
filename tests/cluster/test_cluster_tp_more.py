"""More tensor-parallel fleets on CPU actors (gloo): a colocated instance at TP=2 on `tiny`, and
1P1D fleets on the real SmolLM2-135M weights (9 query heads, 3 KV heads) at (prefill, decode) TP
(3, 3), (1, 3) and (3, 1), each against an unsharded in-process engine (greedy, float32)."""

from __future__ import annotations

import random

import pytest
from cluster_helpers import engine_tokens, environment, launch, mixed_prompts, reference_tokens, wait_all_free

from disagg.sampling import SamplingParams


def test_a_colocated_instance_at_tp2_matches_one_unsharded_engine(ray_local):
    prompts = mixed_prompts(8, seed=5) + [[random.Random(6).randrange(3, 256) for _ in range(300)]]
    max_tokens = [3, 9, 1, 17, 6, 2, 11, 5, 4]
    want = reference_tokens(prompts, max_tokens)
    with launch("tiny-colocated", instances__colocated=1, instances__tensor_parallel=2) as cluster:
        [inst] = cluster.stats()["instances"]
        assert inst["tensor_parallel"] == 2 and [r["rank"] for r in inst["ranks"]] == [0, 1]
        got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
        assert [c.token_ids for c in got] == want
        wait_all_free(cluster)


# (prefill TP, decode TP, the prompts' seed): at (3, 3) rank i sends its one KV head to rank i; at
# (1, 3) the one prefill rank writes each decode rank its head; at (3, 1) three prefill ranks fill
# the one decode rank's pages, which admits a request once all three rang.
# (3, 3) is a longer run of what the TP tests of `tiny` cover: out of `make test`.
SMOLLM2_PAIRS = [pytest.param(3, 3, 9, marks=pytest.mark.slow), (1, 3, 19), (3, 1, 19)]


@pytest.mark.parametrize("prefill, decode, seed", SMOLLM2_PAIRS, ids=lambda v: str(v))
def test_smollm2_1p1d_at_tensor_parallelism_matches_one_unsharded_engine(ray_local, prefill: int, decode: int,
                                                                        seed: int):
    from disagg.engine import ColocatedEngine
    from disagg.model import load_model
    from disagg.model.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        source = ensure_smollm2()
    except SmolLM2Unavailable as err:
        pytest.skip(str(err))
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 40, 70)]
    params = [SamplingParams(max_tokens=n) for n in (6, 4, 5, 3)]
    with environment(TRITON_INTERPRET="0"):
        model = load_model(source, dtype="float32", device="cpu")
        engine = ColocatedEngine(model, num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=64)
        want = engine_tokens(engine, prompts, params)
    with launch("smollm2-1p1d", model__source=str(source),
                instances__tensor_parallel={"prefill": prefill, "decode": decode},
                instances__device="cpu", instances__cpus_per_instance=0.5, transfer__backend="shm",
                cache__num_pages=64, model__max_model_len=1024, scheduler__max_num_batched_tokens=64) as cluster:
        assert [i["tensor_parallel"] for i in cluster.stats()["instances"]] == [prefill, decode]
        got = cluster.generate(prompts, params)
        assert [c.token_ids for c in got] == want, [c.error for c in got]
        wait_all_free(cluster)
