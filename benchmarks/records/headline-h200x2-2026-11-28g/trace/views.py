import json, numpy as np
from disagg.config import Config
from disagg.cluster.simulate.fleet import SimFleet
from disagg.cluster.simulate.run import simulate_run, workload_spec
from disagg.cluster import placement
P = "benchmarks/records/headline-h200x2-2026-11-28c/profile-h200.json"
profile = json.load(open(P))
cfg = Config.from_yaml("configs/llama3-8b-1p1d.yaml").override({"router.placement": "adaptive", "router.slo_ttft_ms": 401.834,
        "router.slo_tpot_ms": 23.751, "router.step_profile": P})
fleet = SimFleet(cfg, profile, 364.0, hop_ms=6, step_gap_ms=0.17, reserve_ms=8)
seen = []
orig = placement.decide
def decide(prompt_len, prefills, decodes, targets=placement.Targets(), cached=None):
    out = orig(prompt_len, prefills, decodes, targets, cached)
    seen.append((fleet.now, [(v.name, v.num_decoding, v.queued_prompt_tokens, round(v.stall_factor, 2), v.output_tokens, v.seated)
                             for v in prefills + decodes],
                 [(p.path, round(p.ttft_s*1e3), round(p.tpot_s*1e3, 1), p.admissible) for p in out.predictions], out.path if out.chosen else None))
    return out
import disagg.cluster.placer as placer_mod
placer_mod.decide = decide
spec = workload_spec(profile, fleet.max_model_len, dataset_name="shared-prefix", num_prompts=960, seed=0)
sim = simulate_run(cfg, profile, spec, request_rate=48.0, seed=0, fleet=fleet)
last = -1
for t, views, preds, path in seen:
    if int(t * 4) != last:
        last = int(t * 4)
        print(f"{t:5.2f}", views, preds, path)
    if t > 8: break
