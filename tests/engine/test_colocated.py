"""ColocatedEngine on the CPU with dummy:tiny: greedy tokens equal a full-recompute loop (chunked
prompts, mixed batches, preemption), seeded sampling independent of the batch, stop rules, aborts
at every stage and bad inputs (clear errors, engine keeps serving), every page freed at the end."""

from __future__ import annotations

import os

import pytest
from engine_helpers import assert_all_free, drain, reference_tokens

from disagg.engine import ColocatedEngine, EngineOptions
from disagg.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21],  # 11 tokens: split by an 8-token budget
           [42],
           [7, 7, 7, 100, 101, 102, 103, 250, 1, 0, 4, 9, 12, 18, 33, 99, 77, 64, 31, 8, 5],  # 21
           [150, 151, 3, 4, 90]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


ASYNC = {"on": False}  # set per test by `both_schedulings`


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def both_schedulings(request):
    """Every test runs with async scheduling off and on."""
    ASYNC["on"] = request.param
    yield request.param
    ASYNC["on"] = False


def _engine(model, **kw) -> ColocatedEngine:
    sizes = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    switches = dict(async_scheduling=ASYNC["on"])
    for name, value in kw.items():
        (sizes if name in sizes else switches)[name] = value
    return ColocatedEngine(model, **sizes, options=EngineOptions(**switches))


@pytest.fixture(scope="module")
def expected(tiny_model):
    """Greedy tokens of every prompt from the full-recompute loop (torch reference kernels)."""
    return list(reference_tokens(tiny_model, dict(enumerate(PROMPTS)), GREEDY.max_tokens).values())


def test_greedy_matches_full_recompute(tiny_model, torch_reference, expected):
    engine = _engine(tiny_model)
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"r{i}", prompt, GREEDY)
    results = drain(engine)
    for i in range(len(PROMPTS)):
        assert results[f"r{i}"] == {"tokens": expected[i], "reason": "length", "error": None}, i
    assert engine.stats()["num_preemptions"] == 0
    stats = engine.stats()  # decode-only steps ran the plan reserved during the step before
    assert stats["num_reserved_steps" if not ASYNC["on"] else "num_steps_ahead"] > 0
    assert_all_free(engine)


def test_reserved_step_rolls_back_on_arrival_abort_and_end(tiny_model, torch_reference, expected):
    """A step reserved while the last one ran is dropped (slots rolled back) when a request
    arrives, is aborted or ends; tokens stay those of the full-recompute loop."""
    engine = _engine(tiny_model)
    engine.add("r0", PROMPTS[0], GREEDY)
    engine.add("r1", PROMPTS[1], GREEDY)
    tokens: dict = {}

    def step() -> None:
        for out in engine.step():
            if out.token_id is not None:
                tokens.setdefault(out.request_id, []).append(out.token_id)

    while engine._next is None:
        step()
    lengths = {r.seq_id: engine.cache.seq_length(r.seq_id) for r in engine.scheduler.running}
    engine.add("r3", PROMPTS[3], GREEDY)  # arrival: the reserved decode-only step is not what runs
    step()
    for seq_id, length in lengths.items():  # the reserved slot rolled back, then one token computed
        assert engine.cache.seq_length(seq_id) == length
    while engine._next is None:
        step()
    assert engine.abort("r1")  # abort: the reserved step is dropped, its slots given back
    step()
    while engine.has_work():
        step()
    assert tokens["r0"] == expected[0] and tokens["r3"] == expected[3]
    assert len(tokens.get("r1", [])) < len(expected[1]) and tokens["r1"] == expected[1][:len(tokens["r1"])]
    assert engine.stats()["num_reserved_steps" if not ASYNC["on"] else "num_steps_ahead"] > 0
    assert_all_free(engine)
    engine.warmup(prompt_len=4)  # idle again: a step reserved before the end is no obstacle
    assert_all_free(engine)


def test_preemption_recomputes_identical_tokens(tiny_model, torch_reference, expected):
    engine = _engine(tiny_model, num_pages=9, max_num_batched_tokens=16)
    for i, prompt in enumerate(PROMPTS):
        engine.add(i, prompt, GREEDY)
    results = drain(engine)
    assert engine.stats()["num_preemptions"] > 0
    assert [results[i]["tokens"] for i in range(len(PROMPTS))] == expected
    assert_all_free(engine)


def test_stop_token_and_max_tokens(tiny_model, torch_reference, expected):
    engine = _engine(tiny_model)
    engine.add("stop", PROMPTS[0], SamplingParams(max_tokens=8, stop_token_ids=(expected[0][2],), ignore_eos=True))
    engine.add("one", PROMPTS[2], SamplingParams(max_tokens=1, ignore_eos=True))
    results = drain(engine)
    first_stop = expected[0].index(expected[0][2]) + 1
    assert results["stop"] == {"tokens": expected[0][:first_stop], "reason": "stop", "error": None}
    assert results["one"] == {"tokens": expected[2][:1], "reason": "length", "error": None}
    assert_all_free(engine)


def test_seeded_sampling_same_whatever_the_batch(tiny_model, torch_reference):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _engine(tiny_model)
    alone.add("x", PROMPTS[0], params)
    want = drain(alone)["x"]["tokens"]
    crowded = _engine(tiny_model, num_pages=10, max_num_batched_tokens=5)
    crowded.add("a", PROMPTS[2], SamplingParams(max_tokens=6, temperature=1.2, seed=7, ignore_eos=True))
    crowded.add("b", PROMPTS[3], GREEDY)
    crowded.add("x", PROMPTS[0], params)
    crowded.add("c", PROMPTS[1], SamplingParams(max_tokens=9, temperature=0.5, ignore_eos=True))
    got = drain(crowded)
    assert got["x"]["tokens"] == want
    other = _engine(tiny_model)
    other.add("y", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95,
                                              seed=4321, ignore_eos=True))
    assert drain(other)["y"]["tokens"] != want


def test_abort_at_every_stage_frees_every_page(tiny_model, torch_reference, expected):
    engine = _engine(tiny_model, max_num_batched_tokens=6)
    for i, prompt in enumerate(PROMPTS):
        engine.add(i, prompt, GREEDY)
    engine.add("queued", PROMPTS[3], GREEDY)
    assert engine.abort("queued")  # never scheduled
    early = engine.step()  # request 0 (11 tokens) is half computed
    assert engine.abort(0)  # mid-prompt
    for _ in range(6):
        early += engine.step()
    decoding = engine.scheduler.running[0].request_id
    assert engine.abort(decoding)  # mid-decode
    results = drain(engine)
    assert not engine.abort(decoding) and not engine.abort("never")
    aborts = [o for o in early if o.finish_reason == "abort"]
    assert [(o.request_id, o.token_id, o.finished) for o in aborts] == [("queued", None, True), (0, None, True)]
    assert results[decoding]["reason"] == "abort"
    for i in {1, 2, 3} - {decoding}:
        assert results[i]["tokens"][-1] == expected[i][-1] and results[i]["reason"] == "length"
    assert_all_free(engine)


@pytest.mark.parametrize("bad,kind,match", [
    (dict(prompt_token_ids=[]), ValueError, "prompt_token_ids.*at least 1"),
    (dict(prompt_token_ids=[1] * 4096), ValueError, "prompt_token_ids.*context is 4096"),
    (dict(prompt_token_ids=[1, 256]), ValueError, r"prompt_token_ids.*\[0, 256\)"),
    (dict(prompt_token_ids="abc"), TypeError, "prompt_token_ids"),
    (dict(params=SamplingParams(temperature=-1.0)), ValueError, "temperature"),
    (dict(params=SamplingParams(top_p=2.0)), ValueError, "top_p"),
    (dict(params=SamplingParams(max_tokens=0)), ValueError, "max_tokens"),
    (dict(params=SamplingParams(max_tokens=1000)), ValueError, "max_tokens.*pages"),
    (dict(params={"max_tokens": 3}), TypeError, "params"),
    (dict(request_id="good"), ValueError, "already in this engine"),
    (dict(request_id=["unhashable"]), TypeError, "request_id"),
])
def test_bad_input_is_refused_and_others_keep_running(tiny_model, torch_reference, expected, bad, kind, match):
    engine = _engine(tiny_model)
    engine.add("good", PROMPTS[1], GREEDY)
    first = engine.step()
    assert [o.token_id for o in first] == expected[1][:1]
    call = dict(request_id="bad", prompt_token_ids=PROMPTS[0], params=GREEDY)
    call.update(bad)
    with pytest.raises(kind, match=match):
        engine.add(call["request_id"], call["prompt_token_ids"], call["params"])
    results = drain(engine)
    assert results == {"good": {"tokens": expected[1][1:], "reason": "length", "error": None}}
    assert_all_free(engine)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 when triton is imported (make test sets it)")
def test_triton_interpreter_end_to_end(tiny_model, expected):
    engine = _engine(tiny_model, max_num_batched_tokens=7)
    engine.add("a", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add("b", PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    results = drain(engine)
    assert results["a"]["tokens"] == expected[0][:3]
    assert results["b"]["tokens"] == expected[1][:3]
    assert_all_free(engine)


def test_warmup_leaves_no_trace(tiny_model, torch_reference, expected):
    engine = _engine(tiny_model)
    seconds = engine.warmup()
    assert set(seconds) == {"prefill", "decode", "graphs", "prompt_graphs", "mixed_graphs"}
    assert seconds["graphs"] == seconds["prompt_graphs"] == seconds["mixed_graphs"] == 0.0  # no graphs on CPU
    assert_all_free(engine)
    engine.add("a", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="warmup"):
        engine.warmup()
    assert drain(engine)["a"]["tokens"] == expected[0]
    assert_all_free(engine)


def test_warmup_runs_a_fork_copy(tiny_model, torch_reference, monkeypatch, both_schedulings):
    """Warm-up launches the partial-page copy a mid-page prefix-cache hit needs, so serving never
    compiles the slot-copy kernel (test_engine_gpu.py::test_no_kernel_compiles_after_warmup)."""
    if not both_schedulings:
        pytest.skip("once is enough")
    from disagg.model import llama

    copies = []

    def counting_copy_slots(src, src_slots, dst, dst_slots, **kwargs):
        copies.append(int(src_slots.numel()))
        return real_copy_slots(src, src_slots, dst, dst_slots, **kwargs)
    real_copy_slots = llama.copy_slots
    monkeypatch.setattr(llama, "copy_slots", counting_copy_slots)
    engine = _engine(tiny_model)
    engine.warmup(prompt_len=40)
    assert copies == [1]  # the child forked one token into the warm-up prompt's first page
    assert_all_free(engine)


def test_async_scheduling_parity_stop_discard_and_deferred_release(tiny_model, torch_reference, expected,
                                                                  both_schedulings):
    """Async against sync on the same requests (greedy, seeded, a stop id): same outputs; an
    abort while a step is launched ahead keeps the pages until that step is read."""
    if not both_schedulings:
        pytest.skip("compares both modes once")
    params = {"g": GREEDY, "s": SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=3, ignore_eos=True),
              "stop": SamplingParams(max_tokens=8, stop_token_ids=(expected[0][3],), ignore_eos=True)}
    prompts = {"g": PROMPTS[2], "s": PROMPTS[3], "stop": PROMPTS[0]}
    outs = {}
    for mode in (False, True):
        engine = _engine(tiny_model, async_scheduling=mode)
        for rid in params:
            engine.add(rid, prompts[rid], params[rid])
        outs[mode] = drain(engine)
        assert_all_free(engine)
        assert (engine.stats()["num_steps_ahead"] > 0) == mode
    assert outs[True] == outs[False]
    assert outs[True]["stop"]["tokens"] == expected[0][:4] and outs[True]["stop"]["reason"] == "stop"

    engine = _engine(tiny_model, async_scheduling=True)
    engine.add("a", PROMPTS[2], GREEDY)
    engine.add("b", PROMPTS[3], GREEDY)
    early = []
    while engine._inflight is None:
        early += [o.token_id for o in engine.step() if o.request_id == "b"]
    victim = engine.requests["a"]
    free = engine.cache.num_free_pages
    assert engine.abort("a")
    assert victim.seq_id in engine.cache and engine.cache.num_free_pages == free  # a step still writes
    tokens = drain(engine)
    assert victim.seq_id not in engine.cache and tokens["a"]["reason"] == "abort"
    assert early + tokens["b"]["tokens"] == expected[3]
    assert_all_free(engine)


def test_prompts_join_the_step_launched_ahead(tiny_model, torch_reference, expected, both_schedulings):
    """Async scheduling with prompts arriving while decodes run: the step that starts them is
    launched behind the one in flight (its decodes fed that step's sampled ids on the device),
    with the outputs of sync scheduling: greedy, seeded (each row's draw index), a stop token and a
    length limit reached as a prompt joins; an abort of a prompt in that step keeps its pages
    until the step is read."""
    if not both_schedulings:
        pytest.skip("compares both modes once")
    seeded = SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=3, ignore_eos=True)
    stop = SamplingParams(max_tokens=8, stop_token_ids=(expected[0][3],), ignore_eos=True)
    arrivals = {0: [("a", PROMPTS[2], GREEDY), ("s", PROMPTS[3], seeded)],
                4: [("stop", PROMPTS[0], stop)], 7: [("b", PROMPTS[1], GREEDY)],
                9: [("c", PROMPTS[3], seeded), ("d", PROMPTS[2][:5], GREEDY)]}
    outs, stats = {}, {}
    for mode in (False, True):
        engine = _engine(tiny_model, async_scheduling=mode, max_num_batched_tokens=16)
        outs[mode] = drain(engine, arrivals=arrivals)
        stats[mode] = engine.stats()
        assert_all_free(engine)
    assert outs[True] == outs[False]
    assert stats[True]["num_prompt_steps_ahead"] > 0 and stats[False]["num_prompt_steps_ahead"] == 0
    assert outs[True]["stop"]["reason"] == "stop" and outs[True]["a"]["tokens"] == expected[2]
    off = _engine(tiny_model, async_scheduling=True, async_prompts=False, max_num_batched_tokens=16)
    assert drain(off, arrivals=arrivals) == outs[False] and off.stats()["num_prompt_steps_ahead"] == 0

    engine = _engine(tiny_model, async_scheduling=True, max_num_batched_tokens=16)
    engine.add("a", PROMPTS[2], GREEDY)
    while engine._inflight is None:
        engine.step()
    engine.add("late", PROMPTS[1], GREEDY)
    engine.step()  # launches the prompt behind the step in flight
    assert engine.stats()["num_prompt_steps_ahead"] == 1 and engine._inflight is not None
    victim = engine.requests["late"]
    assert victim.seq_id in engine._inflight.seq_ids
    free = engine.cache.num_free_pages
    assert engine.abort("late")
    assert victim.seq_id in engine.cache and engine.cache.num_free_pages == free  # the step still writes
    tokens = drain(engine)
    assert tokens["late"]["reason"] == "abort" and victim.seq_id not in engine.cache
    assert tokens["a"]["tokens"][-3:] == expected[2][-3:]
    assert_all_free(engine)
