"""`Placer` (cluster/routing/placement/placer.py): the one placement of the router and the simulator, on
constructed instances and requests (no Ray, no engine): which route for which fleet state, in which order the
decode instances are tried, the prefill-queue bound, counts and prefix affinity."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.cluster.launch.bootstrap import Instance
from disagg.cluster.outputs import RequestMetrics
from disagg.cluster.routing.affinity import PrefixAffinity
from disagg.cluster.routing.placement import Decision, Prediction
from disagg.cluster.routing.placement.placer import WAIT_PAGES, WAIT_PREFILL_QUEUE, Alone, Fail, Placer, Remote, Wait
from disagg.cluster.routing.requests import Picker, RoutedRequest
from disagg.config import Config
from disagg.errors import NoLiveInstance
from disagg.sampling import SamplingParams

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def fleet(placement: str = "disaggregated", **overrides):
    """A tiny-2p2d placer (prefill queue bound 100 tokens) and its four instances by name."""
    config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override(
        {"router.placement": placement, "router.prefill_queue_tokens": 100, **overrides})
    instances = [Instance(f"{role}-{i}", role, actor=None) for role in ("prefill", "decode") for i in range(2)]
    affinity = PrefixAffinity(config.cache.page_size, 64) if config.cache.prefix_caching else None
    placer = Placer(config, instances, Picker(config.router.policy), affinity)
    return placer, {inst.name: inst for inst in instances}


def request(name: str, prompt: list[int], *, prefill=None, decode=None, stage="queued") -> RoutedRequest:
    return RoutedRequest(name, prompt, SamplingParams(max_tokens=8), lambda *a: None, RequestMetrics(arrival_time=0.0),
                         stage=stage, prefill=prefill, decode=decode)


def test_remote_tries_the_least_loaded_decode_first_and_hands_to_the_least_loaded_prefill():
    placer, by = fleet()
    busy = request("busy", [1] * 40, prefill=by["prefill-0"], decode=by["decode-0"], stage="prefilling")
    req = request("r", [2] * 20)
    route = placer.route(req, [busy])
    assert isinstance(route, Remote) and [i.name for i in route.decodes] == ["decode-1", "decode-0"]
    assert placer.placements["remote"] == 0  # counted once a decode instance took it
    assert placer.hand(req, route.decodes[0], [busy]).name == "prefill-1"
    assert dict(placer.placements) == {"remote": 1, "local": 0, "kept": 0}


def test_the_prefill_queue_bound_holds_the_request_until_a_prefill_instance_has_room():
    placer, by = fleet()
    live = [request(f"q{i}", [1] * 60, prefill=by[f"prefill-{i}"], decode=by["decode-0"], stage="prefilling")
            for i in range(2)]
    assert placer.route(request("r", [2] * 50), live) == Wait(WAIT_PREFILL_QUEUE)  # 60 + 50 > 100
    assert isinstance(placer.route(request("r", [2] * 40), live), Remote)  # 60 + 40 fits
    live[1].stage = "decoding"  # prefill-1's queue emptied: an idle instance takes any prompt
    assert isinstance(placer.route(request("r", [2] * 500), live), Remote)
    # A request still reserving (no prefill instance yet) will queue its prompt too.
    reserving = request("v", [3] * 60, stage="reserving")
    assert placer.route(request("r", [2] * 50), [*live, reserving]) == Wait(WAIT_PREFILL_QUEUE)
    assert isinstance(placer.route(request("r", [2] * 40), [*live, reserving]), Remote)


def test_requests_decoding_on_a_prefill_instance_queue_no_prompt_there():
    # Kept requests past their first token weigh their tokens in the picker's loads, but queue
    # no prompt: the prefill-queue bound (prompt tokens not yet computed) lets the next prompt in.
    placer, by = fleet()
    live = []
    for i in range(2):
        kept = request(f"k{i}", [1] * 90, stage="decoding")
        kept.colocated, kept.num_output = by[f"prefill-{i}"], 5
        live.append(kept)
    assert placer.picker.loads(list(by.values()), live)["prefill-0"] == 95
    assert isinstance(placer.route(request("r", [2] * 50), live), Remote)  # 0 + 50 <= 100
    live[0].num_output = live[1].num_output = 0  # their prompts not yet computed: 90 + 50 > 100
    assert placer.route(request("r", [2] * 50), live) == Wait(WAIT_PREFILL_QUEUE)


def test_the_dead_are_never_tried_and_only_a_fleet_with_none_left_fails():
    placer, by = fleet()
    by["decode-0"].alive = False
    route = placer.route(request("r", [1] * 10), [])
    assert [i.name for i in route.decodes] == ["decode-1"] and placer.degraded is None
    by["prefill-0"].alive = by["prefill-1"].alive = False
    assert placer.hand(request("r", [1] * 10), by["decode-1"], []) is None
    by["decode-1"].alive = False
    route = placer.route(request("r", [1] * 10), [])
    assert route == Fail("decode") and isinstance(route.error(), NoLiveInstance) and route.error().role == "decode"


@pytest.mark.parametrize("placement", ["disaggregated", "local", "adaptive"])
def test_a_fleet_that_lost_a_whole_role_serves_every_request_on_the_survivors(placement: str):
    placer, by = fleet(placement)
    busy = request("busy", [1] * 40, decode=by["decode-0"], stage="decoding")

    def no_decision(*args):
        raise AssertionError("a degraded fleet has one path: nothing to decide")

    by["prefill-0"].alive = by["prefill-1"].alive = False
    route = placer.route(request("r", [2] * 20), [busy], no_decision)
    assert route == Alone(by["decode-1"], "local") and placer.degraded == "local"  # the least loaded
    by["prefill-1"].alive, by["decode-0"].alive, by["decode-1"].alive = True, False, False
    route = placer.route(request("r", [2] * 20), [busy], no_decision)
    assert route == Alone(by["prefill-1"], "kept") and placer.degraded == "kept"
    assert dict(placer.placements) == {"remote": 0, "local": 1, "kept": 1}


def test_local_placement_goes_alone_on_the_least_loaded_decode_instance_and_counts_it():
    placer, by = fleet("local")
    busy = request("busy", [1] * 40, decode=by["decode-1"], stage="decoding")
    route = placer.route(request("r", [2] * 20), [busy])
    assert route == Alone(by["decode-0"], "local") and placer.placements["local"] == 1


@pytest.mark.parametrize("path", ["remote", "local", "kept"])
def test_adaptive_follows_the_decision(path: str):
    placer, by = fleet("adaptive")
    decode = "decode-1"  # not the picker's first: a remote decision puts it first
    chosen = Prediction(path, "prefill-1" if path != "local" else decode,
                        "prefill-1" if path == "kept" else decode, 0.0, 0.0, 0.0)
    seen = []

    def decide(req, prefills, decodes, live):
        seen.append(([p.name for p in prefills], [d.name for d in decodes]))
        return Decision(chosen, (chosen,))

    route = placer.route(request("r", [1] * 10), [], decide)
    assert seen == [(["prefill-0", "prefill-1"], ["decode-0", "decode-1"])]
    if path == "remote":
        assert [i.name for i in route.decodes] == ["decode-1", "decode-0"]
    else:
        assert route == Alone(by[chosen.decode], path) and placer.placements[path] == 1
    assert placer.route(request("w", [1] * 10), [], lambda *a: Decision(None, ())) == Wait(WAIT_PAGES)


def test_a_push_the_placer_sends_counts_in_its_decode_instances_push_rate():
    """A remote route notes a push to its decode instance (`FleetModel.note_push`), at the placer's
    clock; a remote decision held back by the prefill-queue bound sends nothing and notes nothing."""
    placer, by = fleet("adaptive")
    now = [10.0]
    placer.clock = lambda: now[0]
    chosen = Prediction("remote", "prefill-1", "decode-1", 0.0, 0.0, 0.0)
    decide = lambda *a: Decision(chosen, (chosen,))  # noqa: E731
    pushes = placer.fleet_model.pushes
    full = [request(f"q{i}", [1] * 90, prefill=by[f"prefill-{i}"], decode=by["decode-0"], stage="prefilling")
            for i in range(2)]
    assert placer.route(request("held", [2] * 50), full, decide) == Wait(WAIT_PREFILL_QUEUE)
    assert "decode-1" not in pushes
    for i in range(3):
        assert isinstance(placer.route(request(f"r{i}", [2] * 10), [], decide), Remote)
    assert pushes["decode-1"].rate(10.0) == pytest.approx(3 / 2.0) and "decode-0" not in pushes
    view = placer.fleet_model.view(by["decode-1"], [], now=10.0)
    assert view.push_rate == pytest.approx(1.5) and placer.fleet_model.view(by["decode-0"], [], now=10.0).push_rate == 0


def test_adaptive_remote_hands_the_prompt_to_the_prefill_instance_its_decision_predicted():
    """The picker would send it to prefill-0 (prefill-1 holds a kept request's tokens): the TTFT
    the decision chose was prefill-1's, so prefill-1 computes it; once, and while it lives."""
    placer, by = fleet("adaptive")
    kept = request("kept", [1] * 500)
    kept.colocated, kept.stage = by["prefill-1"], "running"
    chosen = Prediction("remote", "prefill-1", "decode-0", 0.0, 0.0, 0.0)
    decide = lambda *a: Decision(chosen, (chosen,))  # noqa: E731
    for name, prefill_alive in (("r", True), ("dead", False)):
        req = request(name, [2] * 10)
        route = placer.route(req, [kept], decide)
        by["prefill-1"].alive = prefill_alive
        assert placer.hand(req, route.decodes[0], [kept]).name == ("prefill-1" if prefill_alive else "prefill-0")
    by["prefill-1"].alive = True
    assert placer.hand(req, by["decode-0"], [kept]).name == "prefill-0"  # its decision was used: the picker's
    assert placer.placements["remote"] == 3


def test_adaptive_decisions_are_kept_for_stats():
    placer, _ = fleet("adaptive")
    placer.route(request("r", [1] * 10), [])
    assert len(placer.decisions) == 1 and {p.path for p in placer.decisions[0].predictions} == {"remote", "local", "kept"}
    placer.clear_counts()
    assert not placer.decisions and sum(placer.placements.values()) == 0


def place_both(prompts: list[list[int]], **overrides) -> tuple[list[tuple[str, str]], int]:
    """Place each prompt remote in turn (the first reservation taken), loads of the earlier ones
    counted, the second prompt's pair idle but for a 30-token request: where each went, and the hits."""
    placer, by = fleet(**overrides)
    live, where = [], []
    for i, prompt in enumerate(prompts):
        req = request(f"r{i}", prompt)
        decode = placer.route(req, live).decodes[0]
        prefill = placer.hand(req, decode, live)
        req.prefill, req.decode, req.stage = prefill, decode, "prefilling"
        live.append(req)
        where.append((prefill.name, decode.name))
        if i == 0:  # load the other pair less than the first request, more than its prefix's credit
            other = [by[n] for n in ("prefill-0", "prefill-1", "decode-0", "decode-1") if n not in where[0]]
            live.append(request("other", [7] * 30, prefill=other[0], decode=other[1], stage="prefilling"))
    return where, placer.affinity_hits


def test_prefix_affinity_sends_a_shared_prefix_back_where_it_went():
    shared = list(range(100, 164))  # four pages of 16
    prompts = [shared + [1, 2, 3], shared + [9, 9, 9]]
    where, hits = place_both(prompts)
    assert where[1] == where[0] and hits == 2  # 67 - 64 credited < 30
    where, hits = place_both(prompts, **{"cache.prefix_caching": False})
    assert where[1] != where[0] and hits == 0  # 67 > 30: the less loaded pair
    where, hits = place_both([prompts[0], [5] * 67])
    assert where[1] != where[0] and hits == 0  # no shared prefix, no credit


def test_a_step_profile_seeds_every_instance_model_and_a_bad_one_is_refused(tmp_path):
    """router.step_profile: each instance's step-time model starts from the profile's fit (the
    adaptive predictions before its own steps), then learns from its own samples."""
    import json

    import pytest

    from disagg.cluster.simulate.step_model import StepTimeModel
    from disagg.cluster.simulate.profile import PROFILE_KIND, PROFILE_VERSION
    from disagg.errors import ConfigError

    fit = StepTimeModel(prior=(4e-3, 2e-5, 1e-5, 4e-8, 5e-3, 1e-9, 2e-3, 1e-8, 1e-5)).to_dict()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"kind": PROFILE_KIND, "version": PROFILE_VERSION, "fit": fit, "engine": {}}))
    placer, _ = fleet("adaptive", **{"router.step_profile": str(path)})
    seeded = placer.fleet_model.model_of("decode-1")
    assert list(seeded.coef) == fit["coef_s"] and list(seeded.prior) == fit["coef_s"]
    default, _ = fleet("adaptive")
    assert list(default.fleet_model.model_of("decode-1").coef) == list(StepTimeModel().prior)
    for _ in range(64):  # its own steps: 9 ms pure-decode steps of 8 sequences
        seeded.observe(0, 8, 8000, 0, 9e-3)
    assert seeded.step_s(0, 8, 8000, 0) == pytest.approx(9e-3, rel=0.05)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="router.step_profile"):
        fleet("adaptive", **{"router.step_profile": str(path)})
    with pytest.raises(ConfigError, match="router.step_profile"):
        fleet("adaptive", **{"router.step_profile": str(tmp_path / "missing.json")})


def test_launch_refuses_a_bad_step_profile_before_starting_a_fleet(tmp_path, monkeypatch):
    import pytest

    from disagg.cluster import cluster as cluster_module
    from disagg.errors import ConfigError

    def started(config):
        raise AssertionError("the fleet started before router.step_profile was checked")

    monkeypatch.setattr(cluster_module, "start_fleet", started)
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml").override({"router.step_profile": str(tmp_path / "no.json")})
    with pytest.raises(ConfigError, match="router.step_profile: cannot read"):
        cluster_module.Cluster.launch(config)


def test_a_remote_decisions_prompt_is_queued_on_its_prefill_instance_while_its_reservation_is_on_its_way():
    """Between a remote decision and the decode instance's answer the request has no prefill
    instance yet; the next decision (the same instant, requests released together) still sees its
    prompt queued on the one its decision named, not an idle instance."""
    placer, by = fleet("adaptive")
    first = request("r1", [1] * 300)
    chosen = Prediction("remote", "prefill-1", "decode-0", 0.0, 0.0, 0.0)
    route = placer.route(first, [], lambda *a: Decision(chosen, (chosen,)))
    assert isinstance(route, Remote)
    first.stage = "reserving"  # `Router._reserve` under way: ``prefill`` is still None
    views = {}

    def decide(req, prefills, decodes, live):
        views.update({p.name: placer.fleet_model.view(p, live, None, placer._remote_prefill) for p in prefills})
        return placer.decide(req, prefills, decodes, live)

    placer.route(request("r2", [2] * 40), [first], decide)
    assert (views["prefill-1"].queued_prompt_tokens, views["prefill-0"].queued_prompt_tokens) == (300, 0)
    kept = next(p for p in placer.decisions[-1].predictions if p.path == "kept" and p.prefill == "prefill-1")
    idle = next(p for p in placer.decisions[-1].predictions if p.path == "kept" and p.prefill == "prefill-0")
    assert kept.ttft_s > idle.ttft_s  # priced behind r1's 300 tokens
    first.prefill = placer.hand(first, by["decode-0"], [first])  # answered: counted as its prefill's
    assert placer.fleet_model.view(by["prefill-1"], [first], None, placer._remote_prefill).queued_prompt_tokens == 300


def test_the_adaptive_decision_prices_each_instance_at_what_follows_the_prefix_it_holds():
    """The first prompt of a shared prefix goes to prefill-1 (kept); the second, sharing its 64
    tokens (four pages), is priced there at its 3 new tokens, everywhere else whole, and the
    first one queued there counts at what follows the prefix it was credited with (none)."""
    placer, by = fleet("adaptive")
    shared = list(range(100, 164))
    first = request("r1", shared + [1, 2, 3])
    chosen = Prediction("kept", "prefill-1", "prefill-1", 0.0, 0.0, 0.0)
    assert placer.route(first, [], lambda *a: Decision(chosen, (chosen,))) == Alone(by["prefill-1"], "kept")
    assert first.cached_tokens == 0
    first.colocated, first.stage = by["prefill-1"], "running"
    second = request("r2", shared + [9, 9, 9])
    seen = {}

    def decide(req, prefills, decodes, live):
        decision = placer.decide(req, prefills, decodes, live)
        seen.update({(c.path, c.prefill): c.ttft_s for c in decision.predictions})
        return decision

    placer.route(second, [first], decide)
    views = {v.name: placer.fleet_model.view(by[v.name], [first]) for v in by.values()}
    assert views["prefill-1"].queued_prompt_tokens == 67  # r1 was credited with nothing
    p1, p0 = views["prefill-1"], views["prefill-0"]
    # kept on prefill-1: r1's 67 queued, then 3 tokens attending to 67; on prefill-0 the whole 67
    assert seen[("kept", "prefill-1")] - p1.relay_s == pytest.approx(
        max(p1.prompt_wait_s(), p1.seat_wait_s()) + p1.prefill_s(67, 64))
    assert seen[("kept", "prefill-0")] - p0.relay_s == pytest.approx(
        max(p0.prompt_wait_s(), p0.seat_wait_s()) + p0.prefill_s(67))
    if placer.decisions[-1].path != "local":  # computed on a prefill instance: credited there
        assert second.cached_tokens == (64 if placer.decisions[-1].chosen.prefill == "prefill-1" else 0)
    # queued where its prefix is, a credited prompt counts its new tokens only
    second.colocated, second.stage, second.cached_tokens = by["prefill-1"], "running", 64
    assert placer.fleet_model.view(by["prefill-1"], [first, second]).queued_prompt_tokens == 67 + 3


def test_first_tokens_measure_each_paths_ttft_miss_on_the_instance_that_computed_it():
    """An adaptive decision's TTFT prediction against the time to its first token (the placer's
    clock): the miss goes to that path of the prompt's instance (a diagnostic: the predictions
    that follow are unchanged)."""
    now = [100.0]
    config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override({"router.placement": "adaptive"})
    instances = [Instance(f"{role}-{i}", role, actor=None) for role in ("prefill", "decode") for i in range(2)]
    placer = Placer(config, instances, Picker(config.router.policy), clock=lambda: now[0])
    by = {inst.name: inst for inst in instances}
    req = request("r", [3] * 40)
    route = placer.route(req, [])
    chosen = placer.decisions[-1].chosen
    if isinstance(route, Remote):
        req.decode, req.prefill = route.decodes[0], placer.hand(req, route.decodes[0], [])
        computing, path = req.prefill, "remote"
    else:
        req.colocated, computing, path = route.instance, route.instance, route.path
    assert path == chosen.path
    now[0] += chosen.ttft_s + 0.250  # 250 ms later than predicted
    placer.first_token(req)
    assert req.first_token_at == now[0]  # its TPOT so far counts from here (`FleetModel.view`)
    assert placer.fleet_model.ttft_miss[computing.name] == {path: pytest.approx(0.250)}
    placer.first_token(req)  # once per request
    assert placer.fleet_model.ttft_miss[computing.name][path] == pytest.approx(0.250)
    placer.decide(request("r2", [3] * 40), [by["prefill-0"], by["prefill-1"]], [by["decode-0"], by["decode-1"]], [])
    same = next(p for p in placer.decisions[-1].predictions if p.path == path and p.prefill == chosen.prefill)
    assert same.ttft_s == pytest.approx(chosen.ttft_s)
    assert placer.fleet_model.snapshot()[computing.name]["ttft_miss_ms"] == {path: pytest.approx(250.0)}


def test_the_decision_that_placed_a_request_goes_to_the_trace_at_its_first_token(tmp_path, monkeypatch):
    """While tracing, a request placed adaptively gets one "decision" record when its first token
    comes: the decision that placed it (the last, if it was decided again while waiting), every
    candidate's predicted TTFT and TPOT, the path taken and the TTFT since the decision."""
    import time

    from disagg import trace

    now = [100.0]
    config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override({"router.placement": "adaptive"})
    instances = [Instance(f"{role}-{i}", role, actor=None) for role in ("prefill", "decode") for i in range(2)]
    placer = Placer(config, instances, Picker(config.router.policy), clock=lambda: now[0])
    quiet = request("quiet", [1] * 10)
    route = placer.route(quiet, [])
    quiet.colocated = route.instance if isinstance(route, Alone) else None
    quiet.prefill = None if isinstance(route, Alone) else instances[0]
    placer.first_token(quiet)  # tracing off: nothing written
    monkeypatch.setenv(trace.ENV, str(tmp_path))
    req = request("r", [1] * 10)
    placer.route(req, [])  # decided twice: the second decision is the one that placed it
    now[0] += 0.5
    route = placer.route(req, [])
    decision = placer.decisions[-1]
    req.colocated = route.instance if isinstance(route, Alone) else None
    req.prefill = None if isinstance(route, Alone) else instances[0]
    now[0] += 0.025
    before = time.time()
    placer.first_token(req)
    (record,) = trace.read_records(str(tmp_path), "decision")
    assert record["request"] == "r" and record["chosen"] == decision.path == record["path"]
    assert record["ttft_ms"] == 25.0 and record["prompt_len"] == 10 and before <= record["t"] <= time.time()
    # the instances it took: its prompt's, and its decode's (none yet answered for a pushed one)
    assert record["prefill"] == (req.colocated or req.prefill).name
    assert record["decode"] == (req.colocated.name if req.colocated else None)
    assert [(p["path"], p["ttft_ms"], p["admissible"]) for p in record["predictions"]] == [
        (p.path, round(p.ttft_s * 1e3, 3), p.admissible) for p in decision.predictions]
    # At its end, 9 tokens 0.4 s after the first: its TPOT, 50 ms, beside the one predicted.
    now[0] += 0.4
    req.num_output = 9
    placer.finished(req)
    placer.finished(req)  # once
    quiet.num_output = 9
    placer.finished(quiet)  # decided while tracing was off: no record
    (tpot,) = trace.read_records(str(tmp_path), "tpot")
    assert tpot["request"] == "r" and tpot["path"] == decision.path and tpot["num_output"] == 9
    assert tpot["tpot_ms"] == pytest.approx(50.0) and tpot["predicted_tpot_ms"] == round(decision.chosen.tpot_s * 1e3, 3)


def test_reservations_and_first_tokens_measure_the_hops_that_price_the_next_decisions():
    """The time from a remote decision to its decode instance's answer, beyond the step in flight
    it predicted, prices the next remote path through that instance; a first token's way to the
    router prices every path whose prompt that instance computes."""
    now = [100.0]
    config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override({"router.placement": "adaptive"})
    instances = [Instance(f"{role}-{i}", role, actor=None) for role in ("prefill", "decode") for i in range(2)]
    placer = Placer(config, instances, Picker(config.router.policy), clock=lambda: now[0])
    by = {inst.name: inst for inst in instances}
    prefills, decodes = [by["prefill-0"], by["prefill-1"]], [by["decode-0"], by["decode-1"]]

    def ttft(path, name):  # the predicted TTFT of ``path`` through instance ``name``
        decision = placer.decide(request("probe", [5] * 40), prefills, decodes, [])
        return next(p.ttft_s for p in decision.predictions if p.path == path and name in (p.prefill, p.decode))

    before = {"remote": ttft("remote", "decode-1"), "kept": ttft("kept", "prefill-0")}
    chosen = Prediction("remote", "prefill-0", "decode-1", 0.02, 0.0, 0.0, reserve_step_s=0.003)
    req = request("r", [3] * 40)
    decision = Decision(chosen, (chosen,))
    assert isinstance(placer.route(req, [], lambda *a: decision), Remote)
    placer._predicted["r"] = (decision, now[0])  # as `Placer.decide` keeps its own decisions
    now[0] += 0.013  # answered 13 ms after the decision: 10 beyond the 3-ms step it predicted
    req.decode = by["decode-1"]
    placer.reserved(req)
    req.prefill = placer.hand(req, req.decode, [])
    placer.first_token(req, relay_s=0.006)
    assert ttft("remote", "decode-1") == pytest.approx(before["remote"] + 0.010 + 0.006)
    assert ttft("kept", "prefill-0") == pytest.approx(before["kept"] + 0.006)
    assert ttft("local", "decode-0") == ttft("local", "decode-1")  # not their hops
