"""The 64-GPU chat search's candidates that the earlier runs did not judge, and its adaptive
fleets again at the tree the fixes of 2026-11-27 left (the router's prefill-queue bound: kept
requests' decoding tokens no longer hold remote prompts back; it changes adaptive fleets only):
`disagg plan`'s search and judging, the same settings as `logs/chat-r-64gpu-364*.log` (chunk
2048, SLOs 148 : 34 ms, one draw per rate, 364 GB/s), a chosen subset of candidates.

    python3 benchmarks/records/plan-64gpu-25gbps-2026-11-27/rest.py [JOBS]   # logs/chat-r-64gpu-364-rest.log
    python3 benchmarks/records/plan-64gpu-25gbps-2026-11-27/rest.py 2 56P8D 48P16D-adaptive ...
                                    # only those candidates: logs/chat-r-64gpu-364-rest-only.log
"""

import json
import sys
from pathlib import Path

from disagg.cluster.simulate import plan as planner

HERE = Path(__file__).parent
PROFILE = json.loads(Path("benchmarks/records/simulator-2026-11-27b/profile-h100-v2.json").read_text())
JUDGED_FIXED = {"8P56D", "11P53D", "16P48D", "21P43D", "32P32D", "43P21D"}  # by the earlier runs; unchanged since


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    only = set(sys.argv[2:])
    search = [c for c in planner.candidates(64, chunk_sizes=(2048,), adaptive_chunk_sizes=(2048,))
              if not c.label.startswith("colocated") and c.label not in JUDGED_FIXED
              and (not only or c.label in only)]
    log = (HERE / "logs" / f"chat-r-64gpu-364-rest{'-only' if only else ''}.log").open("w")

    def judged(c):
        print(f"{c.label}: {c.goodput_per_gpu:.3f} req/s per GPU", file=log, flush=True)

    planner.plan(PROFILE, dataset_name="chat", slos_ms={"ttft": 148.0, "tpot": 34.0}, num_gpus=64,
                 chunk_sizes=(2048,), search=search, jobs=jobs, on_judged=judged)


if __name__ == "__main__":
    main()
