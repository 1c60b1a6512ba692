#!/usr/bin/env bash
# The engine figures on one GPU (an H200), in one command of under 10 minutes:
#   1. the engine and layer GPU tests, 2. the skinny GEMM's tuning sweep at 64 rows, 3.
#   bench_engine's decode rows with each default turned off in turn (A/B in one process) and
#   with layer PDL (still opt-in), 4. the host-idle rows (sync and async scheduling).
# Usage (the GPU wheels in .whl/):  source .whl/gpu-env.sh && bash benchmarks/run_engine.sh
# Everything lands in $OUT (default results/engine); each step has its own time limit, so
# a hang or failure costs that step only.
set -u
OUT=${OUT:-results/engine}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, print its tail
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: rc $? in $((SECONDS - start)) s"; tail -4 "$OUT/$name.log"
}
nvidia-smi -L
step gpu_tests 200 python3 -m pytest -q -m gpu -x tests/kernels/test_linear_gpu.py \
    tests/kernels/test_fused_gpu.py tests/model/test_model_linear.py tests/model/test_model_fused.py \
    tests/engine/test_engine_gpu.py
step sweep_linear 150 python3 benchmarks/sweep_linear.py --rows 64 --quick --out "$OUT/sweep_linear.json"
step variants 150 python3 benchmarks/bench_engine.py --batches 1,64 --contexts 1024 \
    --out "$OUT/bench_variants.json" --variants \
    'base;DISAGG_ROPE_APPEND=0;DISAGG_LINEAR=cublas;DISAGG_BLAS=cublas;DISAGG_LAYER_PDL=1;DISAGG_LINEAR=triton,DISAGG_LAYER_PDL=1'
step idle 90 python3 benchmarks/bench_engine.py --only idle --out "$OUT/bench_idle.json"
