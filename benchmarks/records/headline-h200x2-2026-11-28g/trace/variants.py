import json, sys
import numpy as np
from disagg.config import Config
from disagg.cluster import placement
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.run import simulate_run, workload_spec
from disagg.cluster.bench.metrics import slo_attainment
P = "benchmarks/records/headline-h200x2-2026-11-28c/profile-h200.json"
profile = json.load(open(P))
ds, T, Tp = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rates = [float(r) for r in sys.argv[4].split(",")]
window = int(sys.argv[5]) if len(sys.argv) > 5 else None
if window:
    placement.STALL_WINDOW_STEPS = window
    placement.StallMeter.__init__.__defaults__ = (window,)
cfg = Config.from_yaml("configs/llama3-8b-1p1d.yaml").override({"router.placement": "adaptive", "router.slo_ttft_ms": T,
        "router.slo_tpot_ms": Tp, "router.step_profile": P})
out = []
for r in rates:
    fleet = SimFleet(cfg, profile, 364.0, hop_ms=6, step_gap_ms=0.17, reserve_ms=8)
    spec = workload_spec(profile, fleet.max_model_len, dataset_name=ds, num_prompts=min(1000, max(16, int(r * 20))), seed=0)
    sim = simulate_run(cfg, profile, spec, request_rate=r, seed=0, fleet=fleet)
    out.append(f"{r:g}: {100 * slo_attainment(sim.run.outputs, {'ttft': T, 'tpot': Tp}):.1f}")
print(ds, "window", window, " ".join(out))
