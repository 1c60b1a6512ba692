"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, and count the PTX
instructions that say how they will run. Run as a script with `TRITON_INTERPRET=0` (the
interpreter replaces `@triton.jit` functions at import): `test_compile_sm90.py` does.

    TRITON_INTERPRET=0 python tests/kernels/sm90_compile.py    # prints one JSON line per case

Arguments are specialized as Triton's launcher would for real tensors: every pointer 16-byte
aligned and every size and stride marked divisible by 16 where llama3-8b's are.
"""

from __future__ import annotations

import collections
import inspect
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
OPS = ("cp.async.cg", "wgmma.mma", "mma.sync", "griddepcontrol.wait", "griddepcontrol.launch",
       "atom.global", "ld.global.b16", "prefetch.global.L2")


def compile_sm90(fn, types: dict, constexprs: dict, div16: list[str], **options) -> dict:
    """Compile `fn` for sm_90; returns shared bytes and counts of the PTX ops in `OPS`."""
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=TARGET, options=options)
    ptx = kernel.asm["ptx"]
    ops = collections.Counter(re.findall(r"^\s*(?:@!?%p\d+ )?([a-z]+\.[A-Za-z0-9_.]+)", ptx, re.M))
    return {"shared": kernel.metadata.shared,
            **{op: sum(c for name, c in ops.items() if name.startswith(op)) for op in OPS}}


def linear_cases() -> list[dict]:
    from disagg.kernels.linear import linear_kernel
    types = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32",
                 count_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32", stride_xm="i32",
                 stride_wn="i32", stride_om="i32")
    div16 = ["x_ptr", "w_ptr", "bias_ptr", "out_ptr", "part_ptr", "count_ptr", "N", "K", "k_per_split",
             "stride_xm", "stride_wn", "stride_om"]
    rows = []
    for split, block_m, pdl in [(1, 64, False), (4, 64, True), (4, 16, True)]:
        constexprs = dict(HAS_BIAS=False, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128,
                          EVEN_K=True, DOT_PRECISION="tf32", UPCAST=False, PDL=pdl, PREFETCH_K=256)
        rows.append({"kernel": "linear", "split_k": split, "block_m": block_m, "pdl": pdl,
                     **compile_sm90(linear_kernel, types, constexprs, div16, num_warps=4, num_stages=3)})
    return rows


def fused_cases() -> list[dict]:
    from disagg.kernels import fused
    rows = []
    for pdl in (False, True):
        norm = dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16",
                    stride_x="i32", stride_residual="i32", stride_out="i32", eps="fp32")
        rows.append({"kernel": "add_rms_norm", "pdl": pdl, **compile_sm90(
            fused.add_rms_norm_kernel, norm, dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True, PDL=pdl),
            ["x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "stride_x", "stride_residual",
             "stride_out"], num_warps=8, enable_fp_fusion=False)})
        silu = dict(gate_up_ptr="*bf16", out_ptr="*bf16", stride_in="i32", stride_out="i32")
        rows.append({"kernel": "silu_mul", "pdl": pdl, **compile_sm90(
            fused.silu_mul_kernel, silu, dict(INTERMEDIATE=14336, BLOCK=1024, PRECISE_EXP=True, PDL=pdl),
            ["gate_up_ptr", "out_ptr", "stride_in", "stride_out"], num_warps=4, enable_fp_fusion=False)})
        rope = dict(x_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", out_ptr="*bf16", stride_xt="i32",
                    stride_xh="i32", stride_cos="i32", stride_sin="i32", stride_ot="i32", stride_oh="i32")
        rows.append({"kernel": "apply_rope", "pdl": pdl, **compile_sm90(
            fused.apply_rope_kernel, rope, dict(NUM_HEADS=40, HALF=64, BLOCK_H=32, BLOCK_HALF=64, PDL=pdl),
            ["x_ptr", "cos_ptr", "sin_ptr", "out_ptr", "stride_xt", "stride_xh", "stride_cos",
             "stride_sin", "stride_ot", "stride_oh"], num_warps=4, enable_fp_fusion=False)})
        rows.append({"kernel": "rope_append", "pdl": pdl, **rope_append_case(pdl)})
    return rows


def rope_append_case(pdl: bool) -> dict:
    from disagg.kernels.rope_append import rope_append_kernel
    types = dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_ptr="*bf16", kv_ptr="*bf16",
                 slots_ptr="*i64", stride_qkv="i32", stride_cos="i32", stride_sin="i32",
                 stride_qt="i32", stride_page="i64")
    return compile_sm90(rope_append_kernel, types,
                        dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HALF=64, PAGE_SIZE=16, BLOCK_H=64,
                             BLOCK_HALF=64, PDL=pdl),
                        ["qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "kv_ptr", "slots_ptr", "stride_qkv",
                         "stride_cos", "stride_sin", "stride_qt", "stride_page"],
                        num_warps=4, enable_fp_fusion=False)


if __name__ == "__main__":
    for row in linear_cases() + fused_cases():
        print(json.dumps(row))
