"""Each named rule of the placement (`disagg.cluster.routing.placement`) on its own: the policies, the
admission rules, the choosers and the fallbacks, on constructed predictions and views with exact
inputs and outputs. `test_placement.py` tests `decide`, the fold of them, on whole fleets."""

from __future__ import annotations

import typing

import pytest

from disagg.cluster.routing.placement import (ADAPTIVE, ADMISSION_RULES, CHOOSERS, DISAGGREGATED, FALLBACKS, KEEP_SHARE,
                                              LOCAL, PATHS, POLICIES, TPOT_SLACK, InstanceView, Judging, Prediction,
                                              Targets, admit, avoid_breaking, decide, decode_on_prefill, degraded_path,
                                              fastest, fits,
                                              least_violation, no_push, pages_fit, policy_of, prefer_balanced,
                                              prefer_fastest, prefer_remote, remote_within_targets, saturated_decodes,
                                              slack_breaks, spares_expected_pushes, spares_slack, sparing_prefills,
                                              stall_past_slack, tpot_bound, tpot_within_bound, ttft_within_target,
                                              violation, violation_cost, without_pushes)
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.config import RouterSection

# A step: 10 ms, + 0.1 ms per prompt token, + 0.05 ms per decoding sequence, + 0.1 ms per 1k
# context tokens. A pure decode step of nothing is 10 ms; a 4000-token chunk, 410 ms.
COEF = (1e-2, 1e-4, 5e-5, 1e-7)


def model(error: float = 0.05) -> StepTimeModel:
    m = StepTimeModel(prior=COEF)
    m.error = error
    return m


def view(name: str, **fields) -> InstanceView:
    """An idle instance of 4096-token chunks and 16-token pages, ``fields`` replaced."""
    return InstanceView(name, model(), 4096, **{"page_size": 16, **fields})


def pred(path: str, prefill: str, decode: str, ttft_ms: float, tpot_ms: float, margin: float = 0.0,
         **fields) -> Prediction:
    return Prediction(path, prefill, decode, ttft_ms / 1e3, tpot_ms / 1e3, margin, **fields)


def judging(*views: InstanceView, targets: Targets = Targets(), prompt_len: int = 32, bound_ms: float | None = None,
            broken: dict[str, float] | None = None) -> Judging:
    """A decision's judging over ``views``: no cache hits, ``broken`` requests per instance."""
    broken = broken or {}
    return Judging(prompt_len, {v.name: v for v in views}, targets, lambda v: 0,
                   {name: (count, f"breaks {count:g} on {name}") for name, count in broken.items()}, broken,
                   None if bound_ms is None else bound_ms / 1e3)


# ------------------------------------------------------------------ the policies
def test_every_router_placement_value_has_one_policy_and_an_unknown_one_is_refused():
    assert tuple(POLICIES) == typing.get_args(RouterSection.model_fields["placement"].annotation)
    assert policy_of("adaptive") is ADAPTIVE and policy_of("local") is LOCAL
    with pytest.raises(ValueError, match=r"router.placement: expected one of disaggregated, local, adaptive, got 'x'"):
        policy_of("x")


def test_the_policies_answer_what_the_placer_engines_simulator_and_planner_ask():
    assert DISAGGREGATED.paths == ("remote",) and LOCAL.paths == ("local",) and ADAPTIVE.paths == PATHS
    assert (DISAGGREGATED.predicts, LOCAL.predicts, ADAPTIVE.predicts) == (False, False, True)
    assert (DISAGGREGATED.always_local, LOCAL.always_local, ADAPTIVE.always_local) == (False, True, False)
    assert (DISAGGREGATED.keeps, LOCAL.keeps, ADAPTIVE.keeps) == (False, False, True)
    assert (DISAGGREGATED.mixes_phases, LOCAL.mixes_phases, ADAPTIVE.mixes_phases) == (False, True, True)


def test_degraded_path_puts_every_request_on_the_role_left():
    assert degraded_path(prefill_alive=False, decode_alive=True) == "local"
    assert degraded_path(prefill_alive=True, decode_alive=False) == "kept"
    assert degraded_path(prefill_alive=True, decode_alive=True) is None  # the policy's own paths
    assert degraded_path(prefill_alive=False, decode_alive=False) is None  # nothing can serve


def test_every_prefer_and_overload_value_has_its_rule_and_targets_refuse_others():
    assert set(CHOOSERS) == set(typing.get_args(RouterSection.model_fields["adaptive_prefer"].annotation))
    assert set(FALLBACKS) == set(typing.get_args(RouterSection.model_fields["adaptive_overload"].annotation))
    with pytest.raises(ValueError, match=r"Targets.prefer \(router.adaptive_prefer\): expected one of .*got 'slow'"):
        Targets(prefer="slow")
    with pytest.raises(ValueError, match=r"Targets.overload \(router.adaptive_overload\).*got 'drop'"):
        Targets.from_ms(100, 10, "fastest", "drop")


# ------------------------------------------------------------------ admission
def test_pages_fit_counts_a_pushes_expected_answer():
    # 2 free pages of 16 hold 31 tokens and the first output token; a push reserves its 16-token
    # answer too: 47 + 1 tokens need 3 pages.
    d = view("D", free_pages=2, output_tokens=16.0)
    j = judging(d, prompt_len=31)
    local, remote = pred("local", "D", "D", 10, 5), pred("remote", "P", "D", 10, 5)
    assert fits(local, j.views, 31) and not fits(remote, j.views, 31)
    assert pages_fit(local, j) == "" and pages_fit(remote, j) == "D has 2 free pages"
    assert pages_fit(remote, judging(view("D", output_tokens=16.0), prompt_len=31)) == ""  # unknown: enough


def test_ttft_within_target_admits_up_to_the_target_and_anything_without_one():
    j = judging(targets=Targets.from_ms(200, None))
    assert ttft_within_target(pred("local", "D", "D", 200, 5), j) == ""
    assert ttft_within_target(pred("local", "D", "D", 250, 5), j) == "TTFT 250.0 ms > target 200.0 ms"
    assert ttft_within_target(pred("local", "D", "D", 9e6, 5), judging()) == ""


def test_tpot_within_bound_never_refuses_a_push_without_a_tpot_target():
    loose = judging(bound_ms=11)  # no TPOT target: the bound is TPOT_SLACK x the remote step
    assert tpot_within_bound(pred("local", "D", "D", 10, 12), loose) == "TPOT 12.00 ms > bound 11.00 ms"
    assert tpot_within_bound(pred("kept", "P", "P", 10, 12), loose) == "TPOT 12.00 ms > bound 11.00 ms"
    assert tpot_within_bound(pred("remote", "P", "D", 10, 12), loose) == ""
    assert tpot_within_bound(pred("local", "D", "D", 10, 11), loose) == ""
    strict = judging(targets=Targets.from_ms(None, 11), bound_ms=11)
    assert tpot_within_bound(pred("remote", "P", "D", 10, 12), strict) == "TPOT 12.00 ms > bound 11.00 ms"
    assert tpot_within_bound(pred("local", "D", "D", 10, 99), judging()) == ""  # no bound at all


def test_tpot_bound_is_the_target_or_the_slack_over_the_least_remote_step_that_fits():
    d, tight = view("D"), view("T", free_pages=0)
    cands = [pred("remote", "P", "D", 10, 10), pred("remote", "P", "D", 10, 20), pred("remote", "P", "T", 10, 5),
             pred("local", "D", "D", 10, 1)]
    assert tpot_bound(cands, judging(d, tight)) == TPOT_SLACK * 0.01  # T's 5 ms does not fit
    assert tpot_bound(cands, judging(d, tight, targets=Targets.from_ms(None, 30))) == 0.03
    assert tpot_bound(cands[3:], judging(d, tight)) is None


def test_spares_slack_refuses_a_path_whose_prompt_instance_it_breaks():
    j = judging(broken={"P": 2, "Q": 0})
    assert spares_slack(pred("remote", "P", "D", 10, 5), j) == "breaks 2 on P"
    assert spares_slack(pred("kept", "Q", "Q", 10, 5), j) == ""
    assert spares_slack(pred("local", "D", "D", 10, 5), j) == ""  # D not judged: nothing broken


def test_admit_gives_the_first_refusal_in_rule_order_and_keeps_an_admitted_candidate():
    assert ADMISSION_RULES == (pages_fit, ttft_within_target, tpot_within_bound, spares_slack)
    j = judging(view("D", free_pages=0), view("E"), targets=Targets.from_ms(100, 10), bound_ms=10,
                broken={"P": 1})
    both = pred("local", "D", "D", 500, 50)  # no pages, and past both targets
    assert admit(both, j) == pred("local", "D", "D", 500, 50, admissible=False, why="D has 0 free pages")
    assert admit(pred("remote", "P", "E", 500, 50), j).why == "TTFT 500.0 ms > target 100.0 ms"
    assert admit(pred("remote", "P", "E", 50, 50), j).why == "TPOT 50.00 ms > bound 10.00 ms"
    assert admit(pred("remote", "P", "E", 50, 5), j).why == "breaks 1 on P"
    ok = pred("local", "E", "E", 50, 5)
    assert admit(ok, j) is ok


def test_stall_past_slack_counts_the_requests_a_prompt_s_chunks_take_past_their_slack():
    # D decodes nothing; 3 pushes of 40 tokens are on their way. At 25 ms each has
    # 25 ms x 39 - 40 x 10 ms = 575 ms of slack. 20,000 tokens are 5 chunks of 4000 (410 ms
    # each): a 2050-ms stall breaks all 3; 2000 tokens, one 210-ms chunk, none.
    d = view("D", output_tokens=40.0, incoming=3)
    assert stall_past_slack(d, 20_000, 0.025) == (3, "its chunks stall D's decodes 2050.0 ms > their TPOT "
                                                     "slack 575.0 ms (3 of 3)")
    assert stall_past_slack(d, 2000, 0.025) == (0, "")
    # No request known, 5 pushes a second decided to it: 5 x (2.05 - 0.575) s = 7.375 expected
    # to arrive while more of the stall than their slack is ahead of them.
    count, why = stall_past_slack(view("D", output_tokens=40.0, push_rate=5.0), 20_000, 0.025)
    assert count == pytest.approx(7.375)
    assert why == ("its chunks stall D's decodes 2050.0 ms > the slack of the pushes decided meanwhile, 575.0 ms, "
                   "7.4 pushes expected meanwhile")


def test_slack_breaks_leave_the_expected_pushes_out_and_need_a_tpot_target():
    d = view("D", output_tokens=40.0, incoming=3, push_rate=5.0)
    targets = Targets.from_ms(None, 25)
    assert slack_breaks([d], 20_000, Targets(), lambda v: 0) == {}
    assert slack_breaks([d], 20_000, targets, lambda v: 0) == {"D": stall_past_slack(view(
        "D", output_tokens=40.0, incoming=3), 20_000, 0.025)}


def test_sparing_prefills_are_those_it_breaks_nothing_on():
    p, q = view("P"), view("Q")
    assert sparing_prefills([p, q], judging(p, q, broken={"P": 1, "Q": 0})) == {"Q"}
    assert sparing_prefills([p, q], judging(p, q)) is None  # no TPOT target: nothing judged


def test_spares_expected_pushes_refuses_a_local_path_only_where_no_other_decode_takes_pushes():
    d = view("D", output_tokens=40.0, push_rate=5.0)
    e = view("E", output_tokens=40.0)
    targets = Targets.from_ms(None, 25)
    j = Judging.of(20_000, [], [d, e], targets)
    assert j.broken == {"D": 0, "E": 0}
    local = pred("local", "D", "D", 10, 5)
    judged, after = spares_expected_pushes([local, pred("remote", "P", "D", 10, 5)], [d, e], j)
    assert not judged[0].admissible and "7.4 pushes expected" in judged[0].why
    assert after.broken["D"] == pytest.approx(7.375) and after.stalls["D"][1] == judged[0].why
    elsewhere = [local, pred("remote", "P", "E", 10, 5)]  # the pushes can go to E
    assert spares_expected_pushes(elsewhere, [d, e], j) == (elsewhere, j)
    no_target = Judging.of(20_000, [], [d, e], Targets())
    assert spares_expected_pushes([local], [d, e], no_target) == ([local], no_target)


# ------------------------------------------------------------------ choice among the admissible
def test_fastest_takes_the_lowest_ttft_and_near_ties_by_preference():
    kept, remote = pred("kept", "P", "P", 90, 5), pred("remote", "P", "D", 100, 5, 0.05)
    # local within its own 20% margin of the best: the near-ties are all three, local preferred
    assert fastest([kept, remote, pred("local", "D", "D", 105, 5, 0.2)]).path == "local"
    # within only 10%: 105 > 99 ms, no tie; remote's 5% neither: kept
    assert fastest([kept, remote, pred("local", "D", "D", 105, 5, 0.1)]) is kept
    # the chosen path's fastest candidate, even one outside the ties
    slow, quick = pred("local", "D", "D", 100, 5, 0.2), pred("local", "E", "E", 95, 5, 0.0)
    assert fastest([pred("remote", "P", "D", 90, 5), slow, quick]) is quick


def test_remote_within_targets_needs_a_ttft_target_and_an_admissible_push():
    a, b = pred("remote", "P", "D", 80, 5), pred("remote", "P", "E", 70, 5)
    local = pred("local", "D", "D", 10, 5)
    assert remote_within_targets([local, a, b], Targets.from_ms(100, None)) is b
    assert remote_within_targets([local, a, b], Targets()) is None
    assert remote_within_targets([local], Targets.from_ms(100, None)) is None


def test_decode_on_prefill_hands_a_loaded_decode_instance_s_decode_to_a_kept_path():
    # D decodes at 11 ms (13 ms of TPOT, 2 of them its seat wait): past half the 20-ms target;
    # kept's 5 ms is lower. One of P's decode steps (one sequence, 32 tokens of context) is
    # 10 + 0.05 + 0.0032 = 10.0532 ms.
    views = {"P": view("P")}
    pushed = pred("remote", "P", "D", 50, 13, 0.05, seat_tpot_s=0.002)
    kept = pred("kept", "P", "P", 50, 5)
    ok = [pushed, kept]
    assert decode_on_prefill(32, pushed, ok, views, Targets.from_ms(None, 20)) is kept
    # half the TTFT target must hold the kept TTFT and one of P's steps: 60.05 ms <= 100, not <= 60
    assert decode_on_prefill(32, pushed, ok, views, Targets.from_ms(200, 20)) is kept
    assert decode_on_prefill(32, pushed, ok, views, Targets.from_ms(120, 20)) is None
    # ... the whole of it where D is within its model's error of the target: 11.5 x 1.05 > 11.5
    near = pred("remote", "P", "D", 50, 13.5, 0.05, seat_tpot_s=0.002)
    assert decode_on_prefill(32, near, [near, kept], views, Targets.from_ms(120, 11.5)) is kept
    assert decode_on_prefill(32, pushed, ok, views, Targets()) is None  # no TPOT target
    assert decode_on_prefill(32, kept, ok, views, Targets.from_ms(None, 20)) is None  # kept already
    assert decode_on_prefill(32, pushed, ok, views, Targets.from_ms(None, 22.1)) is None  # 11 ms < 11.05
    slow_kept = pred("kept", "P", "P", 50, 12)  # no faster than D's 11 ms
    assert decode_on_prefill(32, pushed, [pushed, slow_kept], views, Targets.from_ms(None, 20)) is None
    assert KEEP_SHARE == 0.5


def test_the_choosers_of_adaptive_prefer():
    p = view("P")
    pushed = pred("remote", "P", "D", 50, 13, seat_tpot_s=0.002)
    local, kept = pred("local", "D", "D", 20, 13), pred("kept", "P", "P", 60, 5)
    ok = [pushed, local, kept]
    j = judging(p, targets=Targets.from_ms(1000, 20))
    assert prefer_fastest(ok, j) is local
    assert prefer_remote(ok, j) is pushed
    assert prefer_remote(ok, judging(p, targets=Targets.from_ms(None, 20))) is local  # no TTFT target
    assert prefer_balanced(ok, j) is kept  # local's D is at 13 of 20 ms: its decode goes to P
    assert prefer_balanced([pushed, local], j) is local
    assert CHOOSERS == {"fastest": prefer_fastest, "remote": prefer_remote, "balanced": prefer_balanced}


# ------------------------------------------------------------------ none admissible
def test_violation_is_the_worst_ratio_to_the_targets_and_the_cost_adds_the_requests_broken():
    c = pred("remote", "P", "D", 400, 30, prefill_tpot_s=0.04)  # P's kept requests at 40 ms
    targets = Targets.from_ms(200, 20)
    assert violation(c, targets, 0.02) == pytest.approx(2.0 + 4e-10, abs=1e-15)  # 40/20 = 400/200 = 2
    assert violation(c, Targets.from_ms(100, 20), 0.02) == pytest.approx(4.0 + 4e-10, abs=1e-15)
    assert violation(c, Targets(), None) == pytest.approx(4e-10)  # nothing to miss: the TTFT breaks ties
    assert violation_cost(c, judging(targets=targets, bound_ms=20, broken={"P": 3})) == pytest.approx(5.0, abs=1e-9)


def test_saturated_decodes_miss_the_bound_already_or_have_their_running_decodes_broken():
    d, e = view("D"), view("E")
    f = view("F", incoming=2, output_tokens=40.0)  # only pushes on their way: not saturated
    judged = [pred("remote", "P", "D", 10, 30), pred("remote", "P", "E", 10, 5)]
    j = judging(d, e, f, targets=Targets.from_ms(None, 20), bound_ms=20, broken={"E": 1, "F": 2, "P": 0},
                prompt_len=20_000)
    assert saturated_decodes(judged, j) == {"D", "E"}


def test_avoid_breaking_drops_local_on_saturated_and_paths_through_broken_prefills():
    j = judging(view("D"), view("E"), view("P"), targets=Targets.from_ms(None, 20), bound_ms=20, broken={"P": 1})
    on_d, on_e = pred("local", "D", "D", 10, 5), pred("local", "E", "E", 10, 5)
    via_p, via_q = pred("remote", "P", "E", 10, 5), pred("remote", "Q", "E", 10, 5)
    kept_p = pred("kept", "P", "P", 1, 1)
    judged = [pred("remote", "P", "D", 10, 30), on_d, on_e, via_p, via_q, kept_p]  # D misses the bound
    assert avoid_breaking([on_d, on_e, via_p, via_q, kept_p], judged, j) == [on_e, via_q]
    assert avoid_breaking([on_d, via_p], judged, j) == [on_d, via_p]  # nothing spares them: all


def test_without_pushes_keeps_the_pushes_only_where_nothing_else_is_left():
    remote, kept = pred("remote", "P", "D", 10, 5), pred("kept", "P", "P", 10, 5)
    assert without_pushes([remote, kept]) == [kept] and without_pushes([remote]) == [remote]


def test_least_violation_pushes_where_it_misses_least_and_no_push_keeps_instead():
    j = judging(view("D"), targets=Targets.from_ms(100, 20), bound_ms=20)
    remote, kept = pred("remote", "P", "D", 150, 10), pred("kept", "P", "P", 180, 10)  # 1.5 vs 1.8 x the TTFT
    assert least_violation([remote, kept], [remote, kept], j) is remote
    assert no_push([remote, kept], [remote, kept], j) is kept
    assert no_push([remote], [remote], j) is remote
    assert FALLBACKS == {"least_violation": least_violation, "no_push": no_push}


def test_decide_chooses_nothing_where_no_path_has_the_pages():
    full = dict(free_pages=0)
    dec = decide(32, [view("P", **full)], [view("D", **full)], Targets.from_ms(100, 20))
    assert dec.chosen is None and dec.path is None
    assert {c.why for c in dec.predictions} == {"D has 0 free pages", "P has 0 free pages"}
