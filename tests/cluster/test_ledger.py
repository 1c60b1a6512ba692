"""The decodes' progress as arrays (`disagg.cluster.routing.placement.progress`): the `Ledger`'s
`ProgressTable` under random moves, its audit catching rows out of step, and the slacks and seat
waits computed over the arrays bit for bit as row by row. CPU only, no fleet."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from disagg.cluster.launch.bootstrap import Instance
from disagg.cluster.outputs import RequestMetrics
from disagg.cluster.routing.ledger import Ledger
from disagg.cluster.routing.placement import InstanceView
from disagg.cluster.routing.placement.progress import NO_PROGRESS, DecodeProgress, ProgressTable
from disagg.cluster.routing.requests import RoutedRequest
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.sampling import SamplingParams

MOVES = st.lists(st.tuples(st.sampled_from(("add", "set", "remove")), st.integers(0, 11),
                           st.floats(0, 100), st.integers(0, 3000), st.integers(1, 3000)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(moves=MOVES, now=st.floats(0, 200))
def test_a_progress_table_holds_the_rows_of_its_moves(moves, now):
    """Random adds, outputs and removes (the last row moving into each hole, the arrays growing
    past their capacity): after every move the table's rows are those of a dict kept alongside,
    its index sound, and its snapshot their progress at ``now``."""
    table, expected = ProgressTable(capacity=2), {}
    for move, i, first, num_output, max_tokens in moves:
        rid = f"r{i}"
        if move == "add" and rid not in expected:
            table.add(rid, first, num_output, max_tokens)
            expected[rid] = [first, num_output, max_tokens]
        elif move == "set":
            table.set_output(rid, num_output)
            if rid in expected:
                expected[rid][1] = num_output
        elif move == "remove":
            table.remove(rid)
            expected.pop(rid, None)
        assert table.audit() is None and len(table) == len(expected)
        assert sorted(table.snapshot(now)) == sorted((now - f, k, n) for f, k, n in expected.values())


def test_a_progress_table_counts_a_request_once():
    table = ProgressTable()
    table.add("a", 1.0, 2, 3)
    with pytest.raises(AssertionError, match="counted once"):
        table.add("a", 1.0, 2, 3)


def _decoding(ledger_instances, num_requests: int) -> list[RoutedRequest]:
    prefill, decode = ledger_instances
    live = []
    for i in range(num_requests):
        req = RoutedRequest(f"r{i}", [0] * (10 + i), SamplingParams(max_tokens=50 + i), lambda *a: None,
                            RequestMetrics(arrival_time=0.0), stage="decoding", decode=decode, prefill=prefill,
                            num_output=1, first_token_at=float(i))
        live.append(req)
    return live


def test_the_ledger_audit_catches_progress_out_of_step(monkeypatch):
    """The ledger's progress rows follow `advance` and `drop` (its audit compares them with the live
    requests'); a table that drops the moved row on a remove, or misses an output, is caught."""
    instances = [Instance("prefill-0", "prefill", actor=None), Instance("decode-0", "decode", actor=None)]
    ledger, live = Ledger(instances), _decoding(instances, 5)
    for req in live:
        ledger.touch(req)
    for req in live[:3]:
        req.num_output += 4
        ledger.advance(req, 4)
    ledger.drop(live[1])
    live.pop(1)
    assert ledger.audit(live, 10.0) is None
    assert sorted(ledger.tally(instances, 10.0)[0][id(instances[1])].progress) == sorted(
        (10.0 - r.first_token_at, r.num_output, r.params.max_tokens) for r in live)

    monkeypatch.setattr(ProgressTable, "set_output", lambda self, request_id, num_output: None)
    live[0].num_output += 1
    ledger.advance(live[0], 1)
    assert "progress" in ledger.audit(live, 10.0)
    monkeypatch.undo()
    ledger.rebuild(live)
    assert ledger.audit(live, 10.0) is None

    def remove_without_moving(self, request_id):  # the last row not moved into the hole
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.request_ids[row] = self.request_ids.pop()

    monkeypatch.setattr(ProgressTable, "remove", remove_without_moving)
    ledger.drop(live[0])
    assert "progress row" in ledger.audit(live[1:], 10.0)


ROWS = st.lists(st.tuples(st.floats(0, 50), st.integers(0, 2100), st.integers(1, 2000)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(rows=ROWS, bound_s=st.floats(1e-3, 0.2), incoming=st.integers(0, 5),
       output_tokens=st.one_of(st.none(), st.floats(1, 2000)), stall=st.floats(1.0, 3.0),
       max_seqs=st.integers(1, 80), seated=st.integers(0, 80), remaining=st.one_of(st.none(), st.integers(1, 9999)))
def test_slacks_and_seat_waits_over_the_arrays_are_the_ones_row_by_row(rows, bound_s, incoming, output_tokens, stall,
                                                                       max_seqs, seated, remaining):
    """`InstanceView.tpot_slacks_s` and `seat_wait_s` over a `DecodeProgress` equal, bit for bit,
    the decode-by-decode sums they stand for (a decision's exactness rests on it)."""
    model = StepTimeModel()
    v = InstanceView("D", model, 512, 0, max(len(rows), 1), 1000 * len(rows), None, 16, remaining_tokens=remaining,
                     output_tokens=output_tokens, stall_factor=stall, decode_progress=DecodeProgress.of(rows),
                     max_seqs=max_seqs, seated=seated, incoming=incoming)
    gap = stall * model.step_s(0, v.num_decoding, v.context_tokens, 0)
    slacks = [bound_s * (n - 1) - e - (n - k) * gap for e, k, n in rows if n > 1]
    if incoming and output_tokens and output_tokens > 1:
        slacks += [bound_s * (output_tokens - 1) - output_tokens * gap] * incoming
    assert sorted(v.tpot_slacks_s(bound_s).tolist()) == sorted(s for s in slacks if s >= 0)
    assert v.tpot_slack_s(bound_s) == min((s for s in slacks if s >= 0), default=None)

    over = seated + 1 - max_seqs
    ends = sorted(max(n - k, 0) * gap for _, k, n in rows)
    if over <= 0:
        expected = 0.0
    elif len(ends) >= over:
        expected = ends[over - 1]
    else:
        mean = remaining / v.num_decoding if remaining else 0.0
        expected = max(ends[-1] if ends else 0.0, mean * gap)
    assert v.seat_wait_s() == expected and type(v.seat_wait_s()) is float


def test_a_view_takes_progress_rows_as_tuples():
    rows = ((1.0, 5, 10), (2.5, 0, 3))
    v = InstanceView("D", StepTimeModel(), 512, decode_progress=rows)
    assert isinstance(v.decode_progress, DecodeProgress)
    assert v.decode_progress == rows and list(v.decode_progress) == list(rows)
    assert InstanceView("D", StepTimeModel(), 512).decode_progress == () == NO_PROGRESS
    assert hash(v.decode_progress) == hash(rows)
