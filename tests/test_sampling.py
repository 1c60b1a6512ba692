"""SamplingParams validation and the on-device sampler (CPU): greedy, temperature, top-k/top-p,
and per-request seeds that give the same draws whatever the batch."""

from __future__ import annotations

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
    ("ignore_eos", 1, TypeError)])
def test_validate_names_the_field(field, value, kind):
    with pytest.raises(kind, match=field):
        SamplingParams(**{field: value}).validate(vocab_size=VOCAB)


def test_validate_stop_id_against_vocab():
    with pytest.raises(ValueError, match=r"stop_token_ids.*\[0, 49\].*got 50"):
        SamplingParams(stop_token_ids=(50,)).validate(vocab_size=VOCAB)
    assert SamplingParams(stop_token_ids=(49,), seed=3, top_k=5, top_p=0.5, temperature=0.7).validate(VOCAB)


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
