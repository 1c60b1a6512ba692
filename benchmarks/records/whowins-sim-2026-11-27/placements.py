"""Where 1P1D-adaptive put its requests at its goodput rate, per row of summary.json: one
simulated run each (plan's workload, seed 0 and run length), the fleet's `placements` (what
`cluster.router_stats()["placements"]` counts on a live fleet), SLO attainment and busy
fractions. Writes placements.json next to it. Run from the repository root."""

import json
import logging
import sys
from pathlib import Path

from disagg.cluster.bench.metrics import slo_attainment
from disagg.cluster.simulate import plan as planner
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.run import simulate_run, workload_spec
from disagg.config import Config

HERE = Path(__file__).parent
PROFILES = {"": "benchmarks/records/simulator-2026-11-27b/profile-h100-v2.json",
            "-ctx33792": str(HERE / "profile-h100-v2-ctx33792.json")}


def run(profile: dict, workload: str, slos: dict, rate: float) -> dict:
    cand = next(c for c in planner.candidates(2) if c.label == "1P1D-adaptive")
    cand.sections["router"].update(slo_ttft_ms=slos["ttft"], slo_tpot_ms=slos["tpot"])
    config = Config.from_dict(planner.config_of(planner.base_sections(profile, slos), cand), origin=cand.label)
    fleet = SimFleet(config, profile)
    spec = workload_spec(profile, fleet.max_model_len, dataset_name=workload,
                         num_prompts=planner.RunLength().prompts_at(rate), seed=0)
    sim = simulate_run(config, profile, spec, request_rate=rate, seed=0, fleet=fleet)
    return {"rate_rps": rate, "num_requests": len(sim.run.outputs), "placements": dict(fleet.placements),
            "attainment": round(slo_attainment(sim.run.outputs, slos), 3),
            "busy": {i.name: round(i.actor.busy_s / sim.run.duration_s, 2) for i in fleet.instances}}


def main() -> None:
    logging.disable(logging.WARNING)
    summary = json.loads((HERE / "summary.json").read_text())
    out = []
    for row in summary["rows"]:
        after = row.get("after")
        if not after or after["1P1D-adaptive"] <= 0:
            continue
        profile = json.loads(Path(PROFILES[row.get("profile_suffix", "")]).read_text())
        slos = {"ttft": row["ttft_ms"], "tpot": row["tpot_ms"]}
        got = run(profile, row["workload"], slos, 2 * after["1P1D-adaptive"])
        out.append({"workload": row["workload"], "slo": row["slo"], "profile_suffix": row.get("profile_suffix", ""), **got})
        print(json.dumps(out[-1]), file=sys.stderr)
    (HERE / "placements.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
