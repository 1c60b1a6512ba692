"""One simulated run of an xPyD fleet, fixed and adaptive, as `disagg plan` builds it, with
what the adaptive one did per path: requests, TTFT and TPOT misses, how many were placed with
no admissible path, the chosen prediction against what happened; the instances' busy fractions
and the TPOT percentiles. The diagnosis of README.md.

    python benchmarks/records/eightgpu-sim-2026-11-27/paths.py --prefill 5 --decode 3 --rate 104
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from goodput import PROFILE
from disagg.cluster.bench.metrics import slo_attainment
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.plan import Candidate, base_sections, config_of
from disagg.cluster.simulate.run import client_output, simulate_run, workload_spec
from disagg.config import Config


def run(args, adaptive: bool):
    profile = json.loads(PROFILE.read_text())
    slos = {"ttft": args.ttft, "tpot": args.tpot}
    sections = {"instances": {"prefill": args.prefill, "decode": args.decode}}
    if adaptive:
        sections["router"] = {"placement": "adaptive", "slo_ttft_ms": args.ttft, "slo_tpot_ms": args.tpot}
    config = Config.from_dict(config_of(base_sections(profile, slos), Candidate("x", sections)), origin="paths")
    fleet = SimFleet(config, profile, 364.0)
    chosen = {}
    decide = fleet.placer.decide

    def recording(req, prefills, decodes, live):
        decision = decide(req, prefills, decodes, live)
        chosen[req.request_id] = (decision, fleet.now)
        return decision

    fleet.placer.decide = recording
    spec = workload_spec(profile, fleet.max_model_len, dataset_name=args.dataset, num_prompts=args.num_prompts, seed=0)
    sim = simulate_run(config, profile, spec, request_rate=args.rate, seed=0, fleet=fleet)
    return sim, slo_attainment(sim.run.outputs, slos), chosen


def report(args, adaptive: bool) -> None:
    sim, attainment, chosen = run(args, adaptive)
    fleet, tpots = sim.fleet, []
    per_path = collections.defaultdict(collections.Counter)
    versus = collections.defaultdict(list)
    for rid, timeline in fleet.timelines.items():
        out = client_output(timeline)
        tpot = (out.latency - out.ttft) / max(out.output_len - 1, 1)
        tpots.append(tpot * 1e3)
        if rid not in chosen:
            continue
        decision, at = chosen[rid]
        c = decision.chosen
        row = per_path[c.path]
        row["n"] += 1
        row["ttft_miss"] += out.ttft * 1e3 > args.ttft
        row["tpot_miss"] += tpot * 1e3 > args.tpot
        row["none_admissible"] += not any(p.admissible for p in decision.predictions)
        versus[c.path].append((c.ttft_s, timeline.token_times[0] - at, c.tpot_s, tpot))
    name = "adaptive" if adaptive else "fixed"
    print(f"{name}: attainment {attainment * 100:.1f}%, placements {dict(fleet.placements)}, TPOT ms p50/p90/p99 "
          + "/".join(f"{v:.1f}" for v in np.percentile(tpots, [50, 90, 99])))
    print("  busy", {i.name: round(i.actor.busy_s / sim.run.duration_s, 2) for i in fleet.instances})
    for path, row in per_path.items():
        m = np.mean(versus[path], axis=0) * 1e3
        print(f"  {path}: {dict(row)}; TTFT after the decision predicted {m[0]:.1f} / measured {m[1]:.1f} ms; "
              f"TPOT predicted {m[2]:.2f} / measured {m[3]:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=5)
    ap.add_argument("--decode", type=int, default=3)
    ap.add_argument("--rate", type=float, required=True, help="req/s of the whole fleet")
    ap.add_argument("--num-prompts", type=int, default=3000, help="plan's run length at these rates")
    ap.add_argument("--dataset", default="chat")
    ap.add_argument("--ttft", type=float, default=200.0)
    ap.add_argument("--tpot", type=float, default=20.0)
    args = ap.parse_args()
    for adaptive in (False, True):
        report(args, adaptive)


if __name__ == "__main__":
    main()
