"""`disagg plan`: which deployment of N GPUs serves a workload with the most goodput per GPU.

The candidates (`candidates.py`: colocated at each chunk size, every xPyD split, each split
adaptive) run one instance per GPU (per TP ranks), each with the profiled instance's model,
pages and budgets. With one profile per TP degree (`disagg plan --profile P1 --profile P2`,
`profiles_by_tp`) the search spans each degree and each pair of degrees (x prefill instances of
TP a, y decode instances of TP b), every instance simulated with the step times of its role's TP
profile (`role_profiles`, `SimFleet`'s profiles per role); a fleet of two TPs is sized as a launch
sizes one heap (`base_of`, `fleet.fleet_pages`).

First the screen (`screen_search`, `screen.py`): each candidate's rate from its profiles'
step-time models, TRT-LLM's rate matching of prefill and decode capacity within the SLOs; only
those within ``--screen-margin`` of the best per GPU (and the best colocated one) are simulated,
each search starting at its screened rate.

Each simulated candidate's goodput is DistServe's: the highest request rate whose SLO attainment
(the fraction of requests within every `--goodput` SLO) is at least 90% (`bench.compare.
TARGET_ATTAINMENT`), found by simulating (`run.simulate_run`, the same workload and arrival seeds
for every candidate and rate; `RunLength`: about 30 s of arrivals) at doubling rates, then
bisecting between the last rate that held and the first that missed (`rate_search.py`). With
``seeds`` > 1 a rate's attainment pools the requests of that many runs (prompts and arrivals
drawn from seeds ``seed .. seed + seeds - 1``): one draw of 30 s decides a knee by a few
requests, and small policy changes then flip rows. The table ranks them by goodput per GPU; the
best one's YAML is what `disagg launch` / `disagg bench` run. Pure Python; no GPU.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from disagg.cluster.bench.compare import TARGET_ATTAINMENT
from disagg.cluster.bench.metrics import RequestOutput, meets_slos
from disagg.cluster.bench.workloads import sample_lengths
from disagg.cluster.routing.placement import DEFAULT_PLACEMENT, policy_of
from disagg.cluster.simulate import run_pool, screen
from disagg.cluster.simulate.candidates import (DEFAULT_CHUNK_SIZES, Candidate, candidates, config_of,  # noqa: F401
                                                only, prefill_counts, tp_splits)  # the search, as `planner.*`
from disagg.cluster.simulate.fleet import SimFleet, check_hops, fleet_pages, fleet_profiles
from disagg.cluster.simulate.link import link_bytes_per_token
from disagg.cluster.simulate.profile import profile_tensor_parallel
from disagg.cluster.simulate.rate_search import MAX_DOUBLINGS, max_rate, rate_search
from disagg.cluster.simulate.run import simulate_run, workload_spec
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.config import Config


def base_sections(profile: dict, slos_ms: Mapping[str, float]) -> dict[str, Any]:
    """The YAML of the profiled instance: model (its context as simulated, its layers and KV dtype
    where the profile names them), cache pages and page size, scheduler budgets (and CUDA graphs),
    the SLOs. Every value the simulation takes from the profile is written, so that the fleet
    `disagg launch` starts from it is the one simulated (without ``cache.num_pages`` a launch sizes
    its pages from GPU memory instead of the profile's, which `SimFleet` gives each instance)."""
    engine = profile["engine"]
    on_cpu = str((profile.get("device") or {}).get("torch_device", "cuda")).startswith("cpu")
    dtype = profile.get("dtype") if profile.get("dtype") in ("float32", "bfloat16", "float16") else "auto"
    model = {"source": profile["model"], "dtype": dtype, "max_model_len": engine["max_model_len"]}
    if engine.get("num_layers"):
        model["num_layers"] = engine["num_layers"]
    cache = {"page_size": engine["page_size"], "num_pages": engine["num_pages"]}  # SimFleet's, one GPU each
    if "float8" in str(profile.get("kv_dtype")):
        cache["kv_dtype"] = "fp8_e4m3"
    scheduler = {"max_num_seqs": engine["max_num_seqs"], "max_num_batched_tokens": engine["max_num_batched_tokens"]}
    if engine.get("cuda_graphs") and not on_cpu:
        scheduler["cuda_graphs"] = engine["cuda_graphs"]
    instances: dict[str, Any] = {"device": "cpu" if on_cpu else "cuda"}
    if profile_tensor_parallel(profile) > 1:
        instances["tensor_parallel"] = profile_tensor_parallel(profile)
    return {"model": model, "cache": cache, "instances": instances,
            "scheduler": scheduler, "bench": {"goodput": dict(slos_ms)}}


def profiles_by_tp(profiles: dict | Sequence[dict]) -> dict[int, dict]:
    """``profiles`` (one, or one per TP degree: `disagg plan --profile P1 --profile P2`) by the
    TP each timed (`profile_tensor_parallel`), in increasing TP.

    Raises:
        ValueError: none, two of one TP, or profiles of different models.
    """
    profiles = [profiles] if isinstance(profiles, dict) else list(profiles)
    by_tp: dict[int, dict] = {}
    for prof in profiles:
        tp = profile_tensor_parallel(prof)
        if tp in by_tp:
            raise ValueError(f"--profile: expected one profile per tensor_parallel degree, got two of TP {tp}")
        by_tp[tp] = prof
    models = {str(prof.get("model")) for prof in profiles}
    if not profiles or len(models) > 1:
        raise ValueError(f"--profile: expected profiles of one model (one per TP degree), got "
                         f"{', '.join(sorted(models)) if profiles else 'none'}")
    return dict(sorted(by_tp.items()))


def role_profiles(candidate: Candidate, profiles: Mapping[int, dict]) -> dict[str, dict]:
    """The profile of each role ``candidate`` runs: that of the role's TP (``profiles`` by TP).

    Raises:
        ValueError: a role at a TP no profile timed.
    """
    missing = [tp for tp in candidate.tensor_parallels if tp not in profiles]
    if missing:
        raise ValueError(f"--profile: no profile of the TP of {candidate.label} (profiles of TP "
                         f"{', '.join(map(str, profiles))}): profile an instance of TP {missing[0]}")
    return {role: profiles[candidate.tensor_parallel_of(role)] for role in candidate.roles}


def base_of(candidate: Candidate, profiles: Mapping[int, dict], slos_ms: Mapping[str, float]) -> dict[str, Any]:
    """`base_sections` of ``candidate``'s profile; of a split across two TPs, of its lower TP's,
    with the fleet's page count as a launch sizes it (`fleet.fleet_pages`: pages of the side with
    more KV heads per rank, which the other side's ranks view as more pages), so that is the
    count simulated and written, and the context the tightest of its profiles and those pages
    allow."""
    used = [profiles[tp] for tp in candidate.tensor_parallels]
    base = base_sections(used[0], slos_ms)
    if len(used) > 1:
        num_pages = fleet_pages(role_profiles(candidate, profiles))[0]
        base["cache"]["num_pages"] = num_pages  # a sequence of the wider side fits in as many
        base["model"]["max_model_len"] = min([int(prof["engine"]["max_model_len"]) for prof in used]
                                             + [num_pages * int(base["cache"]["page_size"])])
        base["instances"].pop("tensor_parallel", None)  # the candidate's, per role
    return base


# `extrapolations`: a chunk or batch this fraction beyond the range of the steps timed still counts as timed.
SAMPLED_MARGIN = 0.1


def sampled_ranges(profile: dict) -> dict[str, tuple[int, int]]:
    """The step shapes ``profile`` timed (its samples, served ones too): ``prompt_tokens``, the
    fewest and most prompt tokens of a step with any, and ``decode_seqs``, of decoding sequences;
    a kind with no sample is absent."""
    ranges = {}
    for name, index in (("prompt_tokens", 0), ("decode_seqs", 1)):
        values = [int(s[index]) for s in profile.get("samples") or () if s[index] > 0]
        if values:
            ranges[name] = (min(values), max(values))
    return ranges


def extrapolations(profile: dict, base: dict[str, Any], search: Sequence[Candidate]
                   ) -> dict[str, list[str]]:
    """Per candidate of ``search`` whose steps go outside what ``profile`` timed (`sampled_ranges`),
    what does, e.g. ``chunk 8192 prompt tokens (the profile timed 8-32)``: its chunk budget
    (scheduler.max_num_batched_tokens) outside the prompt tokens of the steps timed, or its batch
    (scheduler.max_num_seqs) above the decoding sequences timed, by more than `SAMPLED_MARGIN`
    (a profile at max_model_len 8192 times prompt steps of 8190 tokens, not 8192). Its step times
    there are the fit's extrapolation. A profile without samples gives none."""
    ranges = sampled_ranges(profile)
    out: dict[str, list[str]] = {}
    for cand in search:
        scheduler = config_of(base, cand)["scheduler"]
        notes = []
        low, high = ranges.get("prompt_tokens", (0, math.inf))
        chunk = scheduler["max_num_batched_tokens"]
        if not low / (1 + SAMPLED_MARGIN) <= chunk <= high * (1 + SAMPLED_MARGIN):
            notes.append(f"chunk {chunk} prompt tokens (the profile timed {low}-{high})")
        low, high = ranges.get("decode_seqs", (0, math.inf))
        if scheduler["max_num_seqs"] > high * (1 + SAMPLED_MARGIN):
            notes.append(f"batches up to {scheduler['max_num_seqs']} sequences (the profile timed {low}-{high})")
        if notes:
            out[cand.label] = notes
    return out


def extrapolations_by_tp(profiles: Mapping[int, dict], slos_ms: Mapping[str, float],
                         search: Sequence[Candidate]) -> dict[str, list[str]]:
    """`extrapolations` of each candidate of ``search`` against the profile of each of its TPs."""
    out: dict[str, list[str]] = {}
    for tp, prof in profiles.items():
        users = [c for c in search if tp in c.tensor_parallels]
        for label, notes in extrapolations(prof, base_sections(prof, slos_ms), users).items():
            out.setdefault(label, []).extend(note for note in notes if note not in out.get(label, ()))
    return out


def extrapolation_lines(notes: Mapping[str, list[str]], num_candidates: int) -> list[str]:
    """What `disagg plan` prints of `extrapolations`: a heading, then per note (chunks first, by
    size, then batches) the candidates it applies to (``every candidate`` when all of them)."""
    by_note: dict[str, list[str]] = {}
    for label, items in notes.items():
        for note in items:
            by_note.setdefault(note, []).append(label)
    if not by_note:
        return []

    def order(note: str) -> tuple[bool, int]:
        return not note.startswith("chunk"), int(re.search(r"\d+", note).group())

    lines = ["extrapolated: outside the steps the profile timed, so their step times are the fit's guess "
             "(keep --chunk-sizes within what it timed, or profile a config whose scheduler budgets "
             "(max_num_batched_tokens, max_num_seqs) cover them, without --small-grid):"]
    for note in sorted(by_note, key=order):
        labels = by_note[note]
        lines.append(f"  {note}: {'every candidate' if len(labels) == num_candidates > 1 else ', '.join(labels)}")
    return lines


def misses_allowed(num_requests: int, target: float = TARGET_ATTAINMENT) -> int:
    """The most SLO misses of ``num_requests`` that still leave an attainment of ``target``
    (`slo_attainment`: met / all >= target)."""
    return num_requests - math.ceil(target * num_requests - 1e-9)


# `RunLength.for_gpus`: the requests of one simulated run per GPU of the fleet, by default.
PROMPTS_PER_GPU = 375


@dataclass(frozen=True)
class RunLength:
    """How many requests a simulated run sends: ``rate x seconds`` of arrivals (a steady state,
    not one burst that a fleet drains within its SLOs), between ``min_prompts`` and ``max_prompts``."""

    seconds: float = 30.0
    min_prompts: int = 100
    max_prompts: int = 3000

    def prompts_at(self, rate: float) -> int:
        return int(min(self.max_prompts, max(self.min_prompts, math.ceil(rate * self.seconds))))

    def seconds_at(self, rate: float) -> float:
        """The virtual seconds of arrivals a run at ``rate`` sends: ``seconds``, less where
        ``max_prompts`` cuts it short. A short run is judged before the fleet fills (its decode
        seats, its queues) and reads too well (benchmarks/records/plan-h200-2026-11-28/)."""
        return self.prompts_at(rate) / rate if rate > 0 else self.seconds

    @classmethod
    def for_gpus(cls, num_gpus: int, seconds: float = 30.0, max_prompts: int | None = None) -> RunLength:
        """``seconds`` of arrivals, at most ``max_prompts`` requests (default `PROMPTS_PER_GPU` per
        GPU, at least 3000: a fleet's whole 30 s up to 12.5 req/s per GPU, whatever its size)."""
        cap = max_prompts if max_prompts is not None else max(3000, PROMPTS_PER_GPU * num_gpus)
        return cls(seconds, min(100, cap), cap)


def rate_attainment(config: Config, profile: dict | Mapping[str, dict], rate: float, *, dataset_name: str,
                    slos_ms: Mapping[str, float], run_length: RunLength = RunLength(), seed: int = 0,
                    seeds: int = 1, link_gbps: float = 364.0, hops: Mapping[str, float] | None = None,
                    stop_early: bool = True, **lengths: Any) -> tuple[float, bool]:
    """The SLO attainment of the deployment ``config`` at ``rate`` req/s over ``seeds`` draws,
    pooled (`judge`), and whether its runs stopped once their verdict was certain (``stop_early``:
    more misses than the target allows, or enough requests within the SLOs that the rest cannot
    undo it; the attainment is then a bound below the whole runs', on the same side of the
    target). ``profile``: one for every instance, or one per role (`SimFleet`'s)."""
    first = next(iter(fleet_profiles(config, profile).values()))
    outputs: list[RequestOutput] = []
    num_prompts = run_length.prompts_at(rate)
    allowed = misses_allowed(num_prompts * seeds)
    needed = num_prompts * seeds - allowed  # requests within the SLOs that make the target certain
    misses = met = 0
    slos_s = {slo: limit / 1e3 for slo, limit in slos_ms.items()}  # a certain miss, known before its end

    def certain(out: RequestOutput) -> bool:
        nonlocal misses, met
        if meets_slos(out, slos_ms):
            met += 1
        else:
            misses += 1
        return misses > allowed or met >= needed

    for draw in range(seed, seed + seeds):
        fleet = SimFleet(config, profile, link_gbps, **(hops or {}))
        spec = workload_spec(first, fleet.max_model_len, dataset_name=dataset_name,
                             num_prompts=num_prompts, seed=draw, **lengths)
        outputs += simulate_run(config, profile, spec, request_rate=rate, seed=draw, fleet=fleet,
                                stop_when=certain if stop_early else None, slos_s=slos_s).run.outputs
        if stop_early and (misses > allowed or met >= needed):
            break
    stopped = stop_early and (misses > allowed or met + misses < num_prompts * seeds)
    return sum(meets_slos(out, slos_ms) for out in outputs) / (num_prompts * seeds), stopped


def judge(candidate: Candidate, base: dict[str, Any], profile: dict | Mapping[str, dict], *, dataset_name: str,
          slos_ms: Mapping[str, float], run_length: RunLength = RunLength(), seed: int = 0, seeds: int = 1,
          link_gbps: float = 364.0, hops: Mapping[str, float] | None = None, start_rate: float | None = None,
          stop_early: bool = True, start_rate_per_gpu: float = 1.0, max_doublings: int = MAX_DOUBLINGS,
          ceiling: float = math.inf, probe: bool = False, **lengths: Any) -> Candidate:
    """Simulate ``candidate`` at the rates `max_rate` asks for (each over ``seeds`` draws, pooled:
    `rate_attainment`); set its goodput. ``profile``: one, or one per role (`role_profiles`).
    ``hops``: `SimFleet`'s ``hop_ms``, ``step_gap_ms``,
    ``reserve_ms``. The search starts at ``start_rate`` req/s (default ``start_rate_per_gpu`` per
    GPU of the candidate) and doubles or halves it at most ``max_doublings`` times, doubling no
    further once a rate at or past ``ceiling`` holds (`rate_search`; ``probe``: a start near the
    knee, its probed search).

    ``stop_early``: a rate's runs stop as soon as more requests have missed an SLO than
    `TARGET_ATTAINMENT` allows of them all (`misses_allowed`), or as soon as so many met them that
    the rest cannot undo it; the rate's verdict is the same, its ``attainment_at`` is then a bound
    below the whole run's, on the same side of the target (the requests not ended count as
    misses), and the rate is in ``cut_at``. An overloaded run is the slowest to simulate (its
    queue drains long after the arrivals end), and the search runs about half its rates past the
    knee: stopping early judges chat's colocated-2 in a third of the time, to the same goodput
    (ARCHITECTURE §11); a run that holds skips the drain of its last requests."""
    if seeds < 1:
        raise ValueError(f"--seeds: expected at least 1 draw per rate, got {seeds}")
    config = Config.from_dict(config_of(base, candidate), origin=candidate.label)
    settings = dict(dataset_name=dataset_name, slos_ms=slos_ms, run_length=run_length, seed=seed, seeds=seeds,
                    link_gbps=link_gbps, hops=hops, stop_early=stop_early, **lengths)

    def attainment(rate: float) -> float:
        return candidate.note(rate, *rate_attainment(config, profile, rate, **settings))

    candidate.goodput_rps = max_rate(attainment, start_rate or start_rate_per_gpu * candidate.num_gpus,
                                     max_doublings=max_doublings, ceiling=ceiling, probe=probe)
    return candidate


def workload_shape(profile: dict, *, dataset_name: str, seed: int = 0, num_prompts: int = 1000,
                   **lengths: Any) -> screen.WorkloadShape:
    """The mean lengths of ``num_prompts`` of the workload's requests (`workloads.sample_lengths`
    of the spec every run draws from, sized to ``profile``'s model)."""
    spec = workload_spec(profile, int(profile["engine"]["max_model_len"]), dataset_name=dataset_name,
                         num_prompts=num_prompts, seed=seed, **lengths)
    return screen.WorkloadShape.of(*sample_lengths(spec))


def screened(candidate: Candidate, profiles: Mapping[int, dict], slos_ms: Mapping[str, float],
             work: screen.WorkloadShape, link_gbps: float = 364.0) -> screen.Screened:
    """``candidate``'s screen (`screen.py`): each role's instance from its TP's profile, at the
    candidate's chunk budget, batch and pages; a prefill instance's pushes priced as the fleet
    prices them (`link.link_bytes_per_token`: the busiest link of its rank pairs)."""
    config = config_of(base_of(candidate, profiles, slos_ms), candidate)
    cache, scheduler, counts = config["cache"], config["scheduler"], config["instances"]
    roles = role_profiles(candidate, profiles)
    token_bytes = {role: float(prof["engine"]["kv_bytes_per_token"]) for role, prof in roles.items()}
    if "prefill" in roles:
        tp_of = candidate.tensor_parallel_of
        token_bytes["prefill"] = link_bytes_per_token(token_bytes["prefill"], tp_of("prefill"), token_bytes["decode"],
                                                      tp_of("decode"))
    pages = fleet_pages(roles, cache["num_pages"])[1]  # a narrower side's ranks view more pages
    shapes = {role: screen.InstanceShape(StepTimeModel.from_dict(prof["fit"]), scheduler["max_num_batched_tokens"],
                                         scheduler["max_num_seqs"], pages[role], cache["page_size"],
                                         token_bytes[role], link_gbps * 1e9)
              for role, prof in roles.items()}
    tps = "+".join(f"TP{candidate.tensor_parallel_of(role)}" for role in candidate.roles)
    if "colocated" in shapes:
        rate = counts["colocated"] * screen.colocated_rate(shapes["colocated"], work, slos_ms)
        return screen.Screened(candidate.label, rate, candidate.num_gpus, "colocated", f"colocated {tps}")
    adaptive = policy_of((config.get("router") or {}).get("placement", DEFAULT_PLACEMENT)).predicts
    rate, bound = screen.split_rate(shapes["prefill"], counts["prefill"], shapes["decode"], counts["decode"], work,
                                    slos_ms, adaptive=adaptive)
    return screen.Screened(candidate.label, rate, candidate.num_gpus, bound,
                           f"{'adaptive' if adaptive else 'split'} {tps}")


def screen_search(profile: dict | Sequence[dict], search: Sequence[Candidate], *, dataset_name: str,
                  slos_ms: Mapping[str, float], link_gbps: float = 364.0, seed: int = 0,
                  margin: float = screen.DEFAULT_MARGIN, max_simulated: int | None = None,
                  **lengths: Any) -> list[Candidate]:
    """Screen every candidate of ``search`` (its ``screened``: `screened`, over the workload's
    `workload_shape`) and return those to simulate (`screen.shortlist` at ``margin``, at most
    ``max_simulated``; a margin of 0 and no cap keep every one), in the search's order.

    Raises:
        ValueError: a margin outside [0, 1], a cap below 1, profiles `profiles_by_tp` refuses, a
            candidate at a TP no profile timed, or a workload flag out of range.
    """
    profiles = profiles_by_tp(profile)
    work = workload_shape(next(iter(profiles.values())), dataset_name=dataset_name, seed=seed, **lengths)
    for cand in search:
        cand.screened = screened(cand, profiles, slos_ms, work, link_gbps)
    verdicts = screen.shortlist([c.screened for c in search], margin, max_simulated)
    return [c for c in search if verdicts[c.label] is None]


def plan(profile: dict | Sequence[dict], *, dataset_name: str, slos_ms: Mapping[str, float], num_gpus: int,
         chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES, run_length: RunLength = RunLength(), seed: int = 0,
         seeds: int = 1, link_gbps: float = 364.0, hops: Mapping[str, float] | None = None,
         search: Sequence[Candidate] | None = None,
         adaptive_chunk_sizes: Sequence[int] | None = None, adaptive_prefers: Sequence[str] | None = None,
         jobs: int = 1, on_judged: Callable[[Candidate], None] | None = None,
         start_rate_per_gpu: float | None = 1.0, **lengths: Any) -> list[Candidate]:
    """Judge every candidate (each role against ``profile``'s of its TP: one profile, or one per
    TP degree, `profiles_by_tp`, `role_profiles`), ``jobs`` runs at a time in worker processes (each
    simulation is one core's work: 19 candidates of 64 GPUs take ~75 minutes of one), every
    candidate's runs in one pool, so no core idles while another ends a long search; with more
    ``jobs`` than candidates, each candidate's rates ``jobs // candidates`` at a time
    (`rate_search`: the same goodput, a knee in a few rounds of runs instead of ~11 runs one after
    the other). Return them best first (goodput per GPU, then the order searched). ``on_judged``
    sees each as it is judged. ``start_rate_per_gpu``: each candidate's first rate (`max_rate`'s
    start) per GPU; one near the knee skips the runs of the rates doubled through below it (the
    same goodput wherever those would all have held: the same bracket is then bisected); None:
    each candidate's screened rate (`screen_search`; 1 req/s per GPU where it has none), its
    search probed (`_start`, `rate_search`). No
    candidate's search doubles past the rate at which a run of ``run_length.max_prompts``
    arrives within the TTFT SLO: beyond it every run is one burst the fleet drains within the
    SLO (a goodput there is named as judged on short runs), the same verdict at any rate; a
    start within `rate_search.CEILING_FIRST` doublings of it judges that doubling first.

    Raises:
        ValueError: a bad GPU count, SLOs missing, fewer than one seed or job, a hop below 0 ms,
            a start rate not above 0, a workload flag out of range, profiles `profiles_by_tp`
            refuses, or a candidate of ``search`` at a TP no profile timed.
    """
    if seeds < 1:
        raise ValueError(f"--seeds: expected at least 1 draw per rate, got {seeds}")
    if jobs < 1:
        raise ValueError(f"--jobs: expected at least 1 worker process, got {jobs}")
    if start_rate_per_gpu is not None and not 0 < start_rate_per_gpu < math.inf:
        raise ValueError(f"--start-rate: expected a rate > 0 req/s per GPU, got {start_rate_per_gpu}")
    if not slos_ms:
        raise ValueError("--goodput: expected SLOs such as ttft:500 tpot:50, got none")
    check_hops(**(hops or {}))
    profiles = profiles_by_tp(profile)
    search = list(search if search is not None else candidates(num_gpus, chunk_sizes,
                                                                adaptive_chunk_sizes=adaptive_chunk_sizes,
                                                                adaptive_prefers=adaptive_prefers,
                                                                tensor_parallel=list(profiles)))
    roles = [role_profiles(cand, profiles) for cand in search]
    bases = [base_of(cand, profiles, slos_ms) for cand in search]
    ceiling = run_length.max_prompts / (slos_ms["ttft"] / 1e3) if slos_ms.get("ttft") else math.inf
    starts = [(*_start(cand, start_rate_per_gpu), ceiling) for cand in search]
    for cand in search:
        router = cand.sections.get("router") or {}
        if policy_of(router.get("placement", DEFAULT_PLACEMENT)).predicts:  # against the SLOs it is judged by
            router.setdefault("slo_ttft_ms", slos_ms.get("ttft"))
            router.setdefault("slo_tpot_ms", slos_ms.get("tpot"))
    kwargs = dict(dataset_name=dataset_name, slos_ms=slos_ms, run_length=run_length, seed=seed, seeds=seeds,
                  link_gbps=link_gbps, hops=hops, **lengths)
    judged = []
    if jobs == 1:
        for cand, base, prof, (start, doublings, probe, top) in zip(search, bases, roles, starts):
            judged.append(judge(cand, base, prof, start_rate=start, max_doublings=doublings, ceiling=top,
                                probe=probe, **kwargs))
            if on_judged is not None:
                on_judged(judged[-1])
    else:
        judged = _judge_rates_in_workers(search, bases, roles, starts, jobs, kwargs, on_judged)
    order = {id(c): i for i, c in enumerate(judged)}
    return sorted(judged, key=lambda c: (-round(c.goodput_per_gpu, 9), order[id(c)]))


# `_start`: a search from a candidate's screened rate doubles (or halves) it at most this often (32x
# either way: the screen is off by less, and a rate 32x past it is a burst the runs' length cannot load).
SCREENED_DOUBLINGS = 5


def _start(candidate: Candidate, per_gpu: float | None) -> tuple[float, int, bool]:
    """``candidate``'s first rate judged, the most doublings (or halvings) from it and whether its
    search is probed (`rate_search`): ``per_gpu`` per GPU, `MAX_DOUBLINGS`, unprobed; None: its
    screened rate, where it has one above 0, `SCREENED_DOUBLINGS`, probed (a screened rate is
    meant to be near the knee) (else 1 req/s per GPU, unprobed)."""
    if per_gpu is None and candidate.screened is not None and candidate.screened.rate_rps > 0:
        return candidate.screened.rate_rps, SCREENED_DOUBLINGS, True
    return (per_gpu or 1.0) * candidate.num_gpus, MAX_DOUBLINGS, False


def _judge_rates_in_workers(search: list[Candidate], bases: list[dict[str, Any]], roles: list[dict[str, dict]],
                            starts: list[tuple[float, int, bool, float]], jobs: int, kwargs: dict[str, Any],
                            on_judged: Callable[[Candidate], None] | None) -> list[Candidate]:
    """`judge` of every candidate with its rates judged ``jobs // len(search)`` at a time (at
    least one: `rate_search`'s batches; each run one task, `rate_attainment`) in one pool of
    ``jobs`` worker processes (`run_pool.search_in_pool`: a free core takes the waiting run of the
    slowest search, else a run a search may ask next); in search order."""
    width = max(1, jobs // max(1, len(search)))
    configs = [Config.from_dict(config_of(base, cand), origin=cand.label) for cand, base in zip(search, bases)]
    searches = [run_pool.Search(functools.partial(rate_search, start, width, max_doublings=doublings, ceiling=top,
                                                  probe=probe))
                for start, doublings, probe, top in starts]

    def ended(i: int, goodput: float) -> None:
        search[i].goodput_rps = goodput
        if on_judged is not None:
            on_judged(search[i])

    run_pool.search_in_pool(searches, rate_attainment, list(zip(configs, roles)), kwargs, jobs,
                            lambda i, rate, run: search[i].note(rate, *run), ended)
    return search


def best_yaml(best: Candidate, base: dict[str, Any], *, dataset_name: str, link_gbps: float,
              ranked: Sequence[Candidate], hops: Mapping[str, float] | None = None,
              extrapolated: Sequence[str] = (), num_screened_out: int = 0) -> str:
    """The YAML of ``best`` with a header saying how it was chosen (among ``ranked``, beside
    ``num_screened_out`` candidates not simulated; the hops given, if any) and where its
    simulation extrapolated the profile (``extrapolated``: its `extrapolations`)."""
    import yaml

    colocated = [c for c in ranked if c.label.startswith("colocated")]
    versus = (f" ({best.goodput_per_gpu / colocated[0].goodput_per_gpu:.2f}x the best colocated)"
              if colocated and colocated[0].goodput_per_gpu > 0 else "")
    given = "".join(f", --{name.replace('_', '-')} {value:g}" for name, value in (hops or {}).items() if value)
    out = f" simulated ({num_screened_out} more screened out)" if num_screened_out else ""
    header = (f"# `disagg plan`: the best of {len(ranked)} deployments{out} of {best.num_gpus} GPU(s) for workload "
              f"{dataset_name!r},\n# simulated goodput {best.goodput_per_gpu:.3f} req/s per GPU{versus}; "
              f"pushes at {link_gbps:g} GB/s{given}.\n")
    if extrapolated:
        header += f"# extrapolated beyond the profile's samples: {'; '.join(extrapolated)}.\n"
    return header + yaml.safe_dump(config_of(base, best), sort_keys=False)


def table_rows(ranked: Sequence[Candidate]) -> list[tuple[str, str, str, str, str]]:
    """(deployment, goodput req/s, per GPU, vs the best colocated, screened per GPU) per
    candidate, best first."""
    colocated = max((c.goodput_per_gpu for c in ranked if c.label.startswith("colocated")), default=0.0)
    return [(c.label, f"{c.goodput_rps:.3f}", f"{c.goodput_per_gpu:.3f}",
             f"{c.goodput_per_gpu / colocated:.2f}x" if colocated > 0 else "-",
             f"{c.screened.rate_per_gpu:.3f}" if c.screened is not None else "-") for c in ranked]


def screen_lines(search: Sequence[Candidate], margin: float, max_simulated: int | None = None) -> list[str]:
    """What `disagg plan` prints of its screen (`screen_search` screened ``search`` at ``margin``
    and ``max_simulated``): a heading, then each candidate, best screened first, simulated or
    screened out and why."""
    verdicts = screen.shortlist([c.screened for c in search], margin, max_simulated)
    kept = sum(v is None for v in verdicts.values())
    lines = [f"screen: {kept} of {len(search)} candidates simulated (rates from the profiles' step-time models "
             f"at the workload's mean lengths, req/s per GPU; --screen-margin {margin:g}"
             + (f", --max-simulated {max_simulated}" if max_simulated else "") + ")"]
    for cand in sorted(search, key=lambda c: -c.screened.rate_per_gpu):
        verdict = verdicts[cand.label]
        lines.append(f"  {'simulate' if verdict is None else 'screened out':<12} {cand.label}: "
                     f"{cand.screened.rate_per_gpu:.3f} ({cand.screened.bound}{'; ' + verdict if verdict else ''})")
    return lines
