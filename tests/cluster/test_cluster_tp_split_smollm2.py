"""SmolLM2-135M (9 query heads, 3 KV heads) with prefill and decode at different tensor
parallelism on CPU actors: (1, 3) -- one prefill rank writes each decode rank its one head -- and
(3, 1) -- three prefill ranks fill one decode rank's pages, which admits a request once all three
rang -- against an unsharded in-process engine (greedy, float32)."""

from __future__ import annotations

import random

import pytest
from cluster_helpers import engine_tokens, environment, launch, wait_all_free

from disagg.sampling import SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("prefill, decode", [(1, 3), (3, 1)])
def test_smollm2_at_different_tensor_parallelism_matches_one_unsharded_engine(ray_local, prefill: int, decode: int):
    from disagg.engine import ColocatedEngine
    from disagg.model import load_model
    from disagg.model.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        source = ensure_smollm2()
    except SmolLM2Unavailable as err:
        pytest.skip(str(err))
    rng = random.Random(19)
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
