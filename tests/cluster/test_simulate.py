"""`disagg simulate`: the real scheduler on a virtual clock.

Determinism under a seed, conservation (every request ends exactly once, pages never negative
and all free at the end, the router's loads), the simulated runner's step shapes as the real tiny
engine's given the same arrivals, and a result that `disagg bench --from-results` reads.
"""

from __future__ import annotations

import collections
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cluster.bench.metrics import meets_slos
from disagg.cluster.cli.app import app
from disagg.cluster.routing.ledger import Ledger
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.instance import SimInstance
from disagg.cluster.simulate.run import simulate_run, simulated_result, workload_spec
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.config import Config
from disagg.engine.options import EngineOptions

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROFILE = {  # a profile of the tiny model's shape (what `disagg profile --small-grid` writes, abridged)
    "kind": "disagg-profile", "version": 1, "date": "20261127-000000", "model": "dummy:tiny", "commit": None,
    "device": {"host": "test", "gpus": [], "torch_device": "cpu"},
    "engine": {"num_pages": 256, "page_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "max_model_len": 4096, "kv_bytes_per_token": 512, "vocab_size": 256, "eos_token_ids": [2]},
    "fit": {"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8], "error": 0.1}, "samples": [],
}
FLEETS = {  # name: (config, overrides)
    "colocated": ("tiny-colocated.yaml", {}),
    "1p1d": ("tiny-1p1d.yaml", {}),
    "adaptive": ("tiny-2p2d.yaml", {"router.placement": "adaptive"}),
    "local": ("tiny-1p1d.yaml", {"router.placement": "local"}),
    "3p1d-tight": ("tiny-1p1d.yaml", {"instances.prefill": 3, "cache.num_pages": 40}),
}


def sim_instance(*, max_model_len: int, clock=lambda: 0.0, **options) -> SimInstance:
    """A simulated instance alone (no fleet), on ``clock``, with the `EngineOptions` ``options``."""
    return SimInstance(StepTimeModel(), EngineOptions(use_cuda_graphs=False, **options), max_model_len=max_model_len,
                       vocab_size=32000, clock=clock, pe=0, bytes_per_token=512.0, link_bytes_per_s=1e9)


def simulate(name: str, *, rate: float = 40.0, num_prompts: int = 120, seed: int = 0, dataset: str = "chat",
             check_ledger: bool = False, **spec_args):
    path, overrides = FLEETS[name]
    config = Config.from_yaml(CONFIGS / path)
    config = config.override(overrides) if overrides else config
    fleet = SimFleet(config, copy.deepcopy(PROFILE))
    spec = workload_spec(PROFILE, 512, dataset_name=dataset, num_prompts=num_prompts, seed=seed, **spec_args)
    if check_ledger:  # the tracked loads and work, checked at every request's end
        run = fleet.run
        fleet.run = lambda on_end: run(lambda rid, now: (fleet.check_ledger(), on_end(rid, now)))
    return config, simulate_run(config, PROFILE, spec, request_rate=rate, seed=seed, fleet=fleet)


@pytest.mark.parametrize("name", list(FLEETS))
def test_every_request_ends_once_and_every_page_comes_back(name: str):
    _, sim = simulate(name, check_ledger=True)
    fleet = sim.fleet
    assert all(t.ended for t in fleet.timelines.values()) and len(fleet.timelines) == 120
    assert all(out.success and out.output_len == out.expected_output_len for out in sim.run.outputs)
    for inst in fleet.instances:
        engine = inst.actor
        assert engine.min_free_pages >= 0
        assert not engine.core.requests and not engine.has_work() and engine.current is None
        assert engine.cache.num_free_pages == engine.cache.num_pages  # every page back
    assert not fleet.placed and not len(fleet.ledger) and not any(fleet.ledger.loads.values())
    if name == "3p1d-tight":
        assert len(fleet.of_role("prefill")) == 3 and fleet.placements["remote"] == 120


def checked_at_every_decision(fleet: SimFleet) -> list[int]:
    """Check ``fleet``'s tracked work and loads (`SimFleet.check_ledger`) before each
    adaptive decision, and that the loads it reads are the engines' now (`SimInstance.load`
    keeps one until its engine changes); the number of decisions checked, in a list that grows."""
    checked, decide = [0], fleet.placer.decide

    def checking(*args, **kwargs):
        fleet.check_ledger()
        for inst in fleet.instances:
            assert fleet.placer.fleet_model.loads[inst.name] == inst.actor.core.load(), f"{inst.name}'s load is stale"
        checked[0] += 1
        return decide(*args, **kwargs)

    fleet.placer.decide = checking
    return checked


@pytest.mark.parametrize("overrides", [{}, {"cache.prefix_caching": True, "scheduler.max_num_seqs": 4}],
                         ids=["adaptive", "adaptive-prefix-tight-seats"])
def test_tracked_work_is_the_live_requests_sum_at_every_decision(overrides: dict):
    """The views an adaptive decision prices (`FleetModel.views` through the `Ledger`) are those
    summed over the live requests, every field, at every decision, on every path taken; they are
    what the run decides on (the placements are those of a fleet summing them)."""
    config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override({"router.placement": "adaptive", **overrides})
    runs = []
    for tracked in (True, False):
        fleet = SimFleet(config, copy.deepcopy(PROFILE))
        checked = checked_at_every_decision(fleet)
        if not tracked:
            fleet.placer.fleet_model.ledger = fleet.picker.ledger = None  # summed at each decision
        spec = workload_spec(PROFILE, 512, dataset_name="multi-turn" if overrides else "chat", num_prompts=150,
                             seed=1, **({"input_len": 48, "output_len": 24} if overrides else {}))
        sim = simulate_run(config, PROFILE, spec, request_rate=60.0, seed=1, fleet=fleet)
        runs.append(([t.token_times for t in fleet.timelines.values()], dict(fleet.placements)))
        assert checked[0] >= 150
    assert runs[0] == runs[1]
    placements = runs[0][1]
    assert placements["remote"] and placements["local"] + placements["kept"]  # more than one path checked


def test_check_ledger_catches_a_ledger_that_misses_a_move(monkeypatch):
    """A ledger that misses the tokens of the requests decoding (their context and remaining
    tokens unchanged) fails `check_ledger`."""
    monkeypatch.setattr(Ledger, "advance", lambda self, req, num_tokens: None)
    config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override({"router.placement": "adaptive"})
    fleet = SimFleet(config, copy.deepcopy(PROFILE))
    checked_at_every_decision(fleet)
    spec = workload_spec(PROFILE, 512, dataset_name="chat", num_prompts=150, seed=1)
    with pytest.raises(AssertionError, match="summed over the live requests"):
        simulate_run(config, PROFILE, spec, request_rate=60.0, seed=1, fleet=fleet)


def test_tight_pages_preempt_and_still_conserve():
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml").override({"cache.num_pages": 30})
    fleet = SimFleet(config, PROFILE)
    spec = workload_spec(PROFILE, 512, dataset_name="random", num_prompts=60, seed=1, input_len=200, output_len=64)
    sim = simulate_run(config, PROFILE, spec, request_rate=200.0, fleet=fleet)
    assert sum(i.actor.core.scheduler.num_preemptions for i in fleet.instances) > 0
    assert all(out.success for out in sim.run.outputs)
    assert all(i.actor.cache.num_free_pages == 30 and i.actor.min_free_pages >= 0 for i in fleet.instances)


def test_same_seed_same_run_and_another_seed_another():
    results = [simulated_result(sim, config, PROFILE, label="x", config_path=None)
               for config, sim in (simulate("adaptive", seed=s, num_prompts=50) for s in (3, 3, 4))]
    keys = ("ttfts", "itls", "latencies", "start_times", "input_lens", "output_lens")
    assert all(results[0][k] == results[1][k] for k in keys)
    assert results[0]["ttfts"] != results[2]["ttfts"]
    assert results[0]["placements"] == results[1]["placements"]


def test_a_run_leaves_no_garbage_of_the_runs_before_it():
    """A planner worker makes runs one after another: each starts by collecting what the last
    left in cycles (its fleet refers to itself), so its own freeze of the objects alive does not
    keep the last run's unscanned (~1 GB a run for a 64-GPU plan's worker)."""
    import weakref

    _, first = simulate("1p1d", num_prompts=20)
    gone = weakref.ref(first.fleet)
    del first
    assert gone() is not None  # held by its own cycles until a collection reaches them
    simulate("1p1d", num_prompts=20)
    assert gone() is None


def test_events_run_in_time_order():
    _, sim = simulate("1p1d")
    for out in sim.run.outputs:  # each request's tokens after its send, in order
        assert out.ttft > 0 and all(gap >= 0 for gap in out.itl)
    times = sorted(t for tl in sim.fleet.timelines.values() for t in tl.token_times)
    assert sim.fleet.now == pytest.approx(times[-1])


def test_refused_request_fails_with_the_reason():
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml").override({"cache.num_pages": 4})
    fleet = SimFleet(config, PROFILE)
    fleet.submit_at(0.0, "big", 100, 10)
    fleet.submit_at(0.0, "small", 10, 5)
    fleet.run()
    assert "RequestRefused" in fleet.timelines["big"].error and fleet.timelines["big"].ended
    assert len(fleet.timelines["small"].token_times) == 5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_simulated_engine_schedules_the_real_engines_steps(async_scheduling: bool, monkeypatch):
    """Given the same arrivals per step, the real colocated engine and the simulated one (its
    `EngineCore` with the simulated runner) run the same forwards: the shapes the simulated runner
    reads off each plan (prompt tokens, decodes, context, prompt attention pairs) are the engine's,
    preemption and steps launched ahead included."""
    from disagg.cluster.launch import engines
    from disagg.engine import ColocatedEngine, EngineOptions
    from disagg.sampling import SamplingParams

    # The kernels' torch references: the steps' shapes are the scheduler's (the Triton interpreter
    # took ~7 s a run; the kernels are tested under it on their own).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    sizes = dict(num_pages=8, page_size=16, max_num_seqs=3, max_num_batched_tokens=32)
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml").override({"model.num_layers": 1})
    # Without the prefix cache (these prompts share ids; tests/cluster/test_simulate_prefix.py
    # runs both with it).
    real = ColocatedEngine(engines.load(config, "cpu"), **sizes, options=EngineOptions(
        async_scheduling=async_scheduling, prefix_caching=False))
    sim = sim_instance(max_model_len=real.max_model_len, async_scheduling=async_scheduling, prefix_caching=False,
                       **sizes)
    sim.step_log = []
    arrivals = {0: [(20, 8)], 1: [(35, 6)], 3: [(40, 10), (18, 7)], 9: [(30, 5)], 16: [(10, 9)], 21: [(12, 4)]}
    real_shapes = []
    for k in range(40):
        for i, (prompt_len, max_tokens) in enumerate(arrivals.get(k, [])):
            real.add(f"r{k}-{i}", [5] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            sim.add(f"r{k}-{i}", [5] * prompt_len, max_tokens)
        real.step()
        if real.last_step_shape is not None:
            real_shapes.append(real.last_step_shape)
        if sim.begin_step() is not None:
            sim.finish_step()
        if k > 21 and not real.has_work():
            break
    assert real.scheduler.num_preemptions > 0  # the case where page budgets matter
    assert (real.num_steps_ahead > 0) == async_scheduling
    assert sim.step_log == real_shapes
    assert sim.core.scheduler.num_preemptions == real.scheduler.num_preemptions and not sim.has_work()


def test_cli_writes_a_result_that_bench_from_results_reads(tmp_path: Path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    runner = CliRunner()
    for config, out in (("tiny-1p1d.yaml", "a"), ("tiny-colocated.yaml", "b")):
        result = runner.invoke(app, ["simulate", str(CONFIGS / config), "--profile", str(profile),
                                     "--dataset-name", "chat", "--num-prompts", "20", "--request-rate", "5,50",
                                     "--goodput", "ttft:500", "tpot:50", "--result-dir", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
    stored = json.loads(next((tmp_path / "a").glob("*5.0qps*.json")).read_text())
    assert stored["simulated"] is True and stored["label"] == "tiny-1p1d-sim" and len(stored["ttfts"]) == 20
    assert stored["placements"] == {"remote": 20, "local": 0, "kept": 0}
    result = runner.invoke(app, ["bench", "--from-results", str(tmp_path / "a"), "--from-results", str(tmp_path / "b"),
                                 "--result-dir", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    compared = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [side["label"] for side in compared["sides"]] == ["tiny-1p1d-sim", "tiny-colocated-sim"]


def test_cli_refuses_a_file_that_is_not_a_profile(tmp_path: Path):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    result = CliRunner().invoke(app, ["simulate", str(CONFIGS / "tiny-1p1d.yaml"), "--profile", str(bad)])
    assert result.exit_code == 2 and "expected a profile written by `disagg profile`" in result.output


@pytest.mark.parametrize("name", ["colocated", "1p1d", "adaptive", "3p1d-tight"])
def test_fused_decode_forwards_change_nothing(name: str):
    """Fusing the pure-decode forwards no event can change gives the step-by-step run exactly."""
    runs = []
    for fuse in (False, True):
        path, overrides = FLEETS[name]
        config = Config.from_yaml(CONFIGS / path)
        config = config.override(overrides) if overrides else config
        fleet = SimFleet(config, PROFILE)
        fleet.fuse = fuse
        spec = workload_spec(PROFILE, 512, dataset_name="decode-heavy", num_prompts=40, seed=2, output_len=64)
        runs.append(simulate_run(config, PROFILE, spec, request_rate=5.0, seed=2, fleet=fleet))
    step_by_step, fused = runs
    assert [t.token_times for t in fused.fleet.timelines.values()] == \
        [t.token_times for t in step_by_step.fleet.timelines.values()]
    assert [i.actor.num_steps for i in fused.fleet.instances] == [i.actor.num_steps for i in step_by_step.fleet.instances]
    assert fused.fleet.num_events < step_by_step.fleet.num_events  # it did fuse


def test_hop_delays_every_first_token_by_the_hop():
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml")
    firsts = []
    for hop_ms in (0.0, 25.0):
        fleet = SimFleet(config, PROFILE, hop_ms=hop_ms)
        fleet.submit_at(1.0, "a", 30, 4)
        fleet.run()
        firsts.append(fleet.timelines["a"].token_times[0] - fleet.timelines["a"].sent)
    assert firsts[1] - firsts[0] == pytest.approx(0.025)
    with pytest.raises(ValueError, match="--hop-ms"):
        SimFleet(config, PROFILE, hop_ms=-1.0)


def test_reserve_delays_a_pushed_first_token_by_the_round_trip_and_a_colocated_one_not_at_all():
    firsts = {}
    for name in ("tiny-1p1d.yaml", "tiny-colocated.yaml"):
        for reserve_ms in (0.0, 8.0):
            fleet = SimFleet(Config.from_yaml(CONFIGS / name), copy.deepcopy(PROFILE), reserve_ms=reserve_ms)
            fleet.submit_at(1.0, "a", 30, 4)
            fleet.run()
            firsts[name, reserve_ms] = fleet.timelines["a"].token_times[0] - fleet.timelines["a"].sent
    assert firsts["tiny-1p1d.yaml", 8.0] - firsts["tiny-1p1d.yaml", 0.0] == pytest.approx(0.008)
    assert firsts["tiny-colocated.yaml", 8.0] == firsts["tiny-colocated.yaml", 0.0]
    with pytest.raises(ValueError, match="--reserve-ms"):
        SimFleet(Config.from_yaml(CONFIGS / "tiny-1p1d.yaml"), PROFILE, reserve_ms=-1.0)


def test_max_concurrency_holds_requests_at_the_client():
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml")
    spec = workload_spec(PROFILE, 512, dataset_name="random", num_prompts=30, seed=0, input_len=32, output_len=8)
    sim = simulate_run(config, PROFILE, spec, request_rate=float("inf"), max_concurrency=2)
    spans = [(t.sent, t.token_times[-1]) for t in sim.fleet.timelines.values()]
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    open_now = peak = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    assert peak == 2 and all(out.success for out in sim.run.outputs)


@pytest.mark.parametrize("max_concurrency", [None, 4])
def test_stop_when_ends_the_run_and_fails_every_request_not_ended(max_concurrency):
    """`simulate_run(stop_when=)`: the run stops at the request that said so; the requests ended
    before it keep the records a whole run gives them, every other one (started, queued, or not
    yet sent) is a failed request."""
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml")
    spec = workload_spec(PROFILE, 512, dataset_name="chat", num_prompts=60, seed=0)
    whole = simulate_run(config, PROFILE, spec, request_rate=40.0, max_concurrency=max_concurrency)
    heard = []
    cut = simulate_run(config, PROFILE, spec, request_rate=40.0, max_concurrency=max_concurrency,
                       stop_when=lambda out: heard.append(out) or len(heard) == 10)
    assert len(heard) == 10 and len(cut.run.outputs) == 60
    ended = [i for i, out in enumerate(cut.run.outputs) if out.success]
    assert len(ended) == 10 and [cut.run.outputs[i] for i in ended] == [whole.run.outputs[i] for i in ended]
    assert sorted(out.latency + out.start_time for out in heard) == sorted(
        cut.run.outputs[i].latency + cut.run.outputs[i].start_time for i in ended)
    failed = [out for out in cut.run.outputs if not out.success]
    assert any(t.token_times for rid, t in cut.fleet.timelines.items() if not t.ended), "no request stopped mid-stream"
    assert all(out.error.startswith("the simulated run stopped before") for out in failed)


LATE_SLOS = {"ttft": {"ttft": 50.0}, "tpot": {"tpot": 2.0}, "all": {"ttft": 80.0, "tpot": 2.0, "e2el": 300.0}}


@pytest.mark.parametrize("name,slos", [(name, slos) for name in ("colocated", "1p1d", "adaptive", "3p1d-tight")
                                       for slos in LATE_SLOS if (name, slos) != ("3p1d-tight", "tpot")])
def test_a_request_called_late_misses_its_slos_and_the_run_is_unchanged(name: str, slos: str):
    """`SimFleet.watch_slos`: every request it calls late before it ends misses its SLOs in the
    whole run, each is called once, most of those that miss are called late, and the run is the
    unwatched one exactly. Overloaded (queues at the router and in the engines, long decodes)
    so that many miss (3p1d-tight's one decode instance has the pages for few decodes: none
    misses a TPOT alone)."""
    slos_ms = LATE_SLOS[slos]
    path, overrides = FLEETS[name]
    config = Config.from_yaml(CONFIGS / path)
    config = config.override(overrides) if overrides else config
    spec = workload_spec(PROFILE, 512, dataset_name="chat", num_prompts=80, seed=3)
    runs, late = [], []
    for watch in (False, True):
        fleet = SimFleet(config, copy.deepcopy(PROFILE))
        if watch:
            fleet.watch_slos({slo: ms / 1e3 for slo, ms in slos_ms.items()}, lambda rid: late.append(
                (rid, rid in fleet.timelines and fleet.timelines[rid].ended)))
        runs.append(simulate_run(config, PROFILE, spec, request_rate=400.0, seed=3, fleet=fleet))
    whole, watched = runs
    assert [t.token_times for t in watched.fleet.timelines.values()] == \
        [t.token_times for t in whole.fleet.timelines.values()]
    assert len({rid for rid, _ in late}) == len(late) and not any(ended for _, ended in late)  # before its end
    outputs = {f"chat-{i}": out for i, out in enumerate(whole.run.outputs)}
    assert all(not meets_slos(outputs[rid], slos_ms) for rid, _ in late)
    missed = [rid for rid, out in outputs.items() if not meets_slos(out, slos_ms)]
    assert len(late) >= 0.5 * len(missed) > 5, (len(late), len(missed))
    with pytest.raises(ValueError, match="watch_slos: expected ttft, tpot or e2el"):
        SimFleet(config, copy.deepcopy(PROFILE)).watch_slos({"itl": 0.1}, print)


def test_simulate_run_hears_a_certain_miss_before_the_request_ends():
    """`simulate_run(slos_s=)`: ``stop_when`` hears each request that surely misses a TTFT SLO
    as a failed record while it is still running, once (not again at its end), every request
    sent (none before the watch starts), and the run's records are those of an unwatched run."""
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml")
    spec = workload_spec(PROFILE, 512, dataset_name="chat", num_prompts=80, seed=3)
    whole = simulate_run(config, PROFILE, spec, request_rate=400.0, seed=3)
    heard = []
    watched = simulate_run(config, PROFILE, spec, request_rate=400.0, seed=3,
                           stop_when=lambda out: heard.append(out) and False, slos_s={"ttft": 0.05})
    late = [out for out in heard if "surely misses" in out.error]
    missed = [out for out in whole.run.outputs if not meets_slos(out, {"ttft": 50.0})]
    assert len(late) >= 0.5 * len(missed) > 5, (len(late), len(missed))
    assert len(heard) == 80 and watched.run.outputs == whole.run.outputs


@pytest.mark.parametrize("overlap", [False, True])
def test_a_reservation_made_mid_forward_answers_when_the_forward_ends(overlap):
    """1P1D: "b" arrives while the decode instance runs a forward (decoding "a"); its prompt
    reaches the prefill instance only when that forward ends (the actor runs calls between
    steps), so its first token comes that much later than on an idle decode instance; unless
    the decode instance answers reservations mid-forward (`scheduler.overlap_reservations`)."""
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml").override({"scheduler.overlap_reservations": overlap})

    def first_token_of_b(with_a: bool) -> tuple[float, SimFleet]:
        fleet = SimFleet(config, copy.deepcopy(PROFILE))
        fleet.fuse = False  # one event per forward: "b" lands inside one of them
        if with_a:
            fleet.submit_at(0.0, "a", 30, 400)
        fleet.submit_at(0.05, "b", 30, 4)
        fleet.run()
        return fleet.timelines["b"].token_times[0], fleet

    alone, _ = first_token_of_b(False)
    behind, fleet = first_token_of_b(True)
    d_step = fleet.models["decode"].step_s(0, 1, 30 + 30, 0)  # a decode forward of "a" near t = 0.05
    if overlap:  # only the prefill instance's own work for "b" is in its way
        assert behind - alone == pytest.approx(0.0, abs=1e-9)
    else:
        assert 0.0 < behind - alone <= d_step * 1.05


def test_run_seconds_take_the_first_requests_as_the_bench_does(tmp_path: Path):
    """`--run-seconds` / `--min-prompts`: a run at rate r sends the first max(min, r x s) of the
    --num-prompts sampled, as `disagg bench` does, so a simulated run is the measured one's."""
    from disagg.cluster.bench.sweep import SweepOptions
    from disagg.cluster.bench.workloads import sample_lengths

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    result = CliRunner().invoke(app, ["simulate", str(CONFIGS / "tiny-1p1d.yaml"), "--profile", str(profile),
                                      "--dataset-name", "chat", "--num-prompts", "40", "--request-rate", "5,50",
                                      "--run-seconds", "2", "--min-prompts", "3", "--goodput", "ttft:500", "tpot:50",
                                      "--result-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    options = SweepOptions(run_seconds=2, min_prompts=3)
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml")
    spec = workload_spec(PROFILE, SimFleet(config, PROFILE).max_model_len, dataset_name="chat", num_prompts=40, seed=0)
    inputs, _ = sample_lengths(spec)
    for rate, expected in ((5.0, 10), (50.0, 40)):
        stored = json.loads(next((tmp_path / "out").glob(f"*{rate}qps*.json")).read_text())
        assert len(stored["ttfts"]) == expected == options.prompts_at(rate, 40)
        assert stored["total_input_tokens"] == int(inputs[:expected].sum())


def test_trace_dir_writes_every_simulated_forward_as_a_step_record(tmp_path: Path):
    """`--trace-dir`: the simulated forwards as the step records a served fleet's trace holds
    (one per forward, fused decode forwards included), back to back on each instance's clock."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    result = CliRunner().invoke(app, ["simulate", str(CONFIGS / "tiny-1p1d.yaml"), "--profile", str(profile),
                                      "--dataset-name", "chat", "--num-prompts", "12", "--request-rate", "8",
                                      "--goodput", "ttft:500", "tpot:50", "--result-dir", str(tmp_path / "out"),
                                      "--trace-dir", str(tmp_path / "trace")])
    assert result.exit_code == 0, result.output
    from disagg import trace

    records = trace.read_records(str(tmp_path / "trace"), "step")
    stored = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    by_instance = {}
    for r in records:
        by_instance.setdefault(r["instance"], []).append(r)
    assert set(by_instance) == {"prefill-0", "decode-0"}
    tokens = sum(r["num_decode_seqs"] for r in by_instance["decode-0"])  # one token per decoding sequence a forward
    assert tokens == stored["total_output_tokens"] - stored["completed"]  # the first tokens come from prefill-0
    for steps in by_instance.values():
        assert all(a["t_end"] <= b["t_start"] + 1e-12 for a, b in zip(steps, steps[1:]))
        busy = sum(r["t_end"] - r["t_start"] for r in steps)
        name = steps[0]["instance"]
        assert busy == pytest.approx(stored["busy_fraction"][name] * stored["duration"], rel=1e-6)
    assert sum(r["num_prefill_tokens"] for r in by_instance["prefill-0"]) == stored["total_input_tokens"]
    assert not trace.read_records(str(tmp_path / "trace"), "decision")  # a fixed 1P1D decides nothing


def test_trace_dir_holds_every_adaptive_decision_on_the_virtual_clock(tmp_path: Path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    result = CliRunner().invoke(app, ["simulate", str(CONFIGS / "tiny-1p1d.yaml"), "--profile", str(profile),
                                      "--set", "router.placement=adaptive", "--dataset-name", "chat",
                                      "--num-prompts", "12", "--request-rate", "8", "--goodput", "ttft:500",
                                      "tpot:50", "--result-dir", str(tmp_path / "out"), "--trace-dir",
                                      str(tmp_path / "trace")])
    assert result.exit_code == 0, result.output
    from disagg import trace

    decisions = trace.read_records(str(tmp_path / "trace"), "decision")
    stored = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert sorted(d["request"] for d in decisions) == sorted(f"chat-{i}" for i in range(12))  # one each
    taken = collections.Counter(d["path"] for d in decisions)
    assert taken == stored["placements"] and all(d["path"] == d["chosen"] for d in decisions)
    ttfts = {d["request"]: d for d in decisions}
    for i, ttft in enumerate(stored["ttfts"]):  # since the decision: at most the client's TTFT
        assert 0 < ttfts[f"chat-{i}"]["ttft_ms"] <= ttft * 1e3 + 1e-6
        assert 0 <= ttfts[f"chat-{i}"]["t"] <= stored["duration"]  # the virtual clock
    # At each request's end its TPOT as predicted for the path taken, and as had (the client's).
    tpots = {t["request"]: t for t in trace.read_records(str(tmp_path / "trace"), "tpot")}
    ended = {f"chat-{i}": (n, (e2e - ttft) / max(n - 1, 1))
             for i, (n, ttft, e2e) in enumerate(zip(stored["output_lens"], stored["ttfts"], stored["latencies"]))}
    assert set(tpots) == {name for name, (n, _) in ended.items() if n >= 2}
    for name, record in tpots.items():
        assert record["path"] == ttfts[name]["path"] and record["num_output"] == ended[name][0]
        assert record["tpot_ms"] == pytest.approx(ended[name][1] * 1e3, abs=1e-3)
        chosen = next(p for p in ttfts[name]["predictions"] if p["path"] == record["path"])
        assert record["predicted_tpot_ms"] == chosen["tpot_ms"] > 0


@pytest.mark.parametrize("fuse", [False, True])
def test_step_gap_lengthens_every_inter_token_gap_by_the_gap(fuse: bool):
    """`--step-gap-ms`: one request decoding alone: each inter-token gap grows by the gap (fused
    forwards too); busy time and step records stay the forwards' own."""
    config = Config.from_yaml(CONFIGS / "tiny-colocated.yaml")
    itls, busy, records = [], [], []
    for gap_ms in (0.0, 2.0):
        fleet = SimFleet(config, PROFILE, step_gap_ms=gap_ms)
        fleet.fuse = fuse
        fleet.keep_records()
        fleet.submit_at(1.0, "a", 30, 12)
        fleet.run()
        times = fleet.timelines["a"].token_times
        itls.append([b - a for a, b in zip(times, times[1:])])
        busy.append(sum(i.actor.busy_s for i in fleet.instances))
        records.append(sorted(r["t_end"] - r["t_start"] for r in fleet.step_records if r["kind"] == "step"))
    assert len(itls[1]) == 11 and [b - a for a, b in zip(*itls)] == pytest.approx([0.002] * 11)
    assert busy[1] == pytest.approx(busy[0]) and records[1] == pytest.approx(records[0])
    with pytest.raises(ValueError, match="--step-gap-ms"):
        SimFleet(config, PROFILE, step_gap_ms=-1.0)


def test_cli_warns_when_the_profile_timed_another_model(tmp_path: Path):
    """The profile's model is what runs: a config of another model gets a warning naming both (a
    long-prompt workload on a llama3-8b profile had its prompts cut to that context, silently)."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    args = ["simulate", str(CONFIGS / "tiny-1p1d.yaml"), "--profile", str(profile), "--dataset-name", "chat",
            "--num-prompts", "8", "--request-rate", "5", "--result-dir", str(tmp_path / "out")]
    same = CliRunner().invoke(app, args)
    assert same.exit_code == 0 and "warning" not in same.output, same.output
    other = CliRunner().invoke(app, args + ["--set", "model.source=dummy:smollm2-135m"])
    assert other.exit_code == 0, other.output
    assert "the profile timed dummy:tiny (max_model_len" in other.output and "serves dummy:smollm2-135m" in other.output


def test_the_simulated_router_times_its_reservations_as_the_served_one_does():
    """The simulator answers a reservation ``reserve_ms`` after the decode instance's step in
    flight ends; its placer learns that hop (`Placer.reserved`) as the router's does."""
    config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override({"router.placement": "adaptive"})
    fleet = SimFleet(config, copy.deepcopy(PROFILE), reserve_ms=20.0)
    spec = workload_spec(PROFILE, 512, dataset_name="chat", num_prompts=60, seed=0)
    simulate_run(config, PROFILE, spec, request_rate=40.0, seed=0, fleet=fleet)
    assert fleet.placer.placements["remote"] > 0
    extra = {name: meter.median for name, meter in fleet.placer.fleet_model.reserve_extra.items() if meter.recent}
    assert extra and all(0.010 < s < 0.021 for s in extra.values())  # 20 ms, less the step it predicted


def test_the_simulated_router_counts_the_host_gap_in_its_decodes_token_gaps():
    """The simulated steps report their forwards' spans and the host gap before them apart, as a
    GPU-timed step loop does (`StepSample.gap_s`): the router's stall meters carry the gap."""
    factors = {}
    for gap_ms in (0.0, 3.0):
        config = Config.from_yaml(CONFIGS / "tiny-2p2d.yaml").override({"router.placement": "adaptive"})
        fleet = SimFleet(config, copy.deepcopy(PROFILE), step_gap_ms=gap_ms)
        spec = workload_spec(PROFILE, 512, dataset_name="chat", num_prompts=60, seed=0)
        simulate_run(config, PROFILE, spec, request_rate=40.0, seed=0, fleet=fleet)
        factors[gap_ms] = max(m.factor for m in fleet.placer.fleet_model.stalls.values())
    assert factors[3.0] > factors[0.0] + 0.1


def test_the_simulator_and_the_placement_import_no_ray():
    """`disagg simulate` and `disagg plan` run where no Ray is installed: importing the simulator
    (and with it the request flow, the placement and the ledger) and running a fleet through it
    to its result object import no ray (a fresh interpreter: this one has imported it)."""
    script = f"""
import copy, json, sys
import disagg.cluster.simulate
from disagg.cluster.routing import flow, ledger, placement, requests
from disagg.cluster.simulate import command, fleet, plan, run
from disagg.config import Config
profile = json.loads({json.dumps(json.dumps(PROFILE))})
config = Config.from_yaml({str(CONFIGS / "tiny-2p2d.yaml")!r}).override({{"router.placement": "adaptive"}})
spec = run.workload_spec(profile, 512, dataset_name="chat", num_prompts=20, seed=0)
sim = run.simulate_run(config, profile, spec, request_rate=40.0, fleet=fleet.SimFleet(config, copy.deepcopy(profile)))
run.simulated_result(sim, config, profile, label="x", config_path=None)
print(sorted(name for name in sys.modules if name == "ray" or name.startswith("ray.")))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
