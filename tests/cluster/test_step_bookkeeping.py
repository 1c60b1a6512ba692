"""The simulator's per-step bookkeeping, exactly: the `Ledger` under random touches, advances and
drops (its audit after every move), `SimRunner.shape_of` against the shape summed row by row,
`SimInstance.finish_step` grouping a step's outputs, and `StepTimeModel.step_s` against its
formula with `max`. CPU only, no fleet, no engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings, strategies as st

from disagg.cluster.launch.instance import Instance
from disagg.cluster.outputs import RequestMetrics
from disagg.cluster.routing.ledger import Ledger
from disagg.cluster.routing.requests import RoutedRequest
from disagg.cluster.simulate.instance import Forward, SimInstance, SimRunner, SimStep
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.engine.request import TokenOutput
from disagg.engine.steps import StepShape, prompt_pairs
from disagg.sampling import SamplingParams

INSTANCES = [Instance("prefill-0", "prefill", actor=None), Instance("decode-0", "decode", actor=None),
             Instance("decode-1", "decode", actor=None)]
LEDGER_MOVES = st.lists(st.tuples(st.sampled_from(("advance", "advance", "touch", "drop", "move")),
                                  st.integers(0, 5), st.integers(1, 3)), max_size=60)


def _decoding(i: int) -> RoutedRequest:
    return RoutedRequest(f"r{i}", [0] * (5 + i), SamplingParams(max_tokens=8 + i), lambda *a: None,
                         RequestMetrics(arrival_time=0.0), stage="decoding", decode=INSTANCES[1 + i % 2],
                         prefill=INSTANCES[0], num_output=1, first_token_at=float(i), kv_landed=True)


@settings(max_examples=200, deadline=None)
@given(moves=LEDGER_MOVES)
def test_the_ledger_sums_follow_random_advances_touches_and_drops(moves):
    """Advances past max_tokens (remaining held at 1), touches after advances (the share taken
    again from the request as it is), drops, and a decode moving to the other instance: after
    every move the ledger's sums and progress rows are those over the live requests."""
    ledger = Ledger(INSTANCES)
    live = {i: _decoding(i) for i in range(6)}
    for req in live.values():
        ledger.touch(req)
    for move, i, num_tokens in moves:
        req = live.get(i)
        if req is None:
            continue
        if move == "advance":
            req.num_output += num_tokens
            ledger.advance(req, num_tokens)
        elif move == "touch":
            ledger.touch(req)
        elif move == "move":
            req.decode = INSTANCES[2] if req.decode is INSTANCES[1] else INSTANCES[1]
            ledger.touch(req)
        else:
            ledger.drop(req)
            del live[i]
        assert ledger.audit(list(live.values()), 50.0) is None, (move, i)


def _plan(rows: list[tuple[int, int]], page_size: int) -> SimpleNamespace:
    """A plan's index pointers for rows of (tokens before, new tokens)."""
    new = np.array([n for _, n in rows], dtype=np.int64)
    after = np.array([b + n for b, n in rows], dtype=np.int64)
    pages = -(-after // page_size)
    qo, page_indptr = np.zeros(len(rows) + 1, dtype=np.int32), np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(new, out=qo[1:])
    np.cumsum(pages, out=page_indptr[1:])
    return SimpleNamespace(qo_indptr=qo, page_indptr=page_indptr,
                           last_page_len=((after - 1) % page_size + 1).astype(np.int32))


PLAN_ROWS = st.lists(st.tuples(st.sampled_from(("decode", "chunk", "last chunk")), st.integers(0, 5000),
                               st.integers(1, 3000)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(rows=PLAN_ROWS, page_size=st.sampled_from((1, 16, 64)))
def test_a_forward_shape_from_the_plan_is_the_one_summed_row_by_row(rows, page_size):
    """Decodes (sampled, decoding), a prompt's last chunk (sampled, not decoding) and earlier
    chunks (not sampled), in any order: `shape_of` is `StepShape` of their sums."""
    rows = [(kind, before, 1 if kind == "decode" else new) for kind, before, new in rows]
    plan = _plan([(before, new) for _, before, new in rows], page_size)
    sampled = [i for i, (kind, _, _) in enumerate(rows) if kind != "chunk"]
    requests = [SimpleNamespace(decoding=rows[i][0] == "decode") for i in sampled]
    chunks = [(before, new) for kind, before, new in rows if kind != "decode"]
    decodes = [before for kind, before, _ in rows if kind == "decode"]
    want = StepShape(sum(n for _, n in chunks), len(decodes), sum(decodes),
                     sum(prompt_pairs(b, n) for b, n in chunks))
    runner = SimRunner(StepTimeModel(), page_size, clock=lambda: 0.0, step_gap_s=0.0)
    assert runner.shape_of(plan, np.asarray(sampled, dtype=np.int64), requests) == want


def _finish(forwards: list[list[TokenOutput]], pushed: set) -> list[tuple]:
    shape = StepShape(0, 1, 1, 0)
    step = SimStep([Forward(shape, i, i + 1.0) for i in range(len(forwards))], forwards)
    return SimInstance.finish_step(SimpleNamespace(current=step, _pushed=pushed))


def test_a_step_end_gives_each_request_its_tokens_times_and_last_finish():
    one = TokenOutput("a", 0, False, None)
    pushed = {"b"}
    assert _finish([[one, TokenOutput("b", 0, True, "length")]], pushed) == [
        ("a", False, [1.0], False), ("b", True, [1.0], True)]
    assert pushed == set()  # a pushed prompt's first token ends its stay
    assert _finish([[one], [one], [TokenOutput("a", 0, True, "length")]], set()) == [
        ("a", True, [1.0, 2.0, 3.0], False)]
    assert _finish([[one, TokenOutput("a", 0, True, "length")]], set()) == [  # twice in one forward
        ("a", True, [1.0, 1.0], False)]


SHAPES = st.tuples(st.integers(0, 20000), st.integers(0, 512), st.integers(0, 10**6), st.integers(0, 10**9))
COEFS = st.tuples(*[st.floats(0, 1e-2, allow_subnormal=False)] * 9)


@settings(max_examples=500, deadline=None)
@given(shape=SHAPES, coef=COEFS, knee=st.sampled_from((256, 1024, 4096)))
def test_step_s_is_its_formula_bit_for_bit(shape, coef, knee):
    prompt, seqs, context, pairs = shape
    model = StepTimeModel(prior=coef, knee_tokens=knee)
    c = model.coef.tolist()
    seconds = c[1] * prompt + c[2] * seqs + c[3] * context + c[5] * pairs
    want = c[0] + seconds if prompt <= 0 else (c[4] + seconds + (c[6] if seqs > 0 else 0.0) + c[7] * context
                                               + c[8] * max(prompt - knee, 0))
    assert model.step_s(*shape) == want
