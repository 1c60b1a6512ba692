"""`disagg plan`: which deployment of N GPUs serves a workload with the most goodput per GPU.

The candidates, one instance per GPU (per TP ranks, below), all with the profiled instance's model,
pages and budgets:

    colocated-N[chunk=C]   N colocated instances, prompt chunks of C tokens (`--chunk-sizes`)
    xPyD                   x prefill + y decode instances (x + y = N; beyond 8 GPUs nine
                           ratios, `prefill_counts`), every prompt pushed
    xPyD-adaptive[chunk=C] the same fleet with `router.placement: adaptive` (per-request
                           remote / local / kept from the profile's step-time model), its
                           targets `router.slo_ttft_ms` / `slo_tpot_ms` the SLOs judged, at
                           each `--adaptive-chunk-sizes` C (default: `--chunk-sizes`, as the
                           colocated side: best against best; the label drops [chunk=C] when
                           there is one), and each `--adaptive-prefer` P (`router.adaptive_prefer`;
                           default the config's default alone, labelled [prefer=P] when there
                           are several)

With one profile per TP degree (`disagg plan --profile P1 --profile P2`, `profiles_by_tp`) the
search runs once per degree a over N // a instances of a ranks each (`instances.tensor_parallel`),
every candidate simulated with the step times of its TP's profile, and the labels name the TP:
``colocated-n(TPa)[chunk=C]``, ``xP(TPa)+yD(TPa)``, ``xP(TPa)+yD(TPa)-adaptive``; a single profile
of TP 1 keeps the labels above. Prefill and decode instances run at one TP (the config refuses
two), so a split's TPs are equal.

Each candidate's goodput is DistServe's: the highest request rate whose SLO attainment (the
fraction of requests within every `--goodput` SLO) is at least 90% (`bench.compare.
TARGET_ATTAINMENT`), found by simulating (`run.simulate_run`, the same workload and arrival seeds
for every candidate and rate; `RunLength`: about 30 s of arrivals) at doubling rates, then bisecting between the last rate that held
and the first that missed (`rate_search.py`). With ``seeds`` > 1 a rate's attainment pools the requests of that many
runs (prompts and arrivals drawn from seeds ``seed .. seed + seeds - 1``): one draw of 30 s
decides a knee by a few requests, and small policy changes then flip rows. The table ranks them by goodput per GPU; the best one's YAML is what
`disagg launch` / `disagg bench` run. Pure Python; no GPU.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from disagg.cluster.bench.compare import TARGET_ATTAINMENT
from disagg.cluster.bench.metrics import RequestOutput, meets_slos
from disagg.cluster.routing.placement import ADAPTIVE, DEFAULT_PLACEMENT, policy_of
from disagg.cluster.simulate.fleet import SimFleet, check_hops
from disagg.cluster.simulate.profile import profile_tensor_parallel
from disagg.cluster.simulate.rate_search import max_rate, rate_search
from disagg.cluster.simulate.run import simulate_run, workload_spec
from disagg.config import Config, RouterSection

DEFAULT_CHUNK_SIZES = (512, 2048, 8192)


@dataclass
class Candidate:
    """One deployment of the search, its goodput once judged."""

    label: str
    sections: dict[str, Any]  # the YAML sections that make it (instances, scheduler, router)
    goodput_rps: float = 0.0
    attainment_at: dict[float, float] = field(default_factory=dict)
    cut_at: set[float] = field(default_factory=set)  # rates whose runs stopped at a certain miss

    @property
    def tensor_parallel(self) -> int:
        """The ranks of each of its instances (the profile that times them is that TP's)."""
        return int(self.sections["instances"].get("tensor_parallel", 1))

    @property
    def num_gpus(self) -> int:
        inst = self.sections["instances"]
        return (inst.get("colocated", 0) + inst.get("prefill", 0) + inst.get("decode", 0)) * self.tensor_parallel

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.num_gpus

    def note(self, rate: float, attained: float, cut: bool) -> float:
        """Its attainment at ``rate`` (``cut``: the run stopped at a certain miss); returns it."""
        self.attainment_at[rate] = attained
        if cut:
            self.cut_at.add(rate)
        return attained


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
    """`extrapolations` of each candidate of ``search`` against the profile of its TP."""
    out: dict[str, list[str]] = {}
    for tp, prof in profiles.items():
        out.update(extrapolations(prof, base_sections(prof, slos_ms), [c for c in search if c.tensor_parallel == tp]))
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


def prefill_counts(num_gpus: int) -> list[int]:
    """The prefill instance counts x of the xPyD splits searched: every one up to 8 GPUs, beyond
    that the splits nearest to x/N = 1/8, 1/6, 1/4, 1/3, 1/2, 2/3, 3/4, 5/6, 7/8."""
    if num_gpus <= 8:
        return list(range(1, num_gpus))
    fractions = (1 / 8, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4, 5 / 6, 7 / 8)
    return sorted({min(num_gpus - 1, max(1, round(num_gpus * f))) for f in fractions})


def candidates(num_gpus: int, chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES, *, splits: bool = True,
               adaptive: bool = True, colocated: bool = True,
               adaptive_chunk_sizes: Sequence[int] | None = None,
               adaptive_prefers: Sequence[str] | None = None,
               tensor_parallel: Sequence[int] = (1,)) -> list[Candidate]:
    """Every deployment of the search for ``num_gpus`` (module docstring; `prefill_counts`);
    ``adaptive_chunk_sizes`` defaults to ``chunk_sizes``; ``adaptive_prefers``: the adaptive
    candidates' `router.adaptive_prefer` values (default: the config's default alone; set in
    their YAML unless it is that default); ``tensor_parallel``: the TP degrees of the instances
    (those profiled), the whole search once per degree over ``num_gpus // tp`` instances."""
    if num_gpus < 1:
        raise ValueError(f"--gpus: expected at least 1 GPU, got {num_gpus}")
    named = tuple(tensor_parallel) != (1,)
    out = []
    for tp in tensor_parallel:
        if num_gpus // tp >= 1:
            out += _candidates_at(num_gpus // tp, tp if named else None, chunk_sizes, splits=splits,
                                  adaptive=adaptive, colocated=colocated,
                                  adaptive_chunk_sizes=adaptive_chunk_sizes, adaptive_prefers=adaptive_prefers)
    return out


def _candidates_at(num_instances: int, tp: int | None, chunk_sizes: Sequence[int], *, splits: bool,
                   adaptive: bool, colocated: bool, adaptive_chunk_sizes: Sequence[int] | None,
                   adaptive_prefers: Sequence[str] | None) -> list[Candidate]:
    """`candidates` of ``num_instances`` instances, each of ``tp`` ranks (None: one, and the
    labels name no TP: ``xPyD``; else ``xP(TPa)+yD(TPb)``, ``colocated-n(TPa)``)."""
    default_prefer = RouterSection.model_fields["adaptive_prefer"].default
    adaptive_prefers = (default_prefer,) if adaptive_prefers is None else tuple(adaptive_prefers)
    ranks = {} if tp is None or tp == 1 else {"tensor_parallel": tp}
    at = "" if tp is None else f"(TP{tp})"
    out = []
    if colocated:
        for chunk in chunk_sizes:
            out.append(Candidate(f"colocated-{num_instances}{at}[chunk={chunk}]", {
                "instances": {"colocated": num_instances, **ranks}, "scheduler": {"max_num_batched_tokens": chunk}}))
    for x in prefill_counts(num_instances) if splits or adaptive else ():
        instances = {"prefill": x, "decode": num_instances - x, **ranks}
        split = f"{x}P{num_instances - x}D" if tp is None else f"{x}P{at}+{num_instances - x}D{at}"
        if splits:
            out.append(Candidate(split, {"instances": instances}))
        if adaptive:
            chunks = list(chunk_sizes if adaptive_chunk_sizes is None else adaptive_chunk_sizes)
            for chunk in chunks:
                for prefer in adaptive_prefers:
                    suffix = (f"[chunk={chunk}]" if len(chunks) > 1 else "") + \
                        (f"[prefer={prefer}]" if len(adaptive_prefers) > 1 else "")
                    router = {"placement": ADAPTIVE.name,
                              **({"adaptive_prefer": prefer} if prefer != default_prefer else {})}
                    out.append(Candidate(f"{split}-adaptive{suffix}", {
                        "instances": instances, "router": router, "scheduler": {"max_num_batched_tokens": chunk}}))
    return out


def only(search: Sequence[Candidate], labels: Sequence[str]) -> list[Candidate]:
    """The candidates of ``search`` named in ``labels`` (as `candidates` labels them), in the
    search's order: `disagg plan --only`, to judge a few deployments of a fleet too large to
    search whole on the CPUs at hand (64 GPUs: ~4 minutes of a core per adaptive candidate).

    Raises:
        ValueError: a label not in the search (the message lists those that are).
    """
    known = [c.label for c in search]
    unknown = [label for label in labels if label not in known]
    if unknown or not labels:
        raise ValueError(f"--only: expected labels of this search ({', '.join(known)}), got "
                         f"{', '.join(unknown) if unknown else 'none'}")
    return [c for c in search if c.label in labels]


def config_of(base: dict[str, Any], candidate: Candidate) -> dict[str, Any]:
    """The base sections with the candidate's merged in (a YAML-ready dict)."""
    merged = {name: dict(section) for name, section in base.items()}
    for name, section in candidate.sections.items():
        merged.setdefault(name, {}).update(section)
    return merged


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


def rate_attainment(config: Config, profile: dict, rate: float, *, dataset_name: str,
                    slos_ms: Mapping[str, float], run_length: RunLength = RunLength(), seed: int = 0,
                    seeds: int = 1, link_gbps: float = 364.0, hops: Mapping[str, float] | None = None,
                    stop_early: bool = True, **lengths: Any) -> tuple[float, bool]:
    """The SLO attainment of the deployment ``config`` at ``rate`` req/s over ``seeds`` draws,
    pooled (`judge`), and whether its runs stopped at a certain miss (then the attainment is a
    bound below the target)."""
    outputs: list[RequestOutput] = []
    num_prompts = run_length.prompts_at(rate)
    allowed = misses_allowed(num_prompts * seeds)
    misses = 0

    def certain_miss(out: RequestOutput) -> bool:
        nonlocal misses
        misses += not meets_slos(out, slos_ms)
        return misses > allowed

    for draw in range(seed, seed + seeds):
        fleet = SimFleet(config, profile, link_gbps, **(hops or {}))
        spec = workload_spec(profile, fleet.max_model_len, dataset_name=dataset_name,
                             num_prompts=num_prompts, seed=draw, **lengths)
        outputs += simulate_run(config, profile, spec, request_rate=rate, seed=draw, fleet=fleet,
                                stop_when=certain_miss if stop_early else None).run.outputs
        if misses > allowed:
            break
    return sum(meets_slos(out, slos_ms) for out in outputs) / (num_prompts * seeds), misses > allowed


def judge(candidate: Candidate, base: dict[str, Any], profile: dict, *, dataset_name: str,
          slos_ms: Mapping[str, float], run_length: RunLength = RunLength(), seed: int = 0, seeds: int = 1,
          link_gbps: float = 364.0, hops: Mapping[str, float] | None = None, start_rate: float | None = None,
          stop_early: bool = True, start_rate_per_gpu: float = 1.0, **lengths: Any) -> Candidate:
    """Simulate ``candidate`` at the rates `max_rate` asks for (each over ``seeds`` draws, pooled:
    `rate_attainment`); set its goodput. ``hops``: `SimFleet`'s ``hop_ms``, ``step_gap_ms``,
    ``reserve_ms``. The search starts at ``start_rate`` req/s (default ``start_rate_per_gpu`` per
    GPU of the candidate).

    ``stop_early``: a rate's runs stop as soon as more requests have missed an SLO than
    `TARGET_ATTAINMENT` allows of them all (`misses_allowed`); the rate's verdict is the same,
    its ``attainment_at`` is then a bound below the target (the requests not ended count as
    misses) and the rate is in ``cut_at``. An overloaded run is the slowest to simulate (its
    queue drains long after the arrivals end), and the search runs about half its rates past the
    knee: stopping early judges chat's colocated-2 in a third of the time, to the same goodput
    (ARCHITECTURE §11)."""
    if seeds < 1:
        raise ValueError(f"--seeds: expected at least 1 draw per rate, got {seeds}")
    config = Config.from_dict(config_of(base, candidate), origin=candidate.label)
    settings = dict(dataset_name=dataset_name, slos_ms=slos_ms, run_length=run_length, seed=seed, seeds=seeds,
                    link_gbps=link_gbps, hops=hops, stop_early=stop_early, **lengths)

    def attainment(rate: float) -> float:
        return candidate.note(rate, *rate_attainment(config, profile, rate, **settings))

    candidate.goodput_rps = max_rate(attainment, start_rate or start_rate_per_gpu * candidate.num_gpus)
    return candidate


def plan(profile: dict | Sequence[dict], *, dataset_name: str, slos_ms: Mapping[str, float], num_gpus: int,
         chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES, run_length: RunLength = RunLength(), seed: int = 0,
         seeds: int = 1, link_gbps: float = 364.0, hops: Mapping[str, float] | None = None,
         search: Sequence[Candidate] | None = None,
         adaptive_chunk_sizes: Sequence[int] | None = None, adaptive_prefers: Sequence[str] | None = None,
         jobs: int = 1, on_judged: Callable[[Candidate], None] | None = None, start_rate_per_gpu: float = 1.0,
         **lengths: Any) -> list[Candidate]:
    """Judge every candidate (each against ``profile``'s of its TP: one profile, or one per TP
    degree, `profiles_by_tp`), ``jobs`` at a time in worker processes (each simulation is one
    core's work: 19 candidates of 64 GPUs take ~75 minutes of one); with more ``jobs`` than
    candidates, each candidate's rates ``jobs // candidates`` at a time (`rate_search`: the same
    goodput, a knee in a few rounds of runs instead of ~11 runs one after the other). Return them
    best first (goodput per GPU, then the order searched). ``on_judged`` sees each as it is judged.
    ``start_rate_per_gpu``: each candidate's first rate (`max_rate`'s start) per GPU; one near the
    knee skips the runs of the rates doubled through below it (the same goodput wherever those
    would all have held: the same bracket is then bisected).

    Raises:
        ValueError: a bad GPU count, SLOs missing, fewer than one seed or job, a hop below 0 ms,
            a start rate not above 0, a workload flag out of range, profiles `profiles_by_tp`
            refuses, or a candidate of ``search`` at a TP no profile timed.
    """
    if seeds < 1:
        raise ValueError(f"--seeds: expected at least 1 draw per rate, got {seeds}")
    if jobs < 1:
        raise ValueError(f"--jobs: expected at least 1 worker process, got {jobs}")
    if not 0 < start_rate_per_gpu < math.inf:
        raise ValueError(f"--start-rate: expected a rate > 0 req/s per GPU, got {start_rate_per_gpu}")
    if not slos_ms:
        raise ValueError("--goodput: expected SLOs such as ttft:500 tpot:50, got none")
    check_hops(**(hops or {}))
    profiles = profiles_by_tp(profile)
    bases = {tp: base_sections(prof, slos_ms) for tp, prof in profiles.items()}
    judged = []
    search = search if search is not None else candidates(num_gpus, chunk_sizes,
                                                           adaptive_chunk_sizes=adaptive_chunk_sizes,
                                                           adaptive_prefers=adaptive_prefers,
                                                           tensor_parallel=list(profiles))
    unprofiled = [c.label for c in search if c.tensor_parallel not in profiles]
    if unprofiled:
        raise ValueError(f"--profile: no profile of the TP of {', '.join(unprofiled)} (profiles of TP "
                         f"{', '.join(map(str, profiles))}): profile an instance of that TP")
    for cand in search:
        router = cand.sections.get("router") or {}
        if policy_of(router.get("placement", DEFAULT_PLACEMENT)).predicts:  # against the SLOs it is judged by
            router.setdefault("slo_ttft_ms", slos_ms.get("ttft"))
            router.setdefault("slo_tpot_ms", slos_ms.get("tpot"))
    kwargs = dict(dataset_name=dataset_name, slos_ms=slos_ms, run_length=run_length, seed=seed, seeds=seeds,
                  link_gbps=link_gbps, hops=hops, start_rate_per_gpu=start_rate_per_gpu, **lengths)
    if jobs == 1:
        for cand in search:
            judged.append(judge(cand, bases[cand.tensor_parallel], profiles[cand.tensor_parallel], **kwargs))
            if on_judged is not None:
                on_judged(judged[-1])
    elif jobs > len(search):
        judged = _judge_rates_in_workers(list(search), bases, profiles, jobs, kwargs, on_judged)
    else:
        judged = _judge_in_workers(list(search), bases, profiles, jobs, kwargs, on_judged)
    order = {id(c): i for i, c in enumerate(judged)}
    return sorted(judged, key=lambda c: (-round(c.goodput_per_gpu, 9), order[id(c)]))


def _worker_pool(workers: int):
    """A pool of ``workers`` processes, forked where the platform can (each starts with the
    parent's imports instead of loading them again)."""
    import concurrent.futures
    import multiprocessing

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))


def _judge_in_workers(search: list[Candidate], bases: Mapping[int, dict[str, Any]], profiles: Mapping[int, dict],
                      jobs: int, kwargs: dict[str, Any], on_judged: Callable[[Candidate], None] | None
                      ) -> list[Candidate]:
    """`judge` of every candidate (against the base and profile of its TP) in ``jobs`` forked
    worker processes (the candidates, profiles and settings are copied into them; a result comes
    back as the judged candidate); in search order."""
    import concurrent.futures

    out: list[Candidate | None] = [None] * len(search)
    with _worker_pool(min(jobs, len(search))) as pool:
        futures = {pool.submit(judge, cand, bases[cand.tensor_parallel], profiles[cand.tensor_parallel], **kwargs): i
                   for i, cand in enumerate(search)}
        for future in concurrent.futures.as_completed(futures):
            out[futures[future]] = future.result()
            if on_judged is not None:
                on_judged(out[futures[future]])
    return [cand for cand in out if cand is not None]


def _judge_rates_in_workers(search: list[Candidate], bases: Mapping[int, dict[str, Any]],
                            profiles: Mapping[int, dict], jobs: int, kwargs: dict[str, Any],
                            on_judged: Callable[[Candidate], None] | None) -> list[Candidate]:
    """`judge` of every candidate with its rates judged ``jobs // len(search)`` at a time
    (`rate_search`'s batches; each run one task, `rate_attainment`) in ``jobs`` forked worker
    processes; in search order."""
    import concurrent.futures

    settings = dict(kwargs)
    start_per_gpu = settings.pop("start_rate_per_gpu", 1.0)
    width = max(1, jobs // len(search))
    configs = [Config.from_dict(config_of(bases[cand.tensor_parallel], cand), origin=cand.label) for cand in search]
    searches = [rate_search(start_per_gpu * cand.num_gpus, width) for cand in search]
    batches: list[list[float]] = [[] for _ in search]
    held: list[list[float | None]] = [[] for _ in search]
    with _worker_pool(jobs) as pool:
        futures: dict[concurrent.futures.Future, tuple[int, int]] = {}

        def submit(i: int, rates: list[float]) -> None:
            batches[i], held[i] = rates, [None] * len(rates)
            for j, rate in enumerate(rates):
                futures[pool.submit(rate_attainment, configs[i], profiles[search[i].tensor_parallel], rate,
                                    **settings)] = (i, j)

        for i, rates in enumerate(next(s) for s in searches):
            submit(i, rates)
        while futures:
            done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                i, j = futures.pop(future)
                held[i][j] = search[i].note(batches[i][j], *future.result())
                if any(a is None for a in held[i]):
                    continue
                try:
                    submit(i, searches[i].send(held[i]))
                except StopIteration as end:
                    search[i].goodput_rps = end.value
                    if on_judged is not None:
                        on_judged(search[i])
    return search


def best_yaml(best: Candidate, base: dict[str, Any], *, dataset_name: str, link_gbps: float,
              ranked: Sequence[Candidate], hops: Mapping[str, float] | None = None,
              extrapolated: Sequence[str] = ()) -> str:
    """The YAML of ``best`` with a header saying how it was chosen (the hops given, if any) and
    where its simulation extrapolated the profile (``extrapolated``: its `extrapolations`)."""
    import yaml

    colocated = [c for c in ranked if c.label.startswith("colocated")]
    versus = (f" ({best.goodput_per_gpu / colocated[0].goodput_per_gpu:.2f}x the best colocated)"
              if colocated and colocated[0].goodput_per_gpu > 0 else "")
    given = "".join(f", --{name.replace('_', '-')} {value:g}" for name, value in (hops or {}).items() if value)
    header = (f"# `disagg plan`: the best of {len(ranked)} deployments of {best.num_gpus} GPU(s) for workload "
              f"{dataset_name!r},\n# simulated goodput {best.goodput_per_gpu:.3f} req/s per GPU{versus}; "
              f"pushes at {link_gbps:g} GB/s{given}.\n")
    if extrapolated:
        header += f"# extrapolated beyond the profile's samples: {'; '.join(extrapolated)}.\n"
    return header + yaml.safe_dump(config_of(base, best), sort_keys=False)


def table_rows(ranked: Sequence[Candidate]) -> list[tuple[str, str, str, str]]:
    """(deployment, goodput req/s, per GPU, vs the best colocated) per candidate, best first."""
    colocated = max((c.goodput_per_gpu for c in ranked if c.label.startswith("colocated")), default=0.0)
    return [(c.label, f"{c.goodput_rps:.3f}", f"{c.goodput_per_gpu:.3f}",
             f"{c.goodput_per_gpu / colocated:.2f}x" if colocated > 0 else "-") for c in ranked]
