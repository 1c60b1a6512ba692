"""`disagg plan`'s screen alone (no simulation): every candidate's analytic rate per GPU from the
profiles' step-time models (`cluster/simulate/screen.py`), as `disagg plan` prints it before it
simulates. For fleets too large to simulate here.

    python3 screen_only.py GPUS WORKLOAD TTFT_MS TPOT_MS PROFILE...
"""
import sys
import time

from disagg.cluster.simulate import plan as planner
from disagg.cluster.simulate.profile import load_profile

gpus, workload, ttft, tpot, paths = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5:]
started = time.perf_counter()
profiles = planner.profiles_by_tp([load_profile(p, warn_older=False) for p in paths])
chunks = [8192] if gpus > 8 else [512, 2048, 8192]
search = planner.candidates(gpus, chunks, adaptive_chunk_sizes=[8192], tensor_parallel=list(profiles))
slos = {"ttft": ttft, "tpot": tpot}
planner.screen_search(list(profiles.values()), search, dataset_name=workload, slos_ms=slos, link_gbps=364.0,
                      seed=0, margin=0.7, max_simulated=6)
for line in planner.screen_lines(search, 0.7, 6):
    print(line)
print(f"screened {len(search)} candidates in {time.perf_counter() - started:.1f} s")
