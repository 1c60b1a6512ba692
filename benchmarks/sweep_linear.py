"""Tuning sweep of the skinny GEMM (`disagg.kernels.linear`) against cuBLAS on one GPU.

    python3 benchmarks/sweep_linear.py --out results/sweep_linear.json            # all shapes
    python3 benchmarks/sweep_linear.py --rows 64 --shapes 4096x4096 --quick       # one shape

For each of llama3-8b's decode GEMMs (`N x K`: qkv, o, gate_up, down, lm_head) and each row count,
times torch's `F.linear` (cuBLAS) and every launch option of the grid below, each a CUDA-graph
replay median over weight copies rotated past L2 (a decode step reads every layer's weights once,
never from L2), against the weights-only bound: weight bytes / the copy bandwidth (read + write)
measured in the same run, as `bench_engine.py` does. Each option's result is checked against
cuBLAS's first (relative L2 error < 1e-2), so a broken option cannot win. A row is printed as soon
as it is measured. The winners go into `disagg.kernels.linear.CONFIGS` by hand, with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import bench_kernels as bk
from disagg.kernels import linear as skinny

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
BLOCK_N = (32, 64, 128)
BLOCK_K = (64, 128)
SPLIT_K = (1, 2, 4, 8)
STAGES = (3, 5)
WARPS = (4,)
QUICK = dict(BLOCK_N=(64, 128), BLOCK_K=(128,), SPLIT_K=(1, 2, 4, 8), STAGES=(3,), WARPS=(4,))


def options(k: int, quick: bool) -> list[skinny.LinearConfig]:
    """The grid, without splits whose K slices would be shorter than 512."""
    grid = QUICK if quick else dict(BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K,
                                    STAGES=STAGES, WARPS=WARPS)
    return [skinny.LinearConfig(block_n=n, block_k=bk_, split_k=s, num_warps=w, num_stages=st)
            for n, bk_, s, st, w in itertools.product(grid["BLOCK_N"], grid["BLOCK_K"],
                                                       grid["SPLIT_K"], grid["STAGES"], grid["WARPS"])
            if k // s >= 512]


def sweep_shape(name: str, n: int, k: int, rows: int, bandwidth: float, quick: bool) -> dict:
    weight_bytes = n * k * 2
    copies = bk.copies_for(weight_bytes)
    gen = torch.Generator(bk.CUDA).manual_seed(n + k)
    weights = [(torch.randn(n, k, generator=gen, device=bk.CUDA) / k ** 0.5).to(torch.bfloat16)
               for _ in range(copies)]
    x = torch.randn(rows, k, generator=gen, device=bk.CUDA).to(torch.bfloat16)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=bk.CUDA)
    want = F.linear(x, weights[0]).float()
    bound = weight_bytes / bandwidth
    cublas = bk.graph_seconds([lambda w=w: torch.matmul(x, w.T, out=out) for w in weights])
    row = {"name": name, "n": n, "k": k, "rows": rows, "bound_us": bound * 1e6,
           "cublas_us": cublas * 1e6, "cublas_ratio": cublas / bound, "options": []}
    print(json.dumps({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()
                      if key != "options"}), flush=True)
    for config in options(k, quick):
        entry = {"config": dataclasses.asdict(config)}
        try:
            got = skinny.linear(x, weights[0], config=config).float()
            rel = float((got - want).norm() / want.norm())
            if rel > 1e-2:
                entry["error"] = f"relative error {rel:.2e} against cuBLAS"
            else:
                seconds = bk.graph_seconds(
                    [lambda w=w, c=config: skinny.linear(x, w, out=out, config=c) for w in weights])
                entry.update(us=seconds * 1e6, ratio=seconds / bound, vs_cublas=seconds / cublas)
        except Exception as exc:  # noqa: BLE001 - an option that does not compile is a row
            entry["error"] = repr(exc)[:200]
        row["options"].append(entry)
        print("   ", json.dumps({key: (round(v, 3) if isinstance(v, float) else v)
                                 for key, v in entry.items()}), flush=True)
    timed = [e for e in row["options"] if "us" in e]
    if timed:
        best = min(timed, key=lambda e: e["us"])
        row.update(best=best["config"], best_us=best["us"], best_ratio=best["ratio"],
                   best_vs_cublas=best["vs_cublas"])
        default = skinny.default_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        row["default"] = dataclasses.asdict(default)
        row["default_us"] = bk.graph_seconds(
            [lambda w=w: skinny.linear(x, w, out=out, config=default) for w in weights]) * 1e6
    del weights
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64", help="row counts (decode batch sizes)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="names from SHAPES or NxK, comma-separated")
    parser.add_argument("--quick", action="store_true", help="a small grid of options")
    parser.add_argument("--out", type=Path, default=Path("results/sweep_linear.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_linear.py needs a CUDA GPU")
    bk.warm_up()
    bandwidth = bk.copy_bandwidth()["anchor"]
    result = {"device": torch.cuda.get_device_name(0), "copy_bandwidth_GBps": bandwidth / 1e9,
              "rows": []}
    start = time.perf_counter()
    for rows in (int(r) for r in args.rows.split(",")):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape] if shape in SHAPES else (int(v) for v in shape.split("x"))
            result["rows"].append(sweep_shape(shape, n, k, rows, bandwidth, args.quick))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
    print(f"{time.perf_counter() - start:.0f} s")
    for row in result["rows"]:
        if "best_us" in row:
            print(f"{row['name']:8s} rows {row['rows']:3d}: bound {row['bound_us']:7.1f} us, cuBLAS "
                  f"{row['cublas_ratio']:.2f}x, best {row['best_ratio']:.2f}x {row['best']}, "
                  f"default {row['default_us'] / row['bound_us']:.2f}x")


if __name__ == "__main__":
    main()
