"""The SLOs of the 70B and 32B rows: the 8B table's (docs/results.md: strict = 3x the isolated TTFT
and 2.5x the batch-1 decode step measured on 1P1D; chat at 2x those) scaled by how much slower the
derived instance's isolated prompt and batch-1 decode step are predicted than the 8B profile's,
at the workload's mean prompt (each prompt in chunks of the 8192-token budget), the smallest TP
that fits. Prints one line per (model, workload): the SLOs and the ratios.

    python3 slos.py DERIVED_DIR     (derive.sh's output)
"""
import sys

from disagg.cluster.simulate import plan as planner
from disagg.cluster.simulate.profile import load_profile
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.engine.steps import prompt_pairs

P8 = "benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json"
P32K = "benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json"
SLOS_8B = {"chat": (266.43, 22.9428), "prefill-heavy": (166.0, 11.8), "long-prompt": (1559.32, 14.0574)}
ROWS = [("llama3-70b", "llama3-70b-tp2", ("chat", "prefill-heavy")), ("llama3.1-70b", "llama3.1-70b-tp2", ("long-prompt",)),
        ("qwen2.5-32b", "qwen2.5-32b-tp1", ("chat", "prefill-heavy")), ("qwen2.5-32b", "qwen2.5-32b-32k-tp1", ("long-prompt",))]


def isolated(model: StepTimeModel, prompt: int, budget: int) -> tuple[float, float]:
    """Seconds of one prompt alone in chunks of ``budget``, and of a batch-1 decode step after it."""
    ttft, done = 0.0, 0
    while done < prompt:
        n = min(budget, prompt - done)
        ttft, done = ttft + model.step_s(n, 0, 0, prompt_pairs(done, n)), done + n
    return ttft, model.step_s(0, 1, prompt, 0)


for name, stem, workloads in ROWS:
    derived = load_profile(f"{sys.argv[1]}/{stem}.json", warn_older=False)
    base = load_profile(P32K if "long-prompt" in workloads else P8, warn_older=False)
    for workload in workloads:
        prompt = round(planner.workload_shape(base, dataset_name=workload).input_len)
        budget = int(base["engine"]["max_num_batched_tokens"])
        (t0, d0), (t1, d1) = (isolated(StepTimeModel.from_dict(p["fit"]), prompt, budget) for p in (base, derived))
        ttft, tpot = SLOS_8B[workload]
        print(f"{name} {workload}: ttft:{ttft * t1 / t0:.0f} tpot:{tpot * d1 / d0:.1f}  (mean prompt {prompt}; "
              f"isolated prompt {t1 * 1e3:.1f} / {t0 * 1e3:.1f} ms = {t1 / t0:.2f}x, batch-1 decode step "
              f"{d1 * 1e3:.2f} / {d0 * 1e3:.2f} ms = {d1 / d0:.2f}x; {stem})")
