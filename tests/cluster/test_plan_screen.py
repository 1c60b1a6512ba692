"""`disagg plan`'s analytic screen: each instance's capacity from its step-time model within the
SLOs, rate matching of a split's two sides, the shortlist of what to simulate, and a screened
search that picks what the full one picks."""

from __future__ import annotations

import math

import pytest

from disagg.cluster.simulate import plan as planner
from disagg.cluster.simulate import screen
from disagg.cluster.simulate.step_model import StepTimeModel

PROFILE = {  # the tiny instance of test_plan.py: 1.5 ms a step, 20 us a prompt token, 180 us a decoding sequence
    "kind": "disagg-profile", "version": 1, "model": "dummy:tiny", "dtype": "float32",
    "device": {"host": "test", "gpus": [], "torch_device": "cpu"},
    "engine": {"num_pages": 256, "page_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "max_model_len": 4096, "kv_bytes_per_token": 512, "vocab_size": 256, "eos_token_ids": [2]},
    "fit": {"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8], "error": 0.1}, "samples": [],
}
MODEL = StepTimeModel.from_dict(PROFILE["fit"])
LOOSE = {"ttft": 1e6, "tpot": 1e6}


def instance(chunk: int = 256, seqs: int = 16, pages: int = 256, link_bytes_per_s: float = 364e9) -> screen.InstanceShape:
    return screen.InstanceShape(MODEL, chunk, seqs, pages, 16, 512.0, link_bytes_per_s)


def work(input_len: float, output_len: float) -> screen.WorkloadShape:
    return screen.WorkloadShape.of([input_len], [output_len])


def test_prefill_capacity_is_full_chunks_within_the_ttft_and_the_link():
    # 64-token prompts, chunks of 256: four prompts a step of 1.5 ms + 256 x 20 us.
    step = 1.5e-3 + 256 * 2e-5
    assert screen.prefill_rate(instance(), work(64, 16), LOOSE) == pytest.approx(4 / step)
    # A full step of 8192 tokens takes 165 ms: a TTFT of 100 ms needs steps of 4096 (83 ms), at
    # a lower rate; of 1 ms, no step is fast enough.
    tight = screen.prefill_rate(instance(chunk=8192), work(64, 16), {"ttft": 100})
    assert tight == pytest.approx(4096 / (64 * (1.5e-3 + 4096 * 2e-5)))
    assert tight < screen.prefill_rate(instance(chunk=8192), work(64, 16), LOOSE)
    assert screen.prefill_rate(instance(chunk=8192), work(64, 16), {"ttft": 1}) == 0.0
    # A 1000-token prompt in chunks of 256 waits for 4 full steps (26.5 ms).
    assert screen.prefill_rate(instance(), work(1000, 16), {"ttft": 26}) == 0.0 < screen.prefill_rate(
        instance(), work(1000, 16), {"ttft": 27})
    # The link: 64 tokens x 512 B a prompt over 1 MB/s is 30.5 prompts/s.
    assert screen.prefill_rate(instance(link_bytes_per_s=1e6), work(64, 16), LOOSE) == pytest.approx(1e6 / (64 * 512))


def test_decode_capacity_is_the_largest_batch_the_pages_seats_and_tpot_allow():
    def rate(batch: int, w: screen.WorkloadShape) -> float:
        return batch / (MODEL.step_s(0, batch, batch * w.context_len, 0) * w.decode_tokens)

    w = work(64, 16)  # 80 tokens: 5 pages a request
    assert screen.decode_rate(instance(), w, LOOSE) == pytest.approx(rate(16, w))  # max_num_seqs
    assert screen.decode_rate(instance(pages=27), w, LOOSE) == pytest.approx(rate(5, w))  # 27 // 5 pages
    tpot_ms = MODEL.step_s(0, 7, 7 * w.context_len, 0) * 1e3 + 1e-6  # the step of 7 sequences, just
    assert screen.decode_rate(instance(), w, {"tpot": tpot_ms}) == pytest.approx(rate(7, w))
    assert screen.decode_rate(instance(), w, {"tpot": 1.0}) == 0.0  # one sequence's step is 1.7 ms
    assert screen.decode_rate(instance(), work(64, 1), LOOSE) == math.inf  # nothing to decode


def test_a_split_is_rate_matched_and_an_adaptive_one_adds_the_idle_sides_colocated_work():
    w = work(200, 6)  # prompts dominate
    prefill, decode = screen.prefill_rate(instance(), w, LOOSE), screen.decode_rate(instance(), w, LOOSE)
    assert prefill < decode
    assert screen.split_rate(instance(), 3, instance(), 1, w, LOOSE) == (pytest.approx(min(3 * prefill, decode)),
                                                                         "prefill" if 3 * prefill < decode else "decode")
    rate, bound = screen.split_rate(instance(), 1, instance(), 3, w, LOOSE)
    assert (rate, bound) == (pytest.approx(prefill), "prefill")
    # Adaptive: the three decode instances, 1/3 busy decoding what one prefill instance pushes,
    # serve colocated the rest of their time; or every instance colocated, whichever is more.
    colocated = screen.colocated_rate(instance(), w, LOOSE)
    mixed = prefill + (3 - prefill / decode) * colocated
    adaptive, why = screen.split_rate(instance(), 1, instance(), 3, w, LOOSE, adaptive=True)
    assert adaptive == pytest.approx(max(mixed, 4 * colocated)) and adaptive > rate
    assert why == ("local" if 4 * colocated >= mixed else "adaptive")


@pytest.mark.parametrize("lengths, best, worst", [
    (dict(input_len=200, output_len=6), "3P1D", "1P3D"),   # prompts dominate: prefill instances
    (dict(input_len=8, output_len=64), "1P3D", "3P1D"),    # answers dominate: decode instances
])
def test_the_screen_ranks_the_clearly_better_split_first(lengths, best, worst):
    """The splits test_plan.py's simulation ranks (`test_plan_finds_the_known_best_split`), ranked
    alike by the screen, and the best one kept for simulation, the worst screened out."""
    search = planner.candidates(4, adaptive=False, colocated=False)
    kept = planner.screen_search(PROFILE, search, dataset_name="random", slos_ms={"ttft": 300, "tpot": 20}, **lengths)
    ranked = sorted(search, key=lambda c: -c.screened.rate_per_gpu)
    assert ranked[0].label == best and ranked[-1].label == worst
    assert ranked[0].screened.rate_per_gpu > 2 * ranked[-1].screened.rate_per_gpu
    assert best in [c.label for c in kept] and worst not in [c.label for c in kept]


def screened(label: str, rate: float, bound: str, family: str, num_gpus: int = 4) -> screen.Screened:
    return screen.Screened(label, rate, num_gpus, bound, family)


def test_the_shortlist_keeps_the_margin_the_reference_and_each_familys_best():
    search = [screened("colocated-4[chunk=512]", 60.0, "colocated", "colocated TP1"),
              screened("colocated-4[chunk=2048]", 60.0, "colocated", "colocated TP1"),   # the chunk does not bind
              screened("3P1D-adaptive[chunk=512]", 100.0, "adaptive", "adaptive TP1+TP1"),
              screened("2P2D-adaptive[chunk=512]", 99.0, "adaptive", "adaptive TP1+TP1"),
              screened("1P3D-adaptive[chunk=512]", 80.0, "local", "adaptive TP1+TP1"),
              screened("2P2D-adaptive[chunk=2048]", 80.0, "local", "adaptive TP1+TP1"),  # all colocated: alike
              screened("3P1D", 90.0, "prefill", "split TP1+TP1"),
              screened("1P3D", 20.0, "decode", "split TP1+TP1")]
    verdicts = screen.shortlist(search, 0.7)
    assert [label for label, why in verdicts.items() if why is None] == [
        "colocated-4[chunk=512]", "3P1D-adaptive[chunk=512]", "2P2D-adaptive[chunk=512]",
        "1P3D-adaptive[chunk=512]", "3P1D"]  # colocated below the margin: kept, the reference
    assert verdicts["colocated-4[chunk=2048]"] == "as colocated-4[chunk=512]"
    assert verdicts["2P2D-adaptive[chunk=2048]"] == "as 1P3D-adaptive[chunk=512]"
    assert verdicts["1P3D"] == "below 0.7x the best"
    # Three: the reference, then each family's best before a family's second.
    capped = screen.shortlist(search, 0.7, max_simulated=3)
    assert [label for label, why in capped.items() if why is None] == [
        "colocated-4[chunk=512]", "3P1D-adaptive[chunk=512]", "3P1D"]
    assert capped["2P2D-adaptive[chunk=512]"] == "beyond the 3 simulated (--max-simulated)"
    assert all(why is None for why in screen.shortlist(search, 0.0).values())  # 0: the full search
    with pytest.raises(ValueError, match="--screen-margin"):
        screen.shortlist(search, 1.5)
    with pytest.raises(ValueError, match="--max-simulated"):
        screen.shortlist(search, 0.7, max_simulated=0)


def test_the_screened_search_picks_the_full_searchs_best():
    """Prompts dominate, SLOs near the steps (so 3-s runs load the fleet): the full search (every
    candidate simulated) and the screened one (3 of 7) find the same best, at the same goodput,
    and every candidate both simulated has the same goodput (each search starts at its screened
    rate)."""
    profile = dict(PROFILE, fit={"coef_s": [1.5e-2, 2e-4, 1.8e-3, 5e-7], "error": 0.1})  # 10x slower
    kwargs = dict(dataset_name="random", slos_ms={"ttft": 200, "tpot": 60}, input_len=200, output_len=6)
    run = planner.RunLength(seconds=3.0, min_prompts=40, max_prompts=400)

    def search(margin: float, cap: int | None) -> tuple[list, list]:
        every = planner.candidates(4, (256,))
        kept = planner.screen_search(profile, every, margin=margin, max_simulated=cap, **kwargs)
        ranked = planner.plan(profile, num_gpus=4, search=kept, run_length=run, start_rate_per_gpu=None, **kwargs)
        return every, ranked

    every, full = search(0.0, None)
    _, screened_ = search(0.7, 3)
    assert len(full) == len(every) == 7 and len(screened_) == 3
    assert screened_[0].label == full[0].label == "3P1D" and screened_[0].goodput_rps == full[0].goodput_rps > 0
    assert full[0].goodput_per_gpu > 1.05 * full[1].goodput_per_gpu  # a clear best
    goodputs = {c.label: c.goodput_rps for c in full}
    assert all(c.goodput_rps == goodputs[c.label] for c in screened_)
