"""Tuning sweep of the attention kernels' launch options on one GPU (not the reported benchmark).

    python3 benchmarks/sweep_kernels.py --groups fp8,bf16,small,long,prefill --out results/sweep.json
    (optionally first, in parallel: the same with --compile-only --shard i/n, to fill Triton's cache)

Each group times variants of one case against the same inputs (built once), every timing a
CUDA-graph replay median as in `bench_kernels.py`; a row is printed as soon as it is measured, so
a run stopped at its time limit keeps what it printed. A variant overrides entries of
`decode.CONFIGS` / `prefill.CUDA_CONFIGS` for its call only; the winners are copied into those
tables by hand, with the measurement that chose them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from disagg.kernels import decode as decode_mod
from disagg.kernels import prefill as prefill_mod
from disagg.kernels import decode_workspace, paged_decode

import bench_kernels as bk

FP8 = torch.float8_e4m3fn
# (BLOCK_N, num_warps, num_stages, extra CONFIGS entries[, splits]): the last round of each case
# (earlier rounds tried kernel variants since removed; decode.py's CONFIGS comment has the figures).
SWAP = dict(SWAP_AB=True)
SWAP_T = dict(SWAP_AB=True, PV_T=True)
FP8_VARIANTS = [  # fp8 decode, B=64 x 4096 (interleaved, repeated): split counts
    (64, 2, 5, dict(), 2),
    (64, 2, 5, dict(), 3),
    (64, 2, 5, dict(), 4),
    (64, 2, 5, dict(), 1),
] * 2
BF16_VARIANTS = [  # bf16 decode, B=64 x 4096 (the default first, repeated to see the spread)
    (64, 4, 3, dict(), 2),
    (64, 2, 4, dict(), 2),
    (64, 2, 5, dict(), 2),
    (32, 2, 5, dict(), 2),
] * 2
SMALL_VARIANTS = [  # bf16 decode, B=8 x 1024 (repeated: runs differ by ~15%)
    (64, 4, 3, dict(PDL=2), 4),
    (64, 4, 6, dict(PDL=2), 1),
    (64, 8, 6, dict(PDL=2), 1),
    (128, 8, 3, dict(PDL=2), 1),
    (64, 4, 5, dict(PDL=2), 2),
    (64, 4, 6, dict(PDL=2), 2),
    (128, 8, 3, dict(PDL=2), 2),
    (64, 8, 5, dict(PDL=2), 2),
    (64, 4, 5, dict(PDL=2), 4),
] * 2
MID_VARIANTS = [  # bf16 decode, B=64 x 1024 (bench_engine's decode target shape): split counts
    (64, 4, 3, dict()),
    (64, 4, 4, dict()),
    (64, 8, 3, dict()),
    # one split (the heuristic's choice there): tile depth, warps, stages, deferred sums
    (32, 4, 4, dict(), 1),
    (32, 2, 5, dict(), 1),
    (128, 8, 3, dict(), 1),
    (128, 4, 2, dict(), 1),
    (64, 2, 4, dict(), 1),
    (64, 4, 2, dict(), 1),
    (64, 4, 5, dict(), 1),
    (64, 4, 3, dict(DEFER_SUM=True), 1),
    (64, 4, 3, dict(), 1),  # the default again, for the spread
    (64, 2, 4, dict(), 1),
]
LONG_VARIANTS = [  # bf16 decode, B=32 x 32768
    (64, 4, 3, dict()),
    (64, 4, 3, SWAP_T),
    (64, 2, 4, dict()),
    (64, 2, 5, dict()),
]
# Stream floors (benchmarks/bench_kernels.py stream_kv_kernel): (batch, ctx, dtype, splits,
# paged, BLOCK_N, num_warps, num_stages).
FLOOR_VARIANTS = [
    (8, 1024, torch.bfloat16, 4, True, 64, 4, 3),
    (64, 4096, torch.bfloat16, 2, True, 64, 4, 3),
    (64, 4096, FP8, 2, True, 64, 4, 3),
]
PREFILL_VARIANTS = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3),
]


class Rows(list):
    """Rows printed as measured."""

    def append(self, row):
        print(json.dumps(row), flush=True)
        super().append(row)


@contextlib.contextmanager
def decode_config(kind: str, block_n: int, warps: int, stages: int, extra: dict):
    """Override `kind` and the other entries of its cache family ("16bit" and "16bit-small"):
    `DecodeCase.check` runs a 2-sequence batch, a small grid, whatever grid is timed."""
    family = kind.split("-")[0]
    saved = dict(decode_mod.CONFIGS)
    for key in saved:
        if key.split("-")[0] == family:
            decode_mod.CONFIGS[key] = dict(saved[kind], BLOCK_N=block_n, num_warps=warps,
                                           num_stages=stages, **extra)
    try:
        yield
    finally:
        decode_mod.CONFIGS.update(saved)


class DecodeCase:
    """Inputs of one decode shape, rotated over enough copies to exceed L2, built once."""

    def __init__(self, batch, ctx, dtype, max_splits, num_qo_heads=32, num_kv_heads=8,
                 head_dim=128, page_size=16):
        kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * torch.finfo(dtype).bits // 8
        self.kv, self.tables = bk.paged_batch(batch, ctx, num_kv_heads, head_dim, page_size, dtype,
                                              bk.copies_for(kv_bytes))
        self.qs = [torch.randn(batch, num_qo_heads, head_dim, device=bk.CUDA, dtype=torch.bfloat16)
                   for _ in self.tables]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.ws = [decode_workspace(batch, num_qo_heads, head_dim, max_splits, bk.CUDA)
                   for _ in self.tables]
        self.scales = dict(k_scale=0.125, v_scale=0.125) if dtype == FP8 else {}
        self.io_bytes = kv_bytes + 2 * batch * num_qo_heads * head_dim * 2
        self.sm_scale = head_dim ** -0.5

    def time(self, splits: int, reps: int = 30) -> dict:
        calls = [lambda q=q, t=t, o=o, w=w: paged_decode(
            q, self.kv, *t, self.sm_scale, out=o, num_splits=splits, workspace=w,
            check_indices=False, **self.scales) for q, t, o, w in zip(self.qs, self.tables, self.outs, self.ws)]
        seconds = bk.graph_seconds(calls, reps=reps)
        return dict(us=seconds * 1e6, TBps=self.io_bytes / seconds / 1e12)

    def check(self, splits: int) -> float:
        """Relative error of copy 0 against the same kernel with the table's defaults (sanity)."""
        from disagg.kernels import reference
        q, t = self.qs[0], self.tables[0]
        got = paged_decode(q[:2], self.kv, t[0][:3], t[1], t[2][:2], self.sm_scale,
                           num_splits=splits, check_indices=False, **self.scales)
        want = reference.paged_decode(q[:2], self.kv, t[0][:3], t[1], t[2][:2], self.sm_scale,
                                      *self.scales.values())
        return float((got.float() - want.float()).norm() / want.float().norm())


CASES = {  # group -> (batch, ctx, dtype, CONFIGS key, variants, splits tried per variant)
    "fp8": (64, 4096, FP8, "fp8", FP8_VARIANTS, (1, 2)),
    "bf16": (64, 4096, torch.bfloat16, "16bit", BF16_VARIANTS, (1, 2)),
    "mid": (64, 1024, torch.bfloat16, "16bit", MID_VARIANTS, (1, 2, 3, 4, 6)),
    "small": (8, 1024, torch.bfloat16, "16bit-small", SMALL_VARIANTS, ()),
    "long": (32, 32768, torch.bfloat16, "16bit", LONG_VARIANTS, (4,)),
}


def jobs(groups):
    """Flat (group, variant, splits) list in a fixed order (shards of it compile in parallel)."""
    out = []
    for group in groups:
        if group == "prefill":
            out += [("prefill", config, None) for config in PREFILL_VARIANTS]
            continue
        if group == "floor":
            out += [("floor", config, None) for config in FLOOR_VARIANTS]
            continue
        variants, splits_list = CASES[group][4], CASES[group][5]
        for variant in variants:
            for splits in (splits_list if len(variant) == 4 else (variant[4],)):
                out.append((group, variant, splits))
    return out


def run_job(rows, cases, group, variant, splits, compile_only):
    """Time (or, with compile_only, just run once) one variant; failures become error rows."""
    if group == "prefill":
        saved = prefill_mod.CUDA_CONFIGS[128]
        prefill_mod.CUDA_CONFIGS[128] = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), variant))
        try:
            r = bk.bench_prefill(reps=1 if compile_only else 10)
            rows.append(dict(group="prefill", config=variant, TFLOPs=round(r["flops_per_s"] / 1e12, 1)))
        except Exception as exc:  # a variant that fails to compile is reported, not fatal
            rows.append(dict(group="prefill", config=variant, error=repr(exc)[:300]))
        finally:
            prefill_mod.CUDA_CONFIGS[128] = saved
        return
    if group == "floor":
        batch, ctx, dtype, splits, paged, block_n, warps, stages = variant
        r = bk.bench_stream_floor(batch, ctx, dtype, num_splits=splits, paged=paged,
                                  block_n=block_n, num_warps=warps, num_stages=stages)
        rows.append(dict(group="floor", batch=batch, ctx=ctx, dtype=str(dtype), splits=splits,
                         paged=paged, block_n=block_n, warps=warps, stages=stages,
                         us=round(r["seconds"] * 1e6, 3), TBps=round(r["bytes_per_s"] / 1e12, 3)))
        return
    batch, ctx, dtype, kind = CASES[group][:4]
    if group not in cases:
        cases.clear()  # one case's memory at a time
        cases[group] = DecodeCase(batch, ctx, dtype, 32)
    case = cases[group]
    block_n, warps, stages, extra = variant[:4]
    row = dict(group=group, block_n=block_n, warps=warps, stages=stages, extra=extra, splits=splits)
    try:
        with decode_config(kind, block_n, warps, stages, extra):
            before = _compiled_kernels()
            row["rel_err"] = round(case.check(splits), 5)
            row.update(_resources([k for k in _compiled_kernels() if k not in before]))
            if not compile_only:
                row.update({k: round(v, 3) for k, v in case.time(splits).items()})
    except Exception as exc:
        row["error"] = repr(exc)[:300]
    rows.append(row)


PTX_OPS = ("ld.global", "cp.async.ca", "cp.async.cg", "st.shared", "ld.shared", "ldmatrix",
           "mma.sync", "wgmma.mma_async", "bar.sync", "cvt.rn.f16x2.e4m3x2", "shfl.sync")
DUMP_DIR = None  # --dump: where each new kernel's TTGIR and PTX are written


def _compiled_kernels() -> list:
    """Every compiled specialization of the decode kernel (Triton 3.6 and 3.9 caches)."""
    found = []
    for entry in getattr(decode_mod.paged_decode_kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            found += [k for k in cache.values() if hasattr(k, "asm")]
    return found


def _resources(kernels: list) -> dict:
    """Registers, spills, shared memory and PTX op counts of the kernel(s) a variant compiled."""
    if not kernels:
        return {}
    k = kernels[-1]
    ptx = k.asm.get("ptx", "")
    out = dict(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
               ops={op: ptx.count(op) for op in PTX_OPS})
    if DUMP_DIR is not None:
        name = f"decode_{abs(hash(ptx)) % 10**8}"
        for ext in ("ttgir", "ptx"):
            (DUMP_DIR / f"{name}.{ext}").write_text(str(k.asm.get(ext, "")))
        out["dump"] = name
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="fp8,bf16,small,long,prefill")
    parser.add_argument("--out", type=Path, default=Path("results/sweep_kernels.json"))
    parser.add_argument("--compile-only", action="store_true",
                        help="run each variant once (fills Triton's cache), no timing")
    parser.add_argument("--shard", default="0/1", help="i/n: take every n-th job from the i-th")
    parser.add_argument("--dump", type=Path, default=None,
                        help="folder for each new decode kernel's TTGIR and PTX")
    args = parser.parse_args()
    if args.dump is not None:
        global DUMP_DIR
        DUMP_DIR = args.dump
        DUMP_DIR.mkdir(parents=True, exist_ok=True)
    index, count = (int(x) for x in args.shard.split("/"))
    todo = jobs(args.groups.split(","))[index::count]
    torch.manual_seed(0)
    rows = Rows()
    start = time.time()
    if not args.compile_only:
        bk.warm_up()
        rows.append(dict(group="copy", TBps=round(bk.copy_bandwidth()["anchor"] / 1e12, 3)))
    cases = {}
    for group, variant, splits in todo:
        run_job(rows, cases, group, variant, splits, args.compile_only)
    rows.append(dict(group="done", seconds=round(time.time() - start, 1)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
