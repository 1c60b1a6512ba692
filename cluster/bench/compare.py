"""Judge runs against SLOs: attainment vs rate, per-GPU goodput (DistServe), SLO-scale sweeps.

DistServe (Zhong et al., OSDI 2024) defines SLO attainment as the fraction of requests that meet
both their TTFT and their TPOT SLO, and per-GPU goodput as the highest request rate per GPU at
which attainment stays >= 90%. Here a sweep measures attainment at a few rates; the goodput is
read off the curve by linear interpolation between the last rate that holds the target and the
first that falls below it (`per_gpu_goodput`). Every figure recomputes from the stored
per-request lists, so one sweep also answers "what if the SLOs were k times looser" (the SLO-
scale sweep) without another run. Pure Python; `quick_compare` at the bottom launches clusters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from disagg.cluster.bench.metrics import slo_attainment
from disagg.cluster.bench.report import outputs_from_result, rate_from_json
from disagg.errors import DisaggError

logger = logging.getLogger(__name__)

TARGET_ATTAINMENT = 0.9
DEFAULT_SLO_SCALES: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


class Mismatch(DisaggError, ValueError):
    """The deployments of a comparison differ in model, dtype or workload (and that was not allowed)."""


def setup_mismatches(setups: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """How deployments differ from the first in what a fair comparison holds equal.

    Args:
        setups: label -> {"model": ..., "dtype": ..., "workload": {...}} (a key left out or None is
            not compared).

    Returns:
        one phrase per differing key, e.g. "model: tiny-1p1d runs 'dummy:tiny', smol runs 'smollm2'".
    """
    items = list(setups.items())
    if len(items) < 2:
        return []
    items = [(label, {**setup, "workload": _workload_only(setup.get("workload"))}) for label, setup in items]
    (first_label, first), found = items[0], []
    for key in ("model", "dtype", "workload"):
        differing = [(label, setup.get(key)) for label, setup in items[1:]
                     if setup.get(key) is not None and first.get(key) is not None and setup.get(key) != first.get(key)]
        if differing:
            found.append(f"{key}: {first_label} runs {_short(first.get(key))}, " +
                         ", ".join(f"{label} runs {_short(value)}" for label, value in differing))
    return found


def _workload_only(workload: Any) -> Any:
    """``workload`` as the requests it makes: its ``max_model_len`` (the deployment's limit,
    recorded with it) counts only when it clips a length, i.e. below the longest request that
    input_len, range_ratio and output_len allow; two limits that clip nothing are the same workload."""
    if not isinstance(workload, Mapping) or workload.get("max_model_len") is None:
        return workload
    try:
        longest = math.ceil(workload["input_len"] * (1 + (workload.get("range_ratio") or 0))) + workload["output_len"]
    except (KeyError, TypeError):
        return workload
    if longest <= workload["max_model_len"]:
        return {k: v for k, v in workload.items() if k != "max_model_len"}
    return workload


def _short(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} {v}" for k, v in value.items() if k not in ("source",)) + "}"
    return repr(value)


def config_mismatches(config: Any, others: Sequence[Any], overrides: Mapping[str, Any] | None = None,
                      variants: Sequence[Mapping[str, Any]] = ()) -> list[str]:
    """`setup_mismatches` of CONFIG (+ overrides) and each comparison config (+ each variant), read
    from the YAML files before anything launches (model.source and model.dtype)."""
    from disagg.config import Config

    setups = {}
    for path, override in [(config, overrides)] + [(p, v) for p in others for v in (list(variants) or [None])]:
        loaded = Config.from_yaml(path)
        loaded = loaded.override(dict(override)) if override else loaded
        label = loaded.name + "".join(f"[{k.split('.')[-1]}={v}]" for k, v in (override or {}).items())
        setups[label] = {"model": loaded.model.source, "dtype": loaded.model.dtype}
    return setup_mismatches(setups)


def scale_slos(slos_ms: Mapping[str, float], scale: float) -> dict[str, float]:
    """Every SLO multiplied by `scale` (> 0)."""
    if not scale > 0:
        raise ValueError(f"--slo-scales: expected factors > 0, got {scale}")
    return {name: value * scale for name, value in slos_ms.items()}


def attainment_of(result: Mapping[str, Any], slos_ms: Mapping[str, float]) -> float:
    """SLO attainment of one stored run under `slos_ms` (failed requests are misses)."""
    return slo_attainment(outputs_from_result(result), slos_ms)


def per_gpu_goodput(rates: Sequence[float], attainments: Sequence[float], num_gpus: int,
                    target: float = TARGET_ATTAINMENT) -> dict[str, Any]:
    """Highest rate per GPU with attainment >= target, interpolated on a measured curve.

    Args:
        rates: request rates of the runs (requests/s of the whole deployment); inf is ignored.
        attainments: attainment at each rate, in [0, 1].
        num_gpus: GPUs of the deployment (>= 1).
        target: the attainment goal (DistServe: 0.9).

    Returns:
        {"per_gpu_goodput": req/s/GPU, "rate": req/s of the deployment, "bound": how far to
        trust it}: bound "interpolated" when the curve crosses the target inside the sweep,
        "at_least" when every rate held (goodput >= the highest rate swept), "below_range" when
        even the lowest rate missed (goodput < the lowest rate; 0 reported), "no_data" for none.

    Raises:
        ValueError: lists of different lengths, num_gpus < 1 or target outside (0, 1].
    """
    if len(rates) != len(attainments):
        raise ValueError(f"rates and attainments: expected equal lengths, got {len(rates)} and {len(attainments)}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus: expected >= 1, got {num_gpus}")
    if not 0 < target <= 1:
        raise ValueError(f"target: expected an attainment in (0, 1], got {target}")
    points = sorted((float(r), float(a)) for r, a in zip(rates, attainments) if math.isfinite(float(r)))
    if not points:
        return {"per_gpu_goodput": None, "rate": None, "bound": "no_data"}
    below = next((i for i, (_, att) in enumerate(points) if att < target), None)
    if below is None:
        rate, bound = points[-1][0], "at_least"
    elif below == 0:
        rate, bound = 0.0, "below_range"
    else:
        (r0, a0), (r1, a1) = points[below - 1], points[below]
        rate, bound = r0 + (a0 - target) * (r1 - r0) / (a0 - a1), "interpolated"
    return {"per_gpu_goodput": rate / num_gpus, "rate": rate, "bound": bound}


def side_summary(label: str, results: Sequence[Mapping[str, Any]], num_gpus: int,
                 slos_ms: Mapping[str, float], slo_scales: Sequence[float] = DEFAULT_SLO_SCALES,
                 target: float = TARGET_ATTAINMENT) -> dict[str, Any]:
    """Attainment curve, per-GPU goodput (at every SLO scale) and tails of one deployment's sweep."""
    rates = [rate_from_json(r["request_rate"]) for r in results]
    attainment = [attainment_of(r, slos_ms) for r in results]
    per_scale = []
    for scale in slo_scales:
        scaled = scale_slos(slos_ms, scale)
        curve = [attainment_of(r, scaled) for r in results]
        per_scale.append({"scale": scale, "slos_ms": scaled, "attainment": curve,
                          **per_gpu_goodput(rates, curve, num_gpus, target)})
    return {
        "label": label, "num_gpus": num_gpus, "rates": rates, "attainment": attainment,
        **per_gpu_goodput(rates, attainment, num_gpus, target),
        "per_scale": per_scale,
        "p99_ttft_ms": [r["p99_ttft_ms"] for r in results], "p99_tpot_ms": [r["p99_tpot_ms"] for r in results],
        "request_throughput": [r["request_throughput"] for r in results],
        "output_throughput": [r["output_throughput"] for r in results],
        "failed": [r["failed"] for r in results],
        "busy_fraction": [r.get("busy_fraction") for r in results],
        "gpu_utilization": [r.get("gpu_utilization") for r in results],
        "mean_client_overhead_ms": [r.get("mean_client_overhead_ms") for r in results],
    }


def family(label: str) -> str:
    """A deployment's config name without its variant: "llama3-8b-colocated[max_num_batched_tokens
    =2048]" -> "llama3-8b-colocated"."""
    return label.split("[", 1)[0]


def compare_sides(sides: Sequence[Mapping[str, Any]], slos_ms: Mapping[str, float],
                  target: float = TARGET_ATTAINMENT) -> dict[str, Any]:
    """Per SLO scale: each side's per-GPU goodput, the best of the others, and the ratio.

    Side 0 names the deployment under test (CONFIG). Sides of the same config with other
    settings (labels that differ only in their "[...]" variant, e.g. a prefill budget swept with
    `--set`) are its variants: "best_own" is the best of them at each scale. Every other side is
    what it is compared with (CONFIG2 and its tuned variants): "best_other" is the best of those,
    as a careful operator would pick it. The ratio is best_own / best_other, so neither side is
    judged at a setting its operator would not choose.

    A goodput outside the rates swept is a bound ("at_least": every rate held; "below_range":
    below the lowest rate), and so is the ratio then: "ratio_bound" is "exact" (both found
    inside the sweep), "at_least" or "at_most" (ratio is the bound: e.g. a side holding every
    rate over one below its lowest), or None with ratio None when the sweep cannot order them
    (both held every rate, or both missed the lowest).
    """
    rows = []
    scales = [entry["scale"] for entry in sides[0]["per_scale"]] if sides else []
    mine_family = family(sides[0]["label"]) if sides else None
    lowest = {side["label"]: _lowest(side) for side in sides}
    for index, scale in enumerate(scales):
        goodputs = {side["label"]: side["per_scale"][index]["per_gpu_goodput"] for side in sides}
        bounds = {side["label"]: side["per_scale"][index]["bound"] for side in sides}
        own = [(label, value) for label, value in goodputs.items() if family(label) == mine_family]
        others = [(label, value) for label, value in goodputs.items() if family(label) != mine_family]
        own_label, mine = max(own, key=lambda item: item[1] or 0.0)
        if mine is None:  # no goodput anywhere in the family: name the side under test
            own_label, mine = sides[0]["label"], goodputs[sides[0]["label"]]
        best_label, best = max(others, key=lambda item: item[1] or 0.0, default=(None, None))
        ratio, ratio_bound = (None, None) if best_label is None else bounded_ratio(
            (mine, bounds[own_label], lowest[own_label]), (best, bounds[best_label], lowest[best_label]))
        rows.append({"scale": scale, "slos_ms": scale_slos(slos_ms, scale), "per_gpu_goodput": goodputs,
                     "bound": bounds, "best_own": own_label, "best_other": best_label, "ratio": ratio,
                     "ratio_bound": ratio_bound})
    return {"target_attainment": target, "slos_ms": dict(slos_ms), "rows": rows}


def _lowest(side: Mapping[str, Any]) -> float | None:
    """The lowest finite rate a side ran, per GPU: what a "below_range" goodput is below."""
    finite = [float(r) for r in side.get("rates") or [] if math.isfinite(float(r))]
    return min(finite) / (side.get("num_gpus") or 1) if finite else None


def bounded_ratio(mine: tuple[float | None, str, float | None],
                  other: tuple[float | None, str, float | None]) -> tuple[float | None, str | None]:
    """(ratio, how far to trust it) of two goodputs, each given as (per-GPU goodput, its bound,
    the lowest rate per GPU its side ran); see `compare_sides`."""
    (a, a_bound, a_low), (b, b_bound, b_low) = mine, other
    if a is None or b is None or "no_data" in (a_bound, b_bound):
        return None, None
    if a_bound == b_bound and a_bound in ("at_least", "below_range"):
        return None, None  # both open the same way: the sweep cannot order them
    if a_bound == "below_range":
        a = a_low  # the true goodput is below it
    if b_bound == "below_range":
        b = b_low
    if not a or not b:
        return None, None
    low = a_bound == "at_least" or b_bound == "below_range"
    high = a_bound == "below_range" or b_bound == "at_least"
    return a / b, "at_least" if low else "at_most" if high else "exact"


def slo_scale_curve(result: Mapping[str, Any], slos_ms: Mapping[str, float],
                    scales: Sequence[float] = DEFAULT_SLO_SCALES) -> list[tuple[float, float]]:
    """Attainment of one run (a fixed rate) with every SLO scaled by each factor."""
    outputs = outputs_from_result(result)
    return [(scale, slo_attainment(outputs, scale_slos(slos_ms, scale))) for scale in scales]


def quick_compare(config_a: str, config_b: str, out_dir: str, *, num_prompts: int = 16,
                  rates: Sequence[float] = (1.0, 4.0), dataset_name: str = "random",
                  goodput: Mapping[str, float] | None = None, seed: int = 0, progress: bool = False,
                  allow_mismatch: bool = False, caveat: str | None = None, launched: Any = None,
                  extend_to_limit: int = 0, **workload_overrides: Any) -> dict[str, Any]:
    """Compare two configs on one workload in one call (the demo's entry); prints a small table.

    Args:
        config_a: the deployment under test (e.g. configs/tiny-1p1d.yaml).
        config_b: what it is compared with (e.g. configs/tiny-colocated.yaml).
        out_dir: JSON results and PNG plots go here.
        num_prompts / rates / dataset_name / seed: the workload and the sweep.
        goodput: SLOs in ms ({"ttft": .., "tpot": ..}); None takes config_a's `bench.goodput`.
        progress: show a progress bar per run.
        allow_mismatch: compare configs of different models or dtypes (logged as a warning).
        caveat: why the goodputs do not compare the deployments (e.g. both sides time-slice one
            GPU): printed in place of the goodput table, above the common-rate table (what the runs
            do show), and noted in summary.md.
        launched: config_a's fleet, already launched: swept, then shut down (`sweep.bench_config`).
        extend_to_limit: up to this many more rates per side while it held every rate, each
            twice the highest (`sweep.limit_rate`).
        workload_overrides: input_len, output_len, range_ratio for the workload; run_seconds and
            min_prompts for the requests of each run (`sweep.prompts_at`).

    Returns:
        the comparison summary (also written to out_dir/compare.json), with "plots" listing PNGs.
    """
    from disagg.cluster.bench.sweep import SweepOptions, compare_configs

    from rich.console import Console

    from disagg.cluster.bench.tables import common_rate_table, comparison_table

    options = SweepOptions(num_prompts=num_prompts, rates=list(rates), dataset_name=dataset_name,
                           goodput_slos_ms=dict(goodput) if goodput else None, seed=seed,
                           show_progress=progress, extend_to_limit=extend_to_limit, **workload_overrides)
    differences = config_mismatches(config_a, [config_b])
    if differences and not allow_mismatch:
        raise Mismatch(f"{config_a} and {config_b} differ: {'; '.join(differences)}; compare one model and "
                       "dtype, or pass allow_mismatch=True")
    for what in differences:
        logger.warning("comparing deployments that differ: %s", what)
    summary = compare_configs(config_a, [config_b], out_dir, options, mismatches=differences,
                              notes=[caveat] if caveat else (), launched=launched)
    if caveat:
        Console().print(caveat, markup=False, highlight=False)
    else:
        Console().print(comparison_table(summary))
    Console().print(common_rate_table(summary))
    return summary
