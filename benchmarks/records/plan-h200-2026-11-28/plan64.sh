#!/usr/bin/env bash
# 64-GPU planning rows (issue 25) at one commit, runs stopped at a certain miss (16d21b3), from a
# clone at that commit with its own venv. Session r ran the chat line as written, then (in a second
# driver beside it, once chat's first candidate was judged) prefill-heavy and decode-heavy with
# the lists below.
set -u
cd "$(git rev-parse --show-toplevel)"  # from the repository (session r: a clone at 16d21b3)
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
OUT=${OUT:-results/plan64}; mkdir -p "$OUT"
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --adaptive-chunk-sizes 8192 --jobs 2"
run() { # name dataset ttft tpot only
  local name=$1 ds=$2 t=$3 p=$4 only=$5
  ( time nice -n 5 .venv/bin/python -m disagg.cluster.cli plan --profile $P --dataset-name $ds --goodput ttft:$t tpot:$p --gpus 64 $H --only "$only" --out $OUT/$name.yaml ) > $OUT/$name.log 2>&1
  echo "$name done: $(grep real $OUT/$name.log)"
}
run 64gpu-chat-2x chat 266.43 22.9428 "colocated-64[chunk=8192],43P21D,53P11D,32P32D-adaptive,43P21D-adaptive"
run 64gpu-prefill-heavy-1x prefill-heavy 166.168 11.7824 "colocated-64[chunk=8192],56P8D,56P8D-adaptive"
run 64gpu-decode-heavy-1x decode-heavy 66.0932 11.1873 "colocated-64[chunk=8192],8P56D,8P56D-adaptive"
