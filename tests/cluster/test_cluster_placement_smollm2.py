"""The three placements on real SmolLM2-135M weights (float32, two CPU actors): a forced turn of
remote / local / kept, prompts of one token, on and around page boundaries and over two prompt
chunks, gives the in-process colocated engine's greedy tokens; every page comes back."""

from __future__ import annotations

import pytest
from cluster_helpers import engine_tokens, force_paths, launch, wait_all_free

from disagg.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# page_size 16, max_num_batched_tokens 512 (smollm2-1p1d.yaml): 1 token, page edges, two chunks.
LENGTHS = [1, 16, 17, 600, 31, 33]
MAX_TOKENS = [6, 4, 5, 3, 6, 4]


@pytest.fixture(scope="module")
def smollm2_path():
    from disagg.model.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except SmolLM2Unavailable as err:
        pytest.skip(str(err))


def prompts_of(tokenizer, lengths: list[int]) -> list[list[int]]:
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} page holds slot {i * 7}." for i in range(200))
    ids = tokenizer.encode(text)
    assert len(ids) >= max(lengths) + 10, len(ids)
    return [ids[start:start + n] for start, n in zip(range(0, 60, 10), lengths)]


def colocated_tokens(model, prompts, max_tokens) -> list[list[int]]:
    from disagg.engine import ColocatedEngine

    engine = ColocatedEngine(model, num_pages=256, page_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    return engine_tokens(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens])


def test_remote_local_and_kept_give_the_colocated_tokens(ray_local, smollm2_path, monkeypatch):
    import torch

    from disagg.model import load_model

    with monkeypatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")  # the torch kernels, as the actors run (ACTOR_ENV)
        model = load_model(smollm2_path, dtype=torch.float32, device="cpu")
        prompts = prompts_of(model.tokenizer, LENGTHS)
        want = colocated_tokens(model, prompts, MAX_TOKENS)
    del model
    cluster = launch("smollm2-1p1d", router__placement="adaptive")
    try:
        force_paths(cluster, monkeypatch, ["remote", "local", "kept"])
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        got = [cluster.generate([p], sp)[0] for p, sp in zip(prompts[:3], params[:3])]  # one per path, in turn
        got += cluster.generate(prompts[3:], params[3:])  # then all three paths at once
        for i, (completion, tokens) in enumerate(zip(got, want)):
            assert completion.error is None and completion.token_ids == tokens, \
                f"request {i} ({LENGTHS[i]} tokens, {completion.metrics.prefill_instance} -> " \
                f"{completion.metrics.decode_instance})"
        assert cluster.router_stats()["placements"] == {"remote": 2, "local": 2, "kept": 2}
        assert [(c.metrics.prefill_instance, c.metrics.decode_instance) for c in got[:3]] == [
            ("prefill-0", "decode-0"), ("decode-0", "decode-0"), ("prefill-0", "prefill-0")]
        wait_all_free(cluster, timeout_s=30)
    finally:
        cluster.shutdown()
