"""Where requests' time went, hop by hop, from a `DISAGG_TRACE_DIR` directory (`disagg.trace`).

    DISAGG_TRACE_DIR=results/trace disagg bench configs/llama3-8b-1gpu-colocated.yaml --no-compare ...
    python3 benchmarks/trace_report.py results/trace [--json results/trace/hops.json]

Prints, per hop between consecutive events of a request (`disagg.trace.EVENTS`), how many
requests had it and the median, p90 and mean in milliseconds; per placement path when the
trace holds several. Then, per instance, from its step loop's "step" and "call" records: its
steps' durations, the fraction of the traced span they cover (busy), the idle gaps between them,
the prompt tokens of the steps that carried some, and how long each kind of call waited in the
loop before it ran (``--json`` keeps these under "instances", beside the paths). Then, per path
taken, the adaptive router's "decision" records: its predicted TTFT against the TTFT since the
decision, and its "tpot" records: the TPOT predicted for the path against the TPOT had ("decisions"). A `disagg simulate --trace-dir` directory (steps and decisions, no
request events) reads the same way, so a simulated and a served run compare. ``--by-run``:
the same per `disagg bench` run (a sweep's rates: request ids ``benchN.<label>.<pid>-...``), each run's steps
and calls those inside its requests' span. ``--window S``: the decisions over time too, per S
seconds since the first: how many, how many had no admissible path, the paths taken, and the
chosen path's predicted TTFT and TPOT against what its requests had (where a run went wrong, and
when: say, first seconds that put most decodes on one GPU). Events of several hosts compare wall
clocks: keep such runs on one host.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

from disagg import trace


def _spread(values: list[float], unit: str = "_ms") -> dict[str, float]:
    """{"n", "p50<unit>", "p90<unit>", "mean<unit>"} of ``values`` (zeros when empty)."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, f"p50{unit}": 0.0, f"p90{unit}": 0.0, f"mean{unit}": 0.0}
    return {"n": len(ordered), f"p50{unit}": statistics.median(ordered),
            f"p90{unit}": ordered[int(0.9 * (len(ordered) - 1))], f"mean{unit}": statistics.fmean(ordered)}


def summarize(requests: dict) -> dict[str, dict[str, float]]:
    """{hop: {"n", "p50_ms", "p90_ms", "mean_ms"}} in `EVENTS` order."""
    out = {hop: _spread([s * 1e3 for s in seconds]) for hop, seconds in trace.hops(requests).items()}
    order = {name: i for i, name in enumerate(trace.EVENTS)}
    return dict(sorted(out.items(), key=lambda item: order[item[0].split(" -> ")[0]]))


def summarize_instances(steps: list[dict], calls: list[dict], paths: dict | None = None) -> dict[str, dict]:
    """Per instance, from its "step" and "call" records (`disagg.trace`): {"steps": n,
    "step_ms": spread, "busy": steps' seconds / (last t_end - first t_start), "gap_ms": spread of
    the idle time between consecutive steps, "prompt_tokens": spread over the steps with prompt
    tokens, "call_wait_ms": {call name: spread of t_ran - t_queued}, "by_prompts": `_by_prompts`};
    spreads as `_spread`. ``paths``: each request's placement path (its "placed" event)."""
    names = sorted({record["instance"] for record in steps + calls})
    return {name: {**_step_summary([s for s in steps if s["instance"] == name]),
                   "call_wait_ms": _call_waits([c for c in calls if c["instance"] == name]),
                   "by_prompts": _by_prompts([s for s in steps if s["instance"] == name], paths or {})}
            for name in names}


def _by_prompts(steps: list[dict], paths: dict) -> dict[str, dict]:
    """The steps by the prompts they carry: "none", "remote" (one pushed prompt or more: a push
    may cost its step what the steps of the same tokens without one do not), or the path of their
    first prompt ("kept", "local", "colocated"; "unplaced" when its request has no "placed"
    event): {class: {"n", "step_ms": spread, "prompt_tokens": mean, "decodes": mean}}."""
    groups: dict[str, list[dict]] = {}
    for step in steps:
        prompts = [paths.get(r, "unplaced") for r in step.get("prompts", ())]
        kind = "none" if not prompts else "remote" if "remote" in prompts else prompts[0]
        groups.setdefault(kind, []).append(step)
    return {kind: {"n": len(group), "step_ms": _spread([(s["t_end"] - s["t_start"]) * 1e3 for s in group]),
                   "prompt_tokens": statistics.fmean(s["num_prefill_tokens"] for s in group),
                   "decodes": statistics.fmean(s["num_decode_seqs"] for s in group)}
            for kind, group in sorted(groups.items())}


def _step_summary(steps: list[dict]) -> dict:
    steps = sorted(steps, key=lambda step: step["t_start"])
    span_s = max(step["t_end"] for step in steps) - steps[0]["t_start"] if steps else 0.0
    busy_s = sum(step["t_end"] - step["t_start"] for step in steps)
    return {"steps": len(steps), "step_ms": _spread([(step["t_end"] - step["t_start"]) * 1e3 for step in steps]),
            "busy": busy_s / span_s if span_s > 0 else 0.0,
            "gap_ms": _spread([(b["t_start"] - a["t_end"]) * 1e3 for a, b in zip(steps, steps[1:])]),
            "prompt_tokens": _spread([s["num_prefill_tokens"] for s in steps if s["num_prefill_tokens"]], unit="")}


def _call_waits(calls: list[dict]) -> dict[str, dict[str, float]]:
    waits: dict[str, list[float]] = {}
    for call in calls:
        waits.setdefault(call["name"], []).append((call["t_ran"] - call["t_queued"]) * 1e3)
    return {name: _spread(ms) for name, ms in sorted(waits.items())}


def _print_instances(instances: dict[str, dict]) -> None:
    for instance, row in instances.items():
        print(f"{instance}: {row['steps']} steps")
        if row["steps"]:
            step, gap, tokens = row["step_ms"], row["gap_ms"], row["prompt_tokens"]
            print(f"  {'step':<28} p50 {step['p50_ms']:8.2f} ms  p90 {step['p90_ms']:8.2f} ms  "
                  f"mean {step['mean_ms']:8.2f} ms  busy {row['busy']:6.1%}")
            print(f"  {'gap between steps':<28} p50 {gap['p50_ms']:8.2f} ms  p90 {gap['p90_ms']:8.2f} ms")
            print(f"  {'prompt tokens per step':<28} n {tokens['n']:>5}  p50 {tokens['p50']:8.0f}  "
                  f"p90 {tokens['p90']:8.0f}  mean {tokens['mean']:8.1f}   (steps with prompt tokens)")
        for kind, group in row["by_prompts"].items():
            step = group["step_ms"]
            print(f"  {'steps, prompts ' + kind:<28} n {group['n']:>5}  p50 {step['p50_ms']:8.2f} ms  "
                  f"mean {step['mean_ms']:8.2f} ms  prompt tokens {group['prompt_tokens']:7.1f}  "
                  f"decodes {group['decodes']:6.1f}")
        for name, wait in row["call_wait_ms"].items():
            print(f"  {'call ' + name + ' waited':<28} n {wait['n']:>5}  p50 {wait['p50_ms']:8.2f} ms  "
                  f"p90 {wait['p90_ms']:8.2f} ms")


def summarize_decisions(decisions: list[dict], tpots: list[dict] = ()) -> dict[str, dict]:
    """Per path taken, from the "decision" records (one per adaptively placed request, at its
    first token): {"n", "predicted_ms": spread of the chosen path's predicted TTFT, "actual_ms":
    spread of the TTFT since the decision, "ratio": spread of actual / predicted}; with its
    requests' "tpot" records (at their end), "tpot": the same three for the TPOT predicted for
    the path taken and the TPOT had (n: the requests that ended with 2 tokens or more)."""
    out: dict[str, dict] = {}
    for path in sorted({d["path"] for d in decisions} | {t["path"] for t in tpots}):
        rows = [d for d in decisions if d["path"] == path]
        predicted = [next(p["ttft_ms"] for p in d["predictions"] if p["path"] == d["chosen"]) for d in rows]
        actual = [d["ttft_ms"] for d in rows]
        out[path] = {"n": len(rows), **_judged(predicted, actual)}
        ended = [t for t in tpots if t["path"] == path]
        if ended:
            out[path]["tpot"] = {"n": len(ended), **_judged([t["predicted_tpot_ms"] for t in ended],
                                                           [t["tpot_ms"] for t in ended])}
    return out


def summarize_windows(decisions: list[dict], tpots: list[dict], seconds: float) -> list[dict]:
    """The "decision" records per ``seconds`` of their time since the first: [{"start_s", "n",
    "no_admissible", "paths": {path: n}, "ttft_ms": {"predicted", "actual"} p50s of the chosen
    path's TTFT and the TTFT since the decision, "tpot_ms": the same of the TPOT predicted for the
    path taken and had (requests with a "tpot" record)}], empty windows left out."""
    if not decisions:
        return []
    t0 = min(d["t"] for d in decisions)
    had = {t["request"]: t for t in tpots}
    windows: dict[int, list[dict]] = {}
    for d in decisions:
        windows.setdefault(int((d["t"] - t0) // seconds), []).append(d)
    out = []
    for k, rows in sorted(windows.items()):
        chosen = [next(p for p in d["predictions"] if p["path"] == d["chosen"]) for d in rows]
        ended = [had[d["request"]] for d in rows if d["request"] in had]
        paths = collections.Counter(d["path"] for d in rows)
        out.append({"start_s": k * seconds, "n": len(rows),
                    "no_admissible": sum(not any(p["admissible"] for p in d["predictions"]) for d in rows),
                    "paths": dict(sorted(paths.items())),
                    "ttft_ms": {"predicted": _median([c["ttft_ms"] for c in chosen]),
                                "actual": _median([d["ttft_ms"] for d in rows])},
                    "tpot_ms": {"predicted": _median([t["predicted_tpot_ms"] for t in ended]),
                                "actual": _median([t["tpot_ms"] for t in ended])}})
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _print_windows(windows: list[dict], seconds: float) -> None:
    def ms(value):
        return "-" if value is None else f"{value:.1f}"
    print(f"decisions per {seconds:g} s: start s, n, none admissible, paths taken, "
          "TTFT p50 predicted / actual ms, TPOT p50 predicted / had ms")
    for w in windows:
        paths = " ".join(f"{path} {n}" for path, n in w["paths"].items())
        print(f"  {w['start_s']:7.1f}  n {w['n']:>4}  none {w['no_admissible']:>4}  {paths:<32} "
              f"TTFT {ms(w['ttft_ms']['predicted'])} / {ms(w['ttft_ms']['actual'])}  "
              f"TPOT {ms(w['tpot_ms']['predicted'])} / {ms(w['tpot_ms']['actual'])}")


def _judged(predicted: list[float], actual: list[float]) -> dict:
    return {"predicted_ms": _spread(predicted), "actual_ms": _spread(actual),
            "ratio": _spread([a / p for a, p in zip(actual, predicted) if p > 0], unit="")}


def _print_decisions(decisions: dict[str, dict]) -> None:
    for path, row in decisions.items():
        pred, act, ratio = row["predicted_ms"], row["actual_ms"], row["ratio"]
        print(f"decisions {path}: {row['n']} requests, TTFT since the decision predicted p50 {pred['p50_ms']:.1f} ms, "
              f"actual p50 {act['p50_ms']:.1f} ms; actual / predicted p50 {ratio['p50']:.2f} p90 {ratio['p90']:.2f}")
        if "tpot" in row:
            tp = row["tpot"]
            print(f"decisions {path}: {tp['n']} ended, TPOT predicted p50 {tp['predicted_ms']['p50_ms']:.2f} ms, "
                  f"had p50 {tp['actual_ms']['p50_ms']:.2f} ms; had / predicted p50 {tp['ratio']['p50']:.2f} "
                  f"p90 {tp['ratio']['p90']:.2f}")


def report(requests: dict, steps: list[dict], calls: list[dict], decisions: list[dict] = (),
           tpots: list[dict] = (), window_s: float | None = None) -> dict:
    """{path: hops (`summarize`), ..., "instances": `summarize_instances`, "decisions":
    `summarize_decisions`, and with ``window_s`` "windows": `summarize_windows`}, printed as it
    goes."""
    by_path: dict[str, dict] = {}
    for request, events in requests.items():
        by_path.setdefault(events.get("placed", {}).get("path", "unplaced"), {})[request] = events
    out = {path: summarize(group) for path, group in sorted(by_path.items())}
    for path, hops in out.items():
        print(f"{path}: {len(by_path[path])} requests")
        for hop, row in hops.items():
            print(f"  {hop:<28} n {row['n']:>5}  p50 {row['p50_ms']:8.2f} ms  p90 {row['p90_ms']:8.2f} ms  "
                  f"mean {row['mean_ms']:8.2f} ms")
    paths = {request: events["placed"].get("path") for request, events in requests.items() if "placed" in events}
    instances = summarize_instances(steps, calls, paths)
    _print_instances(instances)
    judged = summarize_decisions(list(decisions), list(tpots))
    _print_decisions(judged)
    out = {**out, "instances": instances, "decisions": judged}
    if window_s and decisions:
        out["windows"] = summarize_windows(list(decisions), list(tpots), window_s)
        _print_windows(out["windows"], window_s)
    return out


def by_run(requests: dict) -> dict[str, dict]:
    """The requests of each `disagg bench` run, by their ids' ``benchN.<label>.<pid>`` prefix
    (others: "other")."""
    runs: dict[str, dict] = {}
    for request, events in requests.items():
        prefix = request.split("-", 1)[0]
        runs.setdefault(prefix if prefix.startswith("bench") and "-" in request else "other", {})[request] = events
    return dict(sorted(runs.items(), key=lambda item: (len(item[0]), item[0])))


def _within(records: list[dict], requests: dict, start_key: str) -> list[dict]:
    """The records that start inside the span of ``requests``' events."""
    times = [record["t"] for events in requests.values() for record in events.values()]
    lo, hi = min(times), max(times)
    return [r for r in records if lo <= r[start_key] <= hi]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the DISAGG_TRACE_DIR of the run")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--by-run", action="store_true", help="one report per disagg bench run (rate)")
    parser.add_argument("--window", type=float, metavar="S",
                        help="the adaptive router's decisions per S seconds too (paths, none admissible)")
    args = parser.parse_args()
    if args.window is not None and not args.window > 0:
        parser.error(f"--window: expected seconds > 0, got {args.window:g}")
    requests = trace.read(args.directory)
    steps, calls = trace.read_records(args.directory, "step"), trace.read_records(args.directory, "call")
    decisions, tpots = trace.read_records(args.directory, "decision"), trace.read_records(args.directory, "tpot")
    if args.by_run:
        out = {}
        for run, group in by_run(requests).items():
            print(f"== {run}: {len(group)} requests")
            out[run] = report(group, _within(steps, group, "t_start"), _within(calls, group, "t_queued"),
                              [d for d in decisions if d["request"] in group], [t for t in tpots if t["request"] in group],
                              args.window)
    else:
        out = report(requests, steps, calls, decisions, tpots, args.window)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
