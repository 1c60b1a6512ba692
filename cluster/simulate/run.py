"""A workload through a simulated fleet, as `disagg bench`'s result.

`simulate_run` draws the bench's workload (`workloads.sample_prompts`: the prompts `disagg
bench` sends for the same flags, token for token, which the fleet's prefix caches key; only
their lengths, `workloads.sample_lengths`, where ``cache.prefix_caching`` is off) and arrival
offsets (`arrivals.arrival_offsets`), sends them into a `SimFleet` at those virtual times (with
``max_concurrency``, a request waits for a free slot, in order, as the bench client's semaphore
makes it), runs the clock to the end and turns each request's token times into the client's
`RequestOutput`. `simulated_result` writes that as `report.build_result` does for a measured
run, with ``"simulated": true``, what the simulation assumed and the run's prefix-cache hits as
the bench reports them (``prefix_cache``, `sweep.prefix_cache_of`: each fleet starts cold, as
each bench run does after its reset), so `disagg bench --from-results` reads, compares and plots
it beside measured runs. Pure Python; no GPU, no Ray.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from disagg.cluster.bench.arrivals import arrival_offsets
from disagg.cluster.bench.metrics import DEFAULT_PERCENTILES, RequestOutput
from disagg.cluster.bench.report import build_result
from disagg.cluster.bench.runner import RunResult
from disagg.cluster.bench.sweep import prefix_cache_of
from disagg.cluster.bench.workloads import WorkloadSpec, sample_lengths, sample_prompts
from disagg.cluster.simulate.fleet import SimFleet, Timeline, fleet_profiles
from disagg.cluster.simulate.profile import profile_tensor_parallel
from disagg.config import SECRET_FIELDS, Config

GC_THRESHOLD = 50_000  # `collections_deferred`: allocations between collections of the youngest generation


@dataclass
class Simulation:
    """One simulated run: the client's records, the fleet after it, and its cost."""

    run: RunResult
    fleet: SimFleet
    spec: WorkloadSpec
    wall_s: float
    info: dict[str, Any] = field(default_factory=dict)


def workload_spec(profile: dict, fleet_max_model_len: int, *, dataset_name: str, num_prompts: int, seed: int,
                  input_len: int | None = None, output_len: int | None = None,
                  range_ratio: float | None = None) -> WorkloadSpec:
    """The bench's workload spec sized to the profiled model (vocabulary, context, EOS ids)."""
    engine = profile["engine"]
    return WorkloadSpec(dataset_name, num_prompts, seed, int(engine.get("vocab_size") or 32000),
                        fleet_max_model_len, input_len, output_len, range_ratio,
                        tuple(int(t) for t in engine.get("eos_token_ids") or ())).resolved()


def simulate_run(config: Config, profile: dict | Mapping[str, dict], spec: WorkloadSpec, *, request_rate: float,
                 burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                 link_gbps: float = 364.0, hop_ms: float = 0.0, fleet: SimFleet | None = None,
                 num_requests: int | None = None,
                 stop_when: Callable[[RequestOutput], bool] | None = None,
                 slos_s: Mapping[str, float] | None = None) -> Simulation:
    """Run ``spec`` at ``request_rate`` through the fleet of ``config`` (module docstring): its
    first ``num_requests`` requests (default all), as `disagg bench` runs the first ones of the
    prompts it sampled. ``stop_when(output)`` hears each request's client record as it ends; once
    it answers True the run stops (`SimFleet.halt`), and every request not ended by then is a
    failed one in the result (`disagg plan` stops a run whose SLO miss is already certain).
    ``slos_s`` (with ``stop_when``; ``ttft``, ``tpot``, ``e2el`` in seconds): a request that surely
    misses one (`SimFleet.watch_slos`) is heard as a failed record at once, and not again when
    it ends (a miss is known long before the request ends: its first token late, or its decode
    past the TPOT its tokens can still make).
    ``profile``: one for every role, or one per role (`SimFleet`'s).

    Raises:
        ValueError: a bad rate, burstiness, concurrency or link bandwidth, or a role without a
            profile of its TP (`fleet.fleet_profiles`).
    """
    fleet_profiles(config, profile)
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency: expected an integer >= 1, got {max_concurrency}")
    started = time.perf_counter()
    fleet = fleet or SimFleet(config, profile, link_gbps, hop_ms)
    if config.cache.prefix_caching:  # the ids the bench sends: the prefix caches key them
        prompts, output_lens = sample_prompts(spec)
    else:
        input_lens, output_lens = sample_lengths(spec)
        prompts = [int(n) for n in input_lens]
    if num_requests is not None:
        prompts, output_lens = prompts[:num_requests], output_lens[:num_requests]
    offsets = arrival_offsets(len(prompts), request_rate, burstiness, seed)
    ids = [f"{spec.dataset_name}-{i}" for i in range(len(prompts))]
    limit = len(ids) if max_concurrency is None else min(max_concurrency, len(ids))
    sent = iter(range(len(ids)))

    def send(i: int, not_before: float) -> None:
        fleet.submit_at(max(float(offsets[i]), not_before), ids[i], prompts[i], int(output_lens[i]))

    late: set[str] = set()

    def on_late(request_id: str) -> None:
        late.add(request_id)
        if stop_when(late_output(request_id)):
            fleet.halt()

    if stop_when is not None and slos_s:  # before the first send: it watches the requests sent after it
        fleet.watch_slos(slos_s, on_late)

    for i in itertools.islice(sent, limit):
        send(i, 0.0)

    def on_end(request_id: str, now: float) -> None:
        if (stop_when is not None and request_id not in late
                and stop_when(client_output(fleet.timelines[request_id]))):
            fleet.halt()
            return
        nxt = next(sent, None)
        if nxt is not None:
            send(nxt, now)

    with collections_deferred():
        fleet.run(on_end)
    outputs = [client_output(fleet.timelines[i]) if i in fleet.timelines else unsent_output(i) for i in ids]
    ends = [out.start_time + out.latency for out in outputs if out.success]
    duration = max(ends + [float(offsets[-1]), 1e-9])
    run = RunResult(outputs, duration, request_rate, burstiness, max_concurrency)
    return Simulation(run, fleet, spec, time.perf_counter() - started)


@contextlib.contextmanager
def collections_deferred(threshold: int = GC_THRESHOLD):
    """Python's cyclic garbage collector, while a run's events are processed: the objects alive
    before it (the fleet, its engines' pages and prefix caches) frozen out of its scans, and its
    youngest generation collected every ``threshold`` allocations instead of 700 (a run allocates
    millions of short-lived objects, few of them in cycles: the default spends ~5% of a run
    rescanning them). Restored after, whatever the run raised. The cycles earlier runs left (a
    fleet, its engines and requests refer to each other) are collected first: frozen, they
    would outlive the run unscanned, and the full collections that reach them afterwards are
    rare: a planner worker making runs one after another would keep every run's garbage (~1 GB
    for 10,000 requests of a 64-instance fleet)."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(threshold, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def late_output(request_id: str) -> RequestOutput:
    """What ``stop_when`` hears of a request that surely misses an SLO (a failed record)."""
    return RequestOutput(error=f"{request_id} surely misses an SLO")


def unsent_output(request_id: str) -> RequestOutput:
    """The record of a request that a stopped run (``stop_when``) never reached the router with."""
    return RequestOutput(error=f"the simulated run stopped before {request_id} was sent")


def client_output(timeline: Timeline) -> RequestOutput:
    """The bench client's record of one simulated request (its clock starts when it was sent)."""
    out = RequestOutput(prompt_len=timeline.prompt_len, expected_output_len=timeline.max_tokens,
                        start_time=timeline.sent)
    times = timeline.token_times
    if timeline.error or not times or not timeline.ended:
        out.error = timeline.error or ("the simulated request ended without a token" if timeline.ended
                                       else "the simulated run stopped before the request ended")
        return out
    out.success, out.output_len = True, len(times)
    out.ttft = times[0] - timeline.sent
    out.itl = [b - a for a, b in zip(times, times[1:])]
    out.latency = times[-1] - timeline.sent
    return out


def simulated_result(sim: Simulation, config: Config, profile: dict | Mapping[str, dict], *, label: str,
                     config_path: str | None,
                     overrides: Mapping[str, Any] | None = None, link_gbps: float = 364.0,
                     goodput_slos_ms: Mapping[str, float] | None = None,
                     percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`disagg bench`'s result object of a simulated run (vLLM's names, per-request lists), with
    ``"simulated": true``, the profile's device as the device, and the simulation's assumptions
    (``simulation``: the first role's profile, and under ``roles`` each role's TP and fit)."""
    fleet = sim.fleet
    by_role = fleet_profiles(config, profile)
    profile = next(iter(by_role.values()))
    duration = sim.run.duration_s
    busy = {inst.name: inst.actor.busy_s / duration for inst in fleet.instances} if duration > 0 else None
    on_cpu = str((profile.get("device") or {}).get("torch_device", "cuda")).startswith("cpu")
    info = {"simulated": True, "label": label, "num_gpus": config.instances.num_gpus,
            "device_unit": "instance" if on_cpu else "GPU",
            "config_path": config_path, "overrides": dict(overrides or {}), "model_id": config.model.source,
            "dtype": config.model.dtype, "tokenizer_id": config.model.source, "device": profile.get("device"),
            "busy_fraction": busy, "placements": dict(fleet.placements) if config.mode == "disaggregated" else None,
            "prefix_cache_reset": True, "prefix_cache": prefix_cache(fleet),
            "simulation": {"profile_date": profile.get("date"), "profile_commit": profile.get("commit"),
                           "profile_model": profile.get("model"), "fit": profile["fit"],
                           "tensor_parallel": profile_tensor_parallel(profile),
                           "roles": {role: {"tensor_parallel": profile_tensor_parallel(prof), "fit": prof["fit"],
                                            "profile_date": prof.get("date"), "profile_commit": prof.get("commit")}
                                     for role, prof in by_role.items()},
                           "link_gbps": link_gbps, "hop_ms": fleet.hop_s * 1e3,
                           "step_gap_ms": fleet.step_gap_s * 1e3,
                           "reserve_ms": fleet.reserve_s * 1e3, "num_pages": fleet.num_pages, "num_events": fleet.num_events,
                           "prefix_caching": config.cache.prefix_caching,
                           "affinity_hits": fleet.placer.affinity_hits,
                           "num_steps": {i.name: i.actor.num_steps for i in fleet.instances},
                           "min_free_pages": min(i.actor.min_free_pages for i in fleet.instances),
                           "wall_s": sim.wall_s}}
    info.update(extra or {})
    return build_result(sim.run, goodput_slos_ms=goodput_slos_ms, percentiles=percentiles, label=label,
                        workload=sim.spec.to_dict(), config=config.model_dump(mode="json", exclude=SECRET_FIELDS),
                        extra=info)


def prefix_cache(fleet: SimFleet) -> dict[str, Any] | None:
    """The run's prefix-cache hits, as `disagg bench` reports a measured run's (``prefix_cache``:
    `sweep.prefix_cache_of` over the engines' counters before, all 0 in a fresh fleet, and after)."""
    after = [{"name": name, **stats} for name, stats in fleet.prefix_stats().items()]
    before = [{"name": one["name"], "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "pushed_bytes": 0}
              for one in after]
    return prefix_cache_of({"instances": before}, {"instances": after})
