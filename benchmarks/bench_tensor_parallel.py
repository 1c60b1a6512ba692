"""Tensor parallelism's cost and gain in one run: a decode step and a prefill at TP=N against TP=1.

    python3 benchmarks/bench_engine.py --tensor-parallel 2 --out results/bench_tp2.json     # 2 GPUs, NCCL
    python3 benchmarks/bench_tensor_parallel.py --tensor-parallel 2 --model dummy:llama3-8b  # the same
    python3 benchmarks/bench_tensor_parallel.py --tensor-parallel 2 --device cpu --model dummy:tiny  # gloo smoke

Rows (ratio of one run's two measurements, target):
- decode_B{b}_ctx{c}_tp{N}: one decode step of B sequences at context C (its CUDA graph, the
  NCCL all-reduces captured in it) at TP=N / the same step at TP=1. Target <= 0.60 at B=64 x
  1024 on two GPUs (a perfect halving is 0.5; the all-reduces may cost 20% over it).
- prefill_{n}x{len}_tp{N}: tokens/s of one forward of n prompts of len tokens at TP=N / at TP=1.
  Target >= 1.7 at 8 x 2048 on two GPUs.

Each rank is a process, spawned by `disagg profile`'s launcher (`profile_ranks.run_ranks`): rank
r on GPU r, NCCL between them (gloo on the CPU). Rank 0 times TP=1 of the model first, alone, and
frees it; then every rank loads its shard (`load_model(..., tp=)`, dummy weights: TP=1's sliced)
and the same shapes are timed at TP=N with the engine benchmarks' runner and timer
(`forward_bench.py`); rank 0's times are the row's (each forward's all-reduces keep the ranks in
step). A TP=1 model that does not fit one GPU is reported as skipped and the TP=N times stand
alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SINGLE_TIMEOUT_S = 1800.0  # how long ranks 1.. wait for rank 0 to finish its TP=1 runs and join


def measure(model, batch: int, context: int, prefill_seqs: int, prefill_len: int, reps: int) -> dict:
    """Seconds of one decode step of ``batch`` x ``context`` and of one prefill forward of
    ``prefill_seqs`` x ``prefill_len`` tokens on ``model`` (every rank of a TP model calls it with
    the same arguments: its collectives pair up)."""
    from forward_bench import PAGE_SIZE, Bench, timed

    pages = batch * -(-context // PAGE_SIZE) + prefill_seqs * -(-prefill_len // PAGE_SIZE) + 64
    bench = Bench(model, pages, max_num_seqs=batch)
    plan, reqs = bench.plan([context - 1] * batch, [1] * batch)
    ids = torch.ones(batch, dtype=torch.int64, device=bench.device)
    graphs = bench.runner.graphs
    decode = (lambda: graphs.run(plan, ids)) if graphs else (lambda: bench.forward(plan, reqs))
    decode_s = timed(decode, reps * 4, bench.device)
    plan, reqs = bench.plan([0] * prefill_seqs, [prefill_len] * prefill_seqs)
    prefill_s = timed(lambda: bench.forward(plan, reqs), reps, bench.device)
    del bench, plan, reqs, graphs
    return {"decode_s": decode_s, "prefill_s": prefill_s}


def _rank_main(rank: int, size: int, address: str, args: dict) -> dict:
    """One rank's process (`run_ranks`): rank 0 times TP=1 first, then all ranks time TP=``size``."""
    from disagg.model import load_model
    from disagg.parallel import init_tensor_parallel

    shapes = {k: args[k] for k in ("batch", "context", "prefill_seqs", "prefill_len", "reps")}
    gpu = args["device"] == "cuda"
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args["dtype"])
    out: dict = {"rank": rank}
    if rank == 0:
        try:
            single = load_model(args["model"], dtype=dtype, device=device)
            out["tp1"] = measure(single, **shapes)
            del single
        except torch.cuda.OutOfMemoryError as err:
            out["tp1_skipped"] = f"TP=1 does not fit one GPU: {str(err).splitlines()[0]}"
        if gpu:
            torch.cuda.empty_cache()
    tp = init_tensor_parallel(address, rank, size, "nccl" if gpu else "gloo", SINGLE_TIMEOUT_S)
    try:
        model = load_model(args["model"], dtype=dtype, device=device, tp=tp)
        out["tpN"] = measure(model, **shapes)
        out["backend"] = tp.backend
    finally:
        tp.close()
    return out


def run(size: int, *, model: str, device: str, dtype: str | None = None, batch: int = 64, context: int = 1024,
        prefill_seqs: int = 8, prefill_len: int = 2048, reps: int = 5) -> dict:
    """Time TP=1 and TP=``size`` of ``model`` (module docstring); the result with its rows.

    Raises:
        ValueError: fewer than 2 ranks, or fewer visible GPUs than ranks.
        ClusterError: a rank failed (its rank and error).
    """
    from disagg.cluster.simulate.profile_ranks import run_ranks

    if size < 2:
        raise ValueError(f"--tensor-parallel: expected at least 2 ranks (TP=N against TP=1), got {size}")
    if device == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel {size}: needs {size} GPUs (one per rank, NCCL), "
                         f"{torch.cuda.device_count()} visible")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    args = dict(model=model, device=device, dtype=dtype, batch=batch, context=context,
                prefill_seqs=prefill_seqs, prefill_len=prefill_len, reps=reps)
    lead = run_ranks(_rank_main, size, (args,), timeout_s=SINGLE_TIMEOUT_S + 600)[0]
    name = device if device != "cuda" else torch.cuda.get_device_name(0)
    return {"model": model, "dtype": dtype, "device": name, "tensor_parallel": size, "backend": lead["backend"],
            "rows": rows_of(lead, size, batch, context, prefill_seqs, prefill_len)}


def rows_of(lead: dict, size: int, batch: int, context: int, prefill_seqs: int, prefill_len: int) -> list[dict]:
    """The decode and prefill rows of rank 0's answer (TP=N over TP=1, or TP=N alone with the
    reason TP=1 was skipped)."""
    tokens = prefill_seqs * prefill_len
    single, many = lead.get("tp1"), lead["tpN"]
    decode = {"name": f"decode_B{batch}_ctx{context}_tp{size}", "ours_us": many["decode_s"] * 1e6,
              "target": "<= 0.60 at B=64 x 1024, TP=2", "anchor": "the same decode step at TP=1"}
    prefill = {"name": f"prefill_{prefill_seqs}x{prefill_len}_tp{size}", "ours_tokens_per_s": tokens / many["prefill_s"],
               "target": ">= 1.7 at 8 x 2048, TP=2", "anchor": "the same prefill's tokens/s at TP=1"}
    if single is None:
        for row in (decode, prefill):
            row["skipped_anchor"] = lead.get("tp1_skipped")
        return [decode, prefill]
    decode.update(anchor_us=single["decode_s"] * 1e6, ratio=many["decode_s"] / single["decode_s"])
    prefill.update(anchor_tokens_per_s=tokens / single["prefill_s"], ratio=single["prefill_s"] / many["prefill_s"])
    return [decode, prefill]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel", type=int, default=2, metavar="N", help="ranks of the TP=N side")
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="decode batch (default 64; 4 on the CPU)")
    parser.add_argument("--context", type=int, default=None, help="decode context (default 1024; 64 on the CPU)")
    parser.add_argument("--prefill", default=None, metavar="NxLEN", help="prefill shape (default 8x2048; 2x32 on the CPU)")
    parser.add_argument("--reps", type=int, default=None, help="timed prefill forwards (decode: 4x; default 5, 2 on the CPU)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_tensor_parallel.json"))
    args = parser.parse_args(argv)
    small = args.device != "cuda"
    seqs, length = (int(v) for v in (args.prefill or ("2x32" if small else "8x2048")).split("x"))
    result = run(args.tensor_parallel, model=args.model, device=args.device, dtype=args.dtype,
                 batch=args.batch or (4 if small else 64), context=args.context or (64 if small else 1024),
                 prefill_seqs=seqs, prefill_len=length, reps=args.reps or (2 if small else 5))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return result


if __name__ == "__main__":
    main()
