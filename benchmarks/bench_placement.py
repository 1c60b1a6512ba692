"""What one placement reads of the fleet's load, on the router's thread: summed over the live
requests at each placement (`Picker` and `FleetModel.views` without a ledger) against read from
the `Ledger` kept up to date as they move (`Placer(tracked=True)`, as the router and the
simulator run; docs/ARCHITECTURE.md §7, step 2). Per fleet shape (instances, live requests, half
of each role, every request decoding with its prompt on a random prefill instance): the adaptive
views of every instance plus the picker's decode order and prefill queues, ms per placement, the
ratio, what a move costs the ledger (`touch`, `advance`, us) and what the router's periodic
`Ledger.audit` costs (ms), as JSON.

    python3 benchmarks/bench_placement.py                           # ~10 s on one core
    python3 benchmarks/bench_placement.py --shapes 8:1000,64:6400 --out results/placement.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from disagg.cluster.launch.bootstrap import Instance
from disagg.cluster.outputs import RequestMetrics
from disagg.cluster.routing.ledger import Ledger
from disagg.cluster.routing.placement import FleetModel
from disagg.cluster.routing.requests import Picker, RoutedRequest
from disagg.sampling import SamplingParams


def shape(num_instances: int, num_live: int, repeats: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    half = num_instances // 2
    instances = ([Instance(f"prefill-{i}", "prefill", actor=None) for i in range(half)]
                 + [Instance(f"decode-{i}", "decode", actor=None) for i in range(num_instances - half)])
    prefills, decodes = instances[:half], instances[half:]
    ledger = Ledger(instances)
    live = []
    for i in range(num_live):
        req = RoutedRequest(str(i), [1] * rng.randint(100, 2000), SamplingParams(max_tokens=200), lambda *a: None,
                            RequestMetrics(arrival_time=0.0), stage="decoding", decode=rng.choice(decodes),
                            prefill=rng.choice(prefills), num_output=10, first_token_at=0.0)
        live.append(req)
        ledger.touch(req)
    ms = {}
    for way in ("summed", "ledger"):
        model, picker = FleetModel(8192, 16), Picker("least_loaded", 128)
        if way == "ledger":
            model.ledger = picker.ledger = ledger
        started = time.perf_counter()
        for _ in range(repeats):
            model.views(instances, live, 1.0, {})
            picker.order(decodes, live)
            picker.prompt_queues(prefills, live)
        ms[way] = (time.perf_counter() - started) / repeats * 1e3
    moved = live[:1000]
    started = time.perf_counter()
    for req in moved:
        req.num_output += 1
        ledger.advance(req, 1)
    advance_us = (time.perf_counter() - started) / len(moved) * 1e6
    started = time.perf_counter()
    for req in moved:
        ledger.touch(req)
    touch_us = (time.perf_counter() - started) / len(moved) * 1e6
    started = time.perf_counter()
    problem = ledger.audit(live, 1.0)  # the sums read are the live requests' (a benchmark of wrong numbers is none)
    audit_ms = (time.perf_counter() - started) * 1e3
    assert problem is None, problem
    return {"instances": num_instances, "live": num_live, "summed_ms": round(ms["summed"], 3),
            "ledger_ms": round(ms["ledger"], 3), "ratio": round(ms["summed"] / ms["ledger"], 1),
            "touch_us": round(touch_us, 1), "advance_us": round(advance_us, 2), "audit_ms": round(audit_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2:256,8:1000,16:2000,64:6400",
                        help="INSTANCES:LIVE pairs, comma-separated")
    parser.add_argument("--repeats", type=int, default=20, help="placements timed per shape and way")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    rows = []
    for pair in args.shapes.split(","):
        num_instances, num_live = (int(x) for x in pair.split(":"))
        if num_instances < 2 or num_live < 1:
            parser.error(f"--shapes: expected INSTANCES >= 2 and LIVE >= 1 in each pair, got {pair!r}")
        rows.append(shape(num_instances, num_live, args.repeats))
    text = json.dumps({"benchmark": "placement", "rows": rows}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
