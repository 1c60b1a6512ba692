"""cProfile of one simulated run of a 64-GPU candidate: `python profile_run.py LABEL RATE PROMPTS` (profiles in /tmp/h2)."""
import cProfile, pstats, json, sys, time
from disagg.cluster.simulate import plan as planner
from disagg.config import Config
profiles = planner.profiles_by_tp([json.load(open("/tmp/h2/tp1.json")), json.load(open("/tmp/h2/tp2.json"))])
slos = {"ttft": 2000, "tpot": 200}
search = planner.only(planner.candidates(64, (512, 2048, 8192), tensor_parallel=[1, 2]), [sys.argv[1]])
cand = search[0]
base = planner.base_of(cand, profiles, slos)
router = cand.sections.get("router") or {}
if router.get("placement") == "adaptive":
    router.setdefault("slo_ttft_ms", 2000); router.setdefault("slo_tpot_ms", 200)
config = Config.from_dict(planner.config_of(base, cand))
roles = planner.role_profiles(cand, profiles)
run = planner.RunLength(30.0, 100, int(sys.argv[3]))
t = time.perf_counter()
pr = cProfile.Profile(); pr.enable()
a = planner.rate_attainment(config, roles, float(sys.argv[2]), dataset_name="random", slos_ms=slos, run_length=run, input_len=64, output_len=16)
pr.disable()
print("attainment", a, "wall", time.perf_counter() - t)
pstats.Stats(pr).sort_stats("cumulative").print_stats(35)
