"""Record every placement decision of a set of simulated runs, for a before/after diff.

    PYTHONHASHSEED=0 python /tmp/placement_harness.py ROOT OUT_DIR [SCENARIO ...]

ROOT is a source tree (its disagg/, cluster/, kernels/, transfer/ are imported as the
`disagg` package); OUT_DIR gets one directory per scenario with
  plans.jsonl      every `Placer.plan` / `Placer.hand` call and its answer, and every
                   adaptive `Decision` (each prediction's floats as repr: exact)
  trace.jsonl      the simulator's trace records (steps, decisions, tpot; `--trace-dir`'s)
  summary.json     placements per path, affinity hits, per-request TTFT/TPOT/output length
"""

import copy
import importlib.util
import json
import math
import os
import sys

ROOT, OUT = sys.argv[1], sys.argv[2]
ONLY = set(sys.argv[3:])
MAP = {"disagg": f"{ROOT}/disagg", "disagg.cluster": f"{ROOT}/cluster", "disagg.kernels": f"{ROOT}/kernels",
       "disagg.transfer": f"{ROOT}/transfer"}


class _Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname in MAP:
            return importlib.util.spec_from_file_location(fullname, MAP[fullname] + "/__init__.py",
                                                          submodule_search_locations=[MAP[fullname]])
        return None


sys.meta_path.insert(0, _Finder)

from disagg.cluster.simulate.fleet import SimFleet  # noqa: E402
from disagg.cluster.simulate.run import simulate_run, workload_spec  # noqa: E402
from disagg.config import Config  # noqa: E402

import disagg.cluster.routing.placement as placement_pkg  # noqa: E402

assert placement_pkg.__file__.startswith(ROOT), placement_pkg.__file__

TINY = {
    "kind": "disagg-profile", "version": 1, "date": "20261127-000000", "model": "dummy:tiny", "commit": None,
    "device": {"host": "test", "gpus": [], "torch_device": "cpu"},
    "engine": {"num_pages": 256, "page_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "max_model_len": 4096, "kv_bytes_per_token": 512, "vocab_size": 32000, "eos_token_ids": [2]},
    "fit": {"coef_s": [1.5e-3, 2e-5, 1.8e-4, 5e-8], "error": 0.1}, "samples": [],
}
H200 = json.load(open("/tmp/placement_profiles/profile-h200.json"))
SLO_TINY = {"router.slo_ttft_ms": 300.0, "router.slo_tpot_ms": 30.0}
SLO_H200 = {"router.slo_ttft_ms": 500.0, "router.slo_tpot_ms": 15.0}
ADAPTIVE = {"router.placement": "adaptive"}
ROOMY = {"cache.num_pages": 2048}

# name: (config, overrides, profile, dataset, rate, num_prompts, extra workload/run args)
SCENARIOS = {
    "colocated-chat": ("tiny-colocated.yaml", {}, TINY, "chat", 40.0, 80, {}),
    "disagg-1p1d-chat": ("tiny-1p1d.yaml", {}, TINY, "chat", 40.0, 120, {}),
    "disagg-3p1d-tight": ("tiny-1p1d.yaml", {"instances.prefill": 3, "cache.num_pages": 40,
                                             "model.max_model_len": 512}, TINY, "chat", 40.0,
                          120, {}),
    "local-1p1d-chat": ("tiny-1p1d.yaml", {"router.placement": "local"}, TINY, "chat", 40.0, 120, {}),
    "local-2p2d-overload": ("tiny-2p2d.yaml", {"router.placement": "local"}, TINY, "chat", 200.0, 120, {}),
    "adaptive-noslo-chat": ("tiny-2p2d.yaml", ADAPTIVE, TINY, "chat", 40.0, 150, {}),
    "adaptive-noslo-overload": ("tiny-2p2d.yaml", ADAPTIVE, TINY, "chat", 400.0, 150, {}),
    "adaptive-slo-balanced": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY}, TINY, "chat", 60.0, 150, {}),
    "adaptive-slo-fastest": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY, "router.adaptive_prefer": "fastest"}, TINY,
                             "chat", 60.0, 150, {}),
    "adaptive-slo-remote": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY, "router.adaptive_prefer": "remote"}, TINY,
                            "chat", 60.0, 150, {}),
    "adaptive-slo-overload": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY}, TINY, "chat", 400.0, 150, {}),
    "adaptive-slo-overload-nopush": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY, "router.adaptive_overload": "no_push"},
                                     TINY, "chat", 400.0, 150, {}),
    "adaptive-tpot-only": ("tiny-2p2d.yaml", {**ADAPTIVE, "router.slo_tpot_ms": 20.0}, TINY, "chat", 100.0, 150, {}),
    "adaptive-ttft-only-remote": ("tiny-2p2d.yaml", {**ADAPTIVE, "router.slo_ttft_ms": 200.0,
                                                     "router.adaptive_prefer": "remote"}, TINY, "chat", 100.0, 150, {}),
    "adaptive-tight-pages": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY, "cache.num_pages": 40,
                                                                   "model.max_model_len": 512}, TINY, "chat", 100.0,
                             150, {}),
    "adaptive-prefix": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY, **ROOMY}, TINY, "shared-prefix", 30.0, 96, {}),
    "adaptive-prefix-overload": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY, **ROOMY}, TINY, "shared-prefix", 300.0,
                                 96, {}),
    "disagg-prefix": ("tiny-1p1d.yaml", ROOMY, TINY, "shared-prefix", 30.0, 64, {}),
    "h200-adaptive-decode-heavy": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200}, H200, "decode-heavy", 60.0, 400,
                                   {}),
    "h200-adaptive-decode-heavy-overload": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200}, H200, "decode-heavy",
                                            120.0, 400, {}),
    "h200-adaptive-long-prompt": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200, "instances.prefill": 3,
                                                          "instances.decode": 1}, H200, "long-prompt", 3.0, 80, {}),
    "h200-adaptive-long-prompt-nopush": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200, "instances.prefill": 1,
                                                                 "instances.decode": 3,
                                                                 "router.adaptive_overload": "no_push"},
                                         H200, "long-prompt", 4.0, 80, {}),
    "h200-adaptive-chat-fastest-noslo": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, "router.adaptive_prefer": "fastest"},
                                         H200, "chat", 80.0, 400, {}),
    "h200-adaptive-decode-heavy-remote": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200,
                                                                  "router.adaptive_prefer": "remote"},
                                          H200, "decode-heavy", 60.0, 400, {}),
    "h200-adaptive-chat-fastest-slo": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200,
                                                               "router.adaptive_prefer": "fastest"},
                                       H200, "chat", 80.0, 400, {}),
    "h200-adaptive-decode-heavy-nopush-overload": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200,
                                                                           "router.adaptive_overload": "no_push"},
                                                   H200, "decode-heavy", 120.0, 400, {}),
    "h200-adaptive-prefix": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200}, H200, "shared-prefix", 40.0, 200, {}),
    "h200-disagg-chat": ("llama3-8b-2p2d.yaml", {}, H200, "chat", 80.0, 300, {}),
    "h200-local-chat": ("llama3-8b-2p2d.yaml", {"router.placement": "local"}, H200, "chat", 40.0, 300, {}),
    "h200-adaptive-long-prompt-7p1d": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200, "instances.prefill": 7,
                                                               "instances.decode": 1}, H200, "long-prompt", 6.0, 120,
                                       {}),
    "h200-adaptive-decode-heavy-tight": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, "router.slo_ttft_ms": 60.0,
                                                                 "router.slo_tpot_ms": 12.0},
                                         H200, "decode-heavy", 120.0, 400, {}),
    "h200-adaptive-decode-heavy-tight-nopush": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, "router.slo_ttft_ms": 60.0,
                                                                        "router.slo_tpot_ms": 12.0,
                                                                        "router.adaptive_overload": "no_push"},
                                                H200, "decode-heavy", 120.0, 400, {}),
    "adaptive-slo-balanced-nopush": ("tiny-2p2d.yaml", {**ADAPTIVE, **SLO_TINY, "router.adaptive_overload": "no_push"},
                                     TINY, "chat", 60.0, 150, {}),
    "adaptive-3p1d-tpot": ("tiny-1p1d.yaml", {**ADAPTIVE, "instances.prefill": 3, "router.slo_tpot_ms": 8.0}, TINY,
                           "chat", 100.0, 150, {}),
    "h200-adaptive-long-prompt-7p1d-fast": ("llama3-8b-2p2d.yaml", {**ADAPTIVE, **SLO_H200, "instances.prefill": 7,
                                                                    "instances.decode": 1}, H200, "long-prompt", 12.0,
                                            120, {}),
}


def exact(x):
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (list, tuple)):
        return [exact(v) for v in x]
    if isinstance(x, dict):
        return {k: exact(v) for k, v in x.items()}
    return x


def prediction(p) -> dict:
    return {f: exact(getattr(p, f)) for f in ("path", "prefill", "decode", "ttft_s", "tpot_s", "margin",
                                              "admissible", "why", "seat_tpot_s", "reserve_step_s",
                                              "prefill_tpot_s")}


def plan_of(plan) -> dict:
    kind = type(plan).__name__
    if kind == "Wait":
        return {"plan": kind, "reason": plan.reason}
    if kind == "Fail":
        return {"plan": kind, "role": plan.role}
    if kind == "Alone":
        return {"plan": kind, "instance": plan.instance.name, "path": plan.path}
    return {"plan": kind, "decodes": [d.name for d in plan.decodes]}


def run(name: str) -> None:
    path, overrides, profile, dataset, rate, num_prompts, extra = SCENARIOS[name]
    config = Config.from_yaml(f"{ROOT}/configs/{path}")
    config = config.override(overrides) if overrides else config
    fleet = SimFleet(config, copy.deepcopy(profile))
    fleet.keep_records()
    placer = fleet.placer
    log = []
    plan, hand, decide = placer.plan, placer.hand, placer.decide

    def clock():
        return repr(placer.clock())

    def logged_plan(req, live, decide_hook=None):
        out = plan(req, live, decide_hook)
        log.append({"t": clock(), "call": "plan", "request": req.request_id, **plan_of(out)})
        return out

    def logged_hand(req, decode, live):
        out = hand(req, decode, live)
        log.append({"t": clock(), "call": "hand", "request": req.request_id, "decode": decode.name,
                    "prefill": None if out is None else out.name, "cached": req.cached_tokens})
        return out

    def logged_decide(req, prefills, decodes, live):
        out = decide(req, prefills, decodes, live)
        log.append({"t": clock(), "call": "decide", "request": req.request_id, "prompt_len": req.prompt_len,
                    "prefills": [p.name for p in prefills], "decodes": [d.name for d in decodes],
                    "chosen": None if out.chosen is None else prediction(out.chosen),
                    "predictions": [prediction(p) for p in out.predictions]})
        return out

    placer.plan, placer.hand, placer.decide = logged_plan, logged_hand, logged_decide
    spec = workload_spec(profile, fleet.max_model_len, dataset_name=dataset, num_prompts=num_prompts, seed=0)
    sim = simulate_run(config, profile, spec, request_rate=rate, seed=0, fleet=fleet, **extra)
    out = os.path.join(OUT, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plans.jsonl"), "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in log)
    with open(os.path.join(out, "trace.jsonl"), "w") as f:
        f.writelines(json.dumps(exact(r)) + "\n" for r in fleet.step_records)
    outputs = sim.run.outputs
    summary = {"placements": dict(fleet.placements), "affinity_hits": placer.affinity_hits,
               "decisions": sum(1 for e in log if e["call"] == "decide"),
               "paths": {}, "requests": [exact([o.success, o.output_len, o.ttft, o.latency]) for o in outputs],
               "snapshot": exact(placer.fleet_model.snapshot())}
    for e in log:
        if e["call"] == "plan":
            key = e["plan"] + ":" + str(e.get("path") or e.get("reason") or e.get("role") or "")
            summary["paths"][key] = summary["paths"].get(key, 0) + 1
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    print(f"{name}: {len(outputs)} requests, placements {dict(fleet.placements)}, plans {summary['paths']}",
          flush=True)


for name in SCENARIOS:
    if not ONLY or name in ONLY:
        run(name)
