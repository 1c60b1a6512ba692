#!/usr/bin/env bash
# 64-GPU planning rows (issue 25), prefill-heavy then decode-heavy, at 16d21b3 (plan-tree).
set -u
cd /work/scratch/plan-tree
P=/work/main/benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
OUT=/work/scratch/s3/plan64
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --adaptive-chunk-sizes 8192 --jobs 2"
run() { # name dataset ttft tpot only
  local name=$1 ds=$2 t=$3 p=$4 only=$5
  ( time nice -n 5 /work/scratch/plan-venv/bin/python -m disagg.cluster.cli plan --profile $P --dataset-name $ds --goodput ttft:$t tpot:$p --gpus 64 $H --only "$only" --out $OUT/$name.yaml ) > $OUT/$name.log 2>&1
  echo "$name done: $(grep real $OUT/$name.log)"
}
run 64gpu-prefill-heavy-1x prefill-heavy 166.168 11.7824 "colocated-64[chunk=8192],56P8D,56P8D-adaptive"
run 64gpu-decode-heavy-1x decode-heavy 66.0932 11.1873 "colocated-64[chunk=8192],8P56D,8P56D-adaptive"
