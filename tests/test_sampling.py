"""SamplingParams validation and the on-device sampler (CPU): greedy, temperature, top-k/top-p,
per-request seeds that give the same draws whatever the batch, and the draw offset that lets a
request continued from its streamed tokens draw on as the uninterrupted one would."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagg.engine.request import RequestFactory
from disagg.engine.sampler import SamplingBatch, gumbel_noise, sample
from disagg.sampling import SamplingParams

VOCAB = 50


def _batch(params: list[SamplingParams], steps: list[int] | None = None) -> SamplingBatch:
    factory = RequestFactory(eos_token_ids=())
    reqs = []
    for i, p in enumerate(params):
        req = factory.new(i, [1, 2, 3], p)
        req.token_ids += [0] * (steps[i] if steps else 0)
        reqs.append(req)
    return SamplingBatch.from_requests(reqs, torch.device("cpu"))


@pytest.mark.parametrize("field,value,kind", [
    ("max_tokens", 0, ValueError), ("max_tokens", 1.5, TypeError), ("temperature", -0.1, ValueError),
    ("temperature", float("nan"), ValueError), ("top_k", -1, ValueError), ("top_p", 0.0, ValueError),
    ("top_p", 1.5, ValueError), ("seed", -3, ValueError), ("seed", "7", TypeError),
    ("stop_token_ids", (3, -1), ValueError), ("stop_token_ids", 5, TypeError),
    ("ignore_eos", 1, TypeError), ("draw_offset", -1, ValueError), ("draw_offset", 2.0, TypeError)])
def test_validate_names_the_field(field, value, kind):
    with pytest.raises(kind, match=field):
        SamplingParams(**{field: value}).validate(vocab_size=VOCAB)


def test_validate_stop_id_against_vocab():
    with pytest.raises(ValueError, match=r"stop_token_ids.*\[0, 49\].*got 50"):
        SamplingParams(stop_token_ids=(50,)).validate(vocab_size=VOCAB)
    assert SamplingParams(stop_token_ids=(49,), seed=3, top_k=5, top_p=0.5, temperature=0.7).validate(VOCAB)


def test_top_k_above_the_vocabulary_is_refused():
    """top_k may keep the whole vocabulary (== vocab_size) but not more: the error names top_k,
    the vocabulary size and the value given. Without a vocabulary (a client that does not know
    the model) only the sign is checked."""
    assert SamplingParams(top_k=VOCAB, temperature=1.0).validate(VOCAB).top_k == VOCAB
    with pytest.raises(ValueError, match=rf"top_k: .*vocabulary size \({VOCAB} tokens.*got {VOCAB + 1}"):
        SamplingParams(top_k=VOCAB + 1).validate(vocab_size=VOCAB)
    assert SamplingParams(top_k=10**9).validate().top_k == 10**9


def test_engine_refuses_top_k_above_the_vocabulary_and_keeps_nothing():
    """Where the request meets the model (the engine's `add`): refused before any page is taken;
    the engine runs the next request as if the bad one never came."""
    from disagg.engine import ColocatedEngine
    from disagg.model import load_model

    model = load_model("dummy:tiny", device="cpu")
    vocab = model.config.vocab_size
    engine = ColocatedEngine(model, num_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    before = engine.stats()
    with pytest.raises(ValueError, match=rf"top_k: .*\({vocab} tokens.*got {vocab + 1}"):
        engine.add("bad", [1, 2, 3], SamplingParams(top_k=vocab + 1, temperature=1.0))
    assert engine.stats() == before and not engine.has_work()
    engine.add("bad", [1, 2, 3], SamplingParams(max_tokens=2, top_k=vocab, temperature=1.0, seed=1))
    while engine.has_work():
        engine.step()
    assert engine.stats()["free_pages"] == before["free_pages"]
    engine.cache.check_integrity()


def test_http_front_end_refuses_top_k_above_the_vocabulary():
    """The HTTP front end knows the vocabulary (`ModelLimits.vocab_size`): a 400 naming top_k."""
    from disagg.cluster.serve.errors import APIError
    from disagg.cluster.serve.prompts import ModelLimits, prepare_completion
    from disagg.cluster.serve.protocol import CompletionRequest

    limits = ModelLimits(name="m", max_model_len=64, tokenizer=None, vocab_size=VOCAB)
    ok = prepare_completion(CompletionRequest.model_validate({"prompt": [1, 2], "top_k": VOCAB}), limits)
    assert ok.params.top_k == VOCAB
    with pytest.raises(APIError, match=rf"top_k.*{VOCAB} tokens.*got {VOCAB + 1}") as err:
        prepare_completion(CompletionRequest.model_validate({"prompt": [1, 2], "top_k": VOCAB + 1}), limits)
    assert err.value.param == "top_k"


def test_greedy_is_argmax():
    logits = torch.randn(4, VOCAB)
    got = sample(logits, _batch([SamplingParams()] * 4))
    assert torch.equal(got, logits.argmax(-1))


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB)
    logits[4] = logits[0]
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(), SamplingParams(temperature=0.8, seed=5, top_k=7),
              SamplingParams(temperature=1.3, seed=99, top_p=0.6), SamplingParams(temperature=1.0, seed=11)]
    full = sample(logits, _batch(params, steps=[3, 0, 1, 2, 3]))
    for i in range(5):
        alone = sample(logits[i:i + 1], _batch([params[i]], steps=[[3, 0, 1, 2, 3][i]]))
        assert alone.item() == full[i].item()
    order = [4, 2, 0, 3, 1]
    shuffled = sample(logits[order], _batch([params[i] for i in order], steps=[[3, 0, 1, 2, 3][i] for i in order]))
    assert torch.equal(shuffled, full[order])
    assert full[0] == full[4]  # same seed, same step, same logits


def test_seed_and_step_change_the_draw():
    seeds = torch.tensor([1, 2, 1], dtype=torch.int64)
    steps = torch.tensor([0, 0, 1], dtype=torch.int64)
    g = gumbel_noise(seeds, steps, 1000)
    assert torch.isfinite(g).all()
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert torch.equal(g, gumbel_noise(seeds, steps, 1000))


def test_temperature_matches_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    draws = torch.stack([sample(logits, _batch([SamplingParams(temperature=1.0, seed=s)])) for s in range(3000)])
    freq = torch.bincount(draws.flatten(), minlength=4).float() / 3000
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.03, rtol=0)


def test_top_k_and_top_p_cut_the_support():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, 2.7]])
    seen_k, seen_p = set(), set()
    for s in range(300):
        seen_k.add(sample(logits, _batch([SamplingParams(temperature=5.0, seed=s, top_k=2)])).item())
        seen_p.add(sample(logits, _batch([SamplingParams(temperature=1.0, seed=s, top_p=0.3)])).item())
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # p(0) ~ 0.28 < 0.3, so token 1 joins the nucleus
    one = sample(logits, _batch([SamplingParams(temperature=2.0, seed=1, top_k=1)]))
    assert one.item() == 0


def test_all_greedy_batch_packs_nothing_and_takes_the_argmax():
    batch = _batch([SamplingParams(), SamplingParams(temperature=0.0, seed=4)])
    assert batch.sampled_rows is None and batch.temperature is None and batch.step is None
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, batch), logits.argmax(-1))
    mixed = _batch([SamplingParams(), SamplingParams(temperature=0.7, seed=4)])
    assert mixed.sampled_rows.tolist() == [1] and mixed.temperature.tolist() == pytest.approx([0.0, 0.7])


def test_draw_offset_numbers_a_rows_draws_from_it():
    """A row's step is its ``draw_offset`` plus the tokens it generated: a request with 2 tokens
    generated and offset 5 draws what one with 7 generated and no offset draws."""
    params = SamplingParams(temperature=1.0, seed=21)
    batch = _batch([params, SamplingParams(temperature=1.0, seed=21, draw_offset=5)], steps=[7, 2])
    assert batch.step.tolist() == [7, 7]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)).expand(2, VOCAB)
    draws = sample(logits, batch)
    assert draws[0] == draws[1]


def test_a_request_continued_with_its_tokens_and_draw_offset_draws_the_rest_of_the_uninterrupted_run(monkeypatch):
    """What migration does (`disagg.cluster.routing.migration.resume`): the first ``k`` tokens of a
    seeded sampled request joined to its prompt, ``max_tokens`` k fewer, ``draw_offset`` k: the
    engine draws exactly the uninterrupted request's remaining tokens; without the offset it does not."""
    from disagg.engine import ColocatedEngine
    from disagg.model import load_model

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: the sampler is what is tested
    model = load_model("dummy:tiny", dtype="float32", device="cpu")

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        engine = ColocatedEngine(model, num_pages=16, page_size=4, max_num_seqs=2, max_num_batched_tokens=32)
        engine.add("r", prompt, params)
        tokens = []
        while engine.has_work():
            tokens += [o.token_id for o in engine.step() if o.token_id is not None]
        return tokens

    prompt, full = [5, 9, 17, 33], SamplingParams(max_tokens=24, temperature=1.0, top_k=40, seed=7, ignore_eos=True)
    whole = run(prompt, full)
    for k in (1, 10):
        rest = dataclasses.replace(full, max_tokens=24 - k, draw_offset=k)
        assert run(prompt + whole[:k], rest) == whole[k:], k
    restarted = run(prompt + whole[:10], dataclasses.replace(full, max_tokens=14))
    assert restarted != whole[10:]  # draws 0.. again: another continuation
