"""Spike: prefill and decode on separate SM partitions of one GPU, against mixed steps.

    python3 benchmarks/spike_phase_split.py --out results/spike.json        # dummy:llama3.1-8b bf16
    python3 benchmarks/spike_phase_split.py --device cpu --model dummy:tiny --num-decodes 4 \
        --context 32 --prompt 48 --chunks 16,48 [--split-on-cpu --launch interleaved]   # CPU

One KV cache, ``--num-decodes`` requests decoding at context ``--context`` (CUDA graphs), then one
``--prompt``-token prompt arrives. Over the window until the prompt's KV is complete (its first
token is out), every row reports decode tokens/s, the longest gap between two tokens of a running
request, prefill tokens/s and the window length:

- mixed_chunk{C}: the real `ColocatedEngine` (scheduler, async scheduling, graphs) with
  ``max_num_batched_tokens`` = C: every step is the decodes plus a chunk of the prompt (the
  decodes' 4k contexts are computed once, with a larger budget, before the rows).
- split_none_all_sms_{launch}: the split loops below on two plain streams (no partition).
- split_{method}_N{N}_{launch}: the same engine's cache and decode runner; decode steps (graph replays, each
  launched before the previous one's tokens are read, as async scheduling) run on an N-SM green
  context and the prompt's eager forwards (``--split-chunk`` tokens each) on a green context over
  the remaining SMs, concurrently. Work goes to the stream of each context (``ctx.Stream()`` under
  ``torch``, ``cuGreenCtxStreamCreate`` under ``driver``); no context is made current.
  ``--launch`` (each row once per mode): ``threads``, one host thread per phase (GIL switch
  interval lowered to 0.1 ms); ``interleaved``, one thread launches a chunk, then decode steps
  until the chunk's event is done.
  ``torch`` makes two independent green contexts (N and total-N SMs: they may overlap, see the
  check); ``driver`` (libcuda via ctypes) splits the SMs once into N and the rest (disjoint).
  Slots the split rows take are given back after each window (``split_slots_returned``).
- check_{method}_N{N}: does a partition hold? Distinct SM ids (%smid) a Triton kernel ran on, eager
  and replayed from a CUDA graph, on each side and their overlap; times of a cuBLAS matmul, a
  compute-bound Triton kernel and our decode-step graph on the N-SM side against the whole GPU
  (they should grow as N shrinks).

Verdict: go if some split row gives >= 1.5x the decode tok/s of the best mixed row (by
decode tok/s), a longest gap <= half of its gap and >= 0.7x its prefill tok/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import GiB, PAGE_SIZE, kv_bytes_per_token, sync  # noqa: E402
from spike_partitions import PartitionUnavailable, make_partition, partition_check  # noqa: E402

from disagg.engine import ColocatedEngine  # noqa: E402
from disagg.engine.runner import ModelRunner  # noqa: E402
from disagg.model import load_model  # noqa: E402
from disagg.sampling import SamplingParams  # noqa: E402

FILL_TOKENS = 16384  # tokens per forward while the decodes' contexts are computed (not measured)
WARM_STEPS = 3  # decode steps before a window opens
WARM_WINDOWS = 1  # unmeasured windows before the measured ones (kernel compilation, allocations)


def on(stream):
    """Launch to ``stream`` (None: the CPU, no streams)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------- window metrics
def window_metrics(token_times: dict, t0: float, t_end: float, prompt_len: int) -> dict:
    """Metrics of one window from each running request's token times (host seconds).

    Args:
        token_times: request id -> sorted times its tokens reached the host, including the last
            one before ``t0`` and the first after ``t_end`` when known (they bound the gaps).
        t0, t_end: the prompt's arrival and the time its KV was complete.
        prompt_len: the prompt's tokens.
    """
    window = t_end - t0
    inside = sum(sum(1 for t in times if t0 < t <= t_end) for times in token_times.values())
    gaps = [b - a for times in token_times.values() for a, b in zip(times, times[1:])
            if b > t0 and a < t_end]
    return {"window_ms": window * 1e3, "decode_tokens": inside,
            "decode_tok_s": inside / window if window > 0 else 0.0,
            "longest_gap_ms": max(gaps, default=window) * 1e3,
            "prefill_tok_s": prompt_len / window if window > 0 else 0.0}


def verdict(mixed: list[dict], split: list[dict]) -> dict:
    """The module docstring's go/no-go rule over measured rows (rows with an "error" are ignored)."""
    mixed = [r for r in mixed if "error" not in r]
    split = [r for r in split if "error" not in r]
    if not mixed or not split:
        return {"go": None, "reason": "needs mixed and split rows; got "
                f"{len(mixed)} mixed, {len(split)} split"}
    best = max(mixed, key=lambda r: r["decode_tok_s"])
    rule = {"decode_tok_s": 1.5 * best["decode_tok_s"], "longest_gap_ms": 0.5 * best["longest_gap_ms"],
            "prefill_tok_s": 0.7 * best["prefill_tok_s"]}
    passing = [r["name"] for r in split
               if r["decode_tok_s"] >= rule["decode_tok_s"] and r["longest_gap_ms"] <= rule["longest_gap_ms"]
               and r["prefill_tok_s"] >= rule["prefill_tok_s"]]
    strict = {"decode_tok_s": 1.5 * max(r["decode_tok_s"] for r in mixed),
              "longest_gap_ms": 0.5 * min(r["longest_gap_ms"] for r in mixed),
              "prefill_tok_s": 0.7 * max(r["prefill_tok_s"] for r in mixed)}
    strict_passing = [r["name"] for r in split
                      if r["decode_tok_s"] >= strict["decode_tok_s"]
                      and r["longest_gap_ms"] <= strict["longest_gap_ms"]
                      and r["prefill_tok_s"] >= strict["prefill_tok_s"]]
    return {"go": bool(passing), "best_mixed": best["name"], "best_mixed_by": "decode_tok_s",
            "thresholds": rule, "passing": passing,
            "strict": {"thresholds": strict, "passing": strict_passing,
                       "note": "each threshold from the best mixed row for that metric"}}


# ---------------------------------------------------------------------------- mixed rows
def build_engine(model, args) -> tuple[ColocatedEngine, list]:
    """A colocated engine with ``args.num_decodes`` requests decoding at ``args.context``."""
    b, ctx = args.num_decodes, args.context
    room = ctx + args.decode_room
    num_pages = b * -(-room // PAGE_SIZE) + 2 * -(-(args.prompt + 16) // PAGE_SIZE) + 16
    if model.device.type == "cuda":
        need = num_pages * PAGE_SIZE * kv_bytes_per_token(model, model.dtype)
        free = torch.cuda.mem_get_info(model.device)[0]
        if need > free - 6 * GiB:
            raise SystemExit(f"spike_phase_split: the KV of {b} x {room} + 2 x {args.prompt} tokens needs "
                             f"{need / GiB:.1f} GiB; {free / GiB:.1f} GiB free (keep 6 GiB for "
                             f"activations): lower --num-decodes/--context/--prompt")
    engine = ColocatedEngine(model, num_pages=num_pages, page_size=PAGE_SIZE, max_num_seqs=b + 1,
                             max_num_batched_tokens=max(max(args.chunks), args.split_chunk, b + 1))
    if model.device.type == "cuda":  # kernels compiled and graphs captured before the first request
        engine.warmup(prompt_len=min(args.prompt, max(args.chunks)), max_kv_len=room)
    params = SamplingParams(max_tokens=args.decode_room - 16, ignore_eos=True)
    for i in range(b):
        engine.add(("decode", i), [1 + i % 7] * (ctx - 1), params)
    engine.scheduler.max_num_batched_tokens = max(FILL_TOKENS, ctx)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    return engine, list(engine.running)


def engine_window(engine, request_id, prompt_len: int) -> dict:
    """Run the engine until ``request_id``'s prompt (added now) has its first token."""
    times: dict = defaultdict(list)

    def step() -> list:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id != request_id and out.token_id is not None:
                times[out.request_id].append(now)
        return outs

    step()
    t0 = time.perf_counter()
    engine.add(request_id, [3] * prompt_len, SamplingParams(max_tokens=1, ignore_eos=True))
    done, steps = False, 0
    while not done:
        done = any(o.request_id == request_id for o in step())
        steps += 1
    t_end = time.perf_counter()
    step()  # the first tokens after the window bound its last gap
    return {**window_metrics(times, t0, t_end, prompt_len), "steps": steps}


def mixed_row(engine, chunk: int, prompt_len: int) -> dict:
    """One window of mixed steps under a ``chunk``-token budget (after an unmeasured one)."""
    engine.scheduler.max_num_batched_tokens = chunk
    for i in range(WARM_WINDOWS):
        engine_window(engine, ("warm", chunk, i), prompt_len)
    row = engine_window(engine, ("prompt", chunk), prompt_len)
    return {"name": f"mixed_chunk{chunk}", "chunk": chunk, **row}


# ---------------------------------------------------------------------------- split rows
class PhaseSplit:
    """Decode steps and prompt forwards over one engine's cache, each on its own stream.

    The decode steps replay the engine's graphs (its runner); the prompt runs eagerly on a second
    runner over the same KV tensor. Plans come from the one `PagedKVCache` under a lock (it is a
    host object with one open forward at a time); everything after the plan runs unlocked.
    """

    def __init__(self, engine, decodes: list) -> None:
        self.engine, self.cache, self.decodes = engine, engine.cache, decodes
        self.seq_ids = [r.seq_id for r in decodes]
        self.rows = np.arange(len(decodes))
        self.prefill_runner = ModelRunner(engine.model, engine.kv, max_num_seqs=1, use_cuda_graphs=False)
        self.lock = threading.Lock()
        self.decode_steps = 0
        self.times: list[float] = []
        self._scratch: int | None = None  # seq id of `scratch_prompt`'s sequence

    def plan(self, seq_ids: list[int], counts: list[int]):
        with self.lock:
            plan = self.cache.begin_forward(seq_ids, counts)
            self.cache.end_forward()
        return plan

    def decode_launch(self, ids):
        """Launch one decode step of every running request (input ``ids``: ``[B]`` int64, host
        or device); its `PendingTokens`. Its ids feed the next step, launched before these are
        read (double-buffered plan copies, as the engine's async scheduling)."""
        plan = self.plan(self.seq_ids, [1] * len(self.seq_ids))
        self.decode_steps += 1
        return self.engine.runner.execute(plan, ids, self.rows, self.decodes)

    def decode_wait(self, pending) -> None:
        """Wait for a launched step's tokens; every running request got one now."""
        pending.result()
        self.times.append(time.perf_counter())

    def prompt_chunk_async(self, req, start: int, n: int) -> torch.cuda.Event | None:
        """Launch ``n`` prompt tokens from ``start``; an event after them (None on the CPU)."""
        plan = self.plan([req.seq_id], [n])
        last = start + n == len(req.token_ids)
        rows = np.zeros(1 if last else 0, dtype=np.int64)
        self.prefill_runner.execute(plan, req.token_ids[start:start + n], rows, [req] if last else [])
        if self.engine.model.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def scratch_prompt(self, num_tokens: int):
        """A new sequence of ``num_tokens`` prompt tokens (given back by `rollback(pop_scratch())`)
        and a function running their forward, sampled, each call over the same slots."""
        req = self.engine._factory.new(("scratch",), [3] * num_tokens, SamplingParams(max_tokens=1))
        self.cache.add_sequence(req.seq_id)
        self._scratch = req.seq_id
        plan = self.plan([req.seq_id], [num_tokens])
        rows = np.zeros(1, dtype=np.int64)
        return lambda: self.prefill_runner.execute(plan, req.token_ids, rows, [req])

    def pop_scratch(self) -> int | None:
        seq_id, self._scratch = self._scratch, None
        return seq_id

    def rollback(self, prompt_seq: int | None, streams=()) -> None:
        """Give back the slots of the decode steps run since the last rollback and the prompt,
        once ``streams`` (green-context streams, which a device sync may not cover) are idle."""
        for stream in streams:
            if stream is not None:
                stream.synchronize()
        sync(self.engine.model.device)
        for seq_id in self.seq_ids:
            self.cache.popn(seq_id, self.decode_steps)
        if prompt_seq is not None and prompt_seq in self.cache:
            self.cache.remove_sequence(prompt_seq)
        self.decode_steps, self.times = 0, []


def split_window(split: PhaseSplit, part, prompt_len: int, chunk: int, launch: str) -> dict:
    """One window: decodes on ``part.decode_stream``, the prompt on ``part.prefill_stream``."""
    req = split.engine._factory.new(("split", part.name), [3] * prompt_len, SamplingParams(max_tokens=1))
    split.cache.add_sequence(req.seq_id)
    starts = list(range(0, prompt_len, chunk))
    device = split.engine.model.device
    ones = torch.ones(len(split.seq_ids), dtype=torch.int64, device=device)
    for stream in (part.decode_stream, part.prefill_stream):
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
    try:
        if launch == "threads":
            t0, t_end = _threads_window(split, part, req, starts, chunk, ones)
        else:
            t0, t_end = _interleaved_window(split, part, req, starts, chunk, ones)
        times = {i: list(split.times) for i in range(len(split.seq_ids))}
        return {**window_metrics(times, t0, t_end, prompt_len), "decode_steps": split.decode_steps}
    finally:
        split.rollback(req.seq_id, (part.decode_stream, part.prefill_stream))


def _threads_window(split, part, req, starts, chunk, ones) -> tuple[float, float]:
    stop, warm, errors = threading.Event(), threading.Event(), []

    def decode_loop() -> None:
        try:
            if ones.is_cuda:
                torch.cuda.set_device(ones.device)
            with on(part.decode_stream):
                previous = split.decode_launch(ones)
                while not stop.is_set():
                    pending = split.decode_launch(previous.device_tokens)
                    split.decode_wait(previous)
                    previous = pending
                    if len(split.times) >= WARM_STEPS:
                        warm.set()
                split.decode_wait(previous)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            errors.append(exc)
            warm.set()

    thread = threading.Thread(target=decode_loop, name="decode", daemon=True)
    thread.start()
    try:
        if not warm.wait(timeout=120):
            raise RuntimeError(f"the decode thread made {len(split.times)} steps in 120 s; expected {WARM_STEPS}")
        if errors:
            raise errors[0]
        with on(part.prefill_stream):
            t0 = time.perf_counter()
            for start in starts:
                event = split.prompt_chunk_async(req, start, min(chunk, len(req.token_ids) - start))
                if event is not None:
                    event.synchronize()
            t_end = time.perf_counter()
        steps = len(split.times)
        while len(split.times) < steps + 1 and thread.is_alive() and not errors:
            time.sleep(1e-4)  # a token after the window bounds its last gap
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]
    return t0, t_end


def _interleaved_window(split, part, req, starts, chunk, ones) -> tuple[float, float]:
    """One host thread: a chunk is launched whenever none is in flight, between decode steps."""
    with on(part.decode_stream):
        previous = split.decode_launch(ones)
    while len(split.times) < WARM_STEPS:
        previous = _decode_next(split, part, previous)
    t0, in_flight, pending_starts = time.perf_counter(), None, list(starts)
    while True:
        if in_flight is None and pending_starts:
            start = pending_starts.pop(0)
            with on(part.prefill_stream):
                in_flight = split.prompt_chunk_async(req, start, min(chunk, len(req.token_ids) - start))
        previous = _decode_next(split, part, previous)
        if in_flight is None or in_flight.query():
            in_flight = None
            if not pending_starts:
                t_end = time.perf_counter()
                break
    previous = _decode_next(split, part, previous)  # a token after the window bounds its last gap
    split.decode_wait(previous)
    return t0, t_end


def _decode_next(split, part, previous):
    """Launch the step after ``previous``, then wait for ``previous``'s tokens."""
    with on(part.decode_stream):
        pending = split.decode_launch(previous.device_tokens)
    split.decode_wait(previous)
    return pending


# ---------------------------------------------------------------------------- main
def print_table(result: dict) -> None:
    print(f"\n{result['device']}  torch {result['torch']}  commit {result['commit'][:10]}  "
          f"{result['config']['model']}  {result['config']['num_decodes']} decodes @ ctx "
          f"{result['config']['context']}, prompt {result['config']['prompt']}")
    print(f"{'row':<32}{'decode tok/s':>14}{'longest gap ms':>16}{'prefill tok/s':>15}{'window ms':>11}")
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['name']:<32}  error: {row['error']}")
        else:
            print(f"{row['name']:<32}{row['decode_tok_s']:>14.0f}{row['longest_gap_ms']:>16.1f}"
                  f"{row['prefill_tok_s']:>15.0f}{row['window_ms']:>11.1f}")
    for check in result["checks"]:
        print("check", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in check.items()
                                   if not isinstance(v, (list, dict))}))
    for line in result.get("skipped", []):
        print("skipped:", line)
    v = result["verdict"]
    print(f"verdict: {'GO' if v['go'] else 'NO-GO' if v['go'] is False else 'undecided'}  "
          f"{json.dumps({k: v[k] for k in v if k != 'strict'})}")


def write(path: Path, result: dict, row: dict | None = None) -> None:
    """Rewrite the JSON; print ``row`` (progress, for a run cut short)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    if row is not None:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3.1-8b")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/spike_phase_split.json"))
    parser.add_argument("--num-decodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096, help="context of the running decodes")
    parser.add_argument("--prompt", type=int, default=8192, help="tokens of the arriving prompt")
    parser.add_argument("--chunks", type=ints, default=[512, 2048, 8192],
                        help="max_num_batched_tokens of the mixed rows")
    parser.add_argument("--sms", type=ints, default=[16, 32, 48, 64], help="SMs of the decode partition")
    parser.add_argument("--split-chunk", type=int, default=8192, help="prompt tokens per forward (split)")
    parser.add_argument("--partition", default="torch,driver",
                        help="comma-separated methods: torch (torch.cuda.GreenContext), driver (libcuda)")
    parser.add_argument("--launch", default="threads,interleaved",
                        help="comma-separated: threads (a host thread per phase), interleaved (one thread)")
    parser.add_argument("--split-on-cpu", action="store_true",
                        help="on the CPU, run the split rows without partitions (tests the host loops)")
    parser.add_argument("--decode-room", type=int, default=1024,
                        help="tokens each decode may grow during the run (pages reserved for them)")
    args = parser.parse_args(argv)
    bad = [m for m in args.partition.split(",") if m not in ("torch", "driver")]
    if bad:
        parser.error(f"--partition: expected methods of torch,driver, got {bad}")
    bad = [m for m in args.launch.split(",") if m not in ("threads", "interleaved")]
    if bad:
        parser.error(f"--launch: expected modes of threads,interleaved, got {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    model = load_model(args.model, dtype=dtype, device=device)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
              "commit": commit(), "config": config, "dtype": str(dtype), "rows": [], "checks": [],
              "skipped": []}
    t_start = time.perf_counter()
    engine, decodes = build_engine(model, args)
    result["setup_s"] = time.perf_counter() - t_start
    mixed = result["rows"]  # written after every row: a run cut short keeps what it measured
    for chunk in args.chunks:
        mixed.append(mixed_row(engine, chunk, args.prompt))
        write(args.out, result, mixed[-1])
    mixed = list(mixed)
    errors = []
    if gpu or args.split_on_cpu:
        try:
            run_split(engine, decodes, args, result, errors)
        except Exception as exc:  # noqa: BLE001 - the rows so far are still written
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            result["split_error"] = errors[-1]
    if not gpu:
        result["skipped"].append(f"partition split and check rows: SM partitions need a CUDA device (got {device})")
    split_rows = result["rows"][len(mixed):]
    result["verdict"] = verdict(mixed, [r for r in split_rows if "num_sms" in r])
    result["total_s"] = time.perf_counter() - t_start
    write(args.out, result)
    print_table(result)
    if errors and not any("num_sms" in r and "error" not in r for r in split_rows):
        print(f"spike_phase_split: no partition row measured: {errors[0]}", file=sys.stderr)
        return 3
    return 0


def run_split(engine, decodes, args, result: dict, errors: list[str]) -> None:
    """Append the check and split rows of every partition method and N to ``result["checks"]``
    and ``result["rows"]`` (the file rewritten after each), one-line errors to ``errors``."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # threads: the decode thread gets the GIL back within 0.1 ms
    try:
        _run_split(engine, decodes, args, result, errors)
    finally:
        sys.setswitchinterval(previous)


def _run_split(engine, decodes, args, result: dict, errors: list[str]) -> None:
    split, rows = PhaseSplit(engine, decodes), result["rows"]
    launches = args.launch.split(",")
    if engine.model.device.type != "cuda" and "threads" in launches:  # Triton's interpreter has global state
        launches.remove("threads")
        result["skipped"].append("--launch threads on the CPU: Triton's interpreter is not thread-safe")
    result["launch"] = {"modes": launches, "streams": "ctx.Stream() / cuGreenCtxStreamCreate; "
                        "no context made current", "gil_switch_interval_s": sys.getswitchinterval(),
                        "decode": "graph replays, each step launched before the previous one's "
                                  "tokens are read (as async scheduling)",
                        "prefill": "eager forwards of --split-chunk tokens, each waited for by an event"}
    whole = _WholeGpu(engine.model.device)
    before = _cache_state(split)
    for launch in launches:
        for _ in range(WARM_WINDOWS):  # compiles the prompt's eager forward, starts the threads
            split_window(split, whole, args.prompt, args.split_chunk, launch)
        row = split_window(split, whole, args.prompt, args.split_chunk, launch)
        rows.append({"name": f"split_none_all_sms_{launch}", "launch": launch, **row,
                     "note": "two plain streams of the primary context: no partition"})
        write(args.out, result, rows[-1])
    parts = []  # kept alive to the end: a green context must outlive its streams' work
    for method in args.partition.split(",") if engine.model.device.type == "cuda" else ():
        for n in args.sms:
            name = f"split_{method}_N{n}"
            try:
                part = make_partition(method, engine.model.device, n)
                parts.append(part)
                result["checks"].append(partition_check(part, split, whole, min(args.prompt, args.split_chunk)))
                write(args.out, result, result["checks"][-1])
                for launch in launches:
                    row = split_window(split, part, args.prompt, args.split_chunk, launch)
                    rows.append({"name": f"{name}_{launch}", "method": method, "num_sms": n, "launch": launch,
                                 **part.describe(), **row})
                    write(args.out, result, rows[-1])
            except Exception as exc:  # noqa: BLE001 - one line per failed method, the rest still runs
                if not isinstance(exc, PartitionUnavailable):
                    exc = PartitionUnavailable(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                errors.append(str(exc))
                rows.append({"name": name, "method": method, "num_sms": n, "error": str(exc)})
                print(f"spike_phase_split: {name}: SM partitions unavailable: {exc}", file=sys.stderr)
                break  # the other sizes of this method fail the same way
    result["split_slots_returned"] = _cache_state(split) == before


def _cache_state(split: PhaseSplit) -> tuple:
    """The decodes' lengths and the free pages (the split rows must give back all they take)."""
    return tuple(split.cache.seq_length(s) for s in split.seq_ids), split.cache.num_free_pages


class _WholeGpu:
    """Two plain streams of the primary context: the concurrency without a partition."""

    name = "all_sms"

    def __init__(self, device: torch.device) -> None:
        gpu = device.type == "cuda"
        self.decode_stream = torch.cuda.Stream(device) if gpu else None
        self.prefill_stream = torch.cuda.Stream(device) if gpu else None
        self.seconds: dict[str, float] = {}  # the checks' whole-GPU times, measured once

    def describe(self) -> dict:
        return {}


if __name__ == "__main__":
    status = main()
    if torch.cuda.is_initialized():
        # Tensors that green-context streams used are freed after those contexts are gone, and
        # their destructors abort ("context is destroyed"): everything is written, skip teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
