#!/usr/bin/env bash
# H200 planning (issue 25): disagg plan on the sitting's grid profile, at the SLOs calibrated there.
set -u
cd "$(git rev-parse --show-toplevel)" && source .venv/bin/activate  # from the repository
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
OUT=${OUT:-results/plan-h200}; mkdir -p $OUT
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8"
run() { # name gpus dataset ttft tpot [extra]
  local name=$1 gpus=$2 ds=$3 t=$4 p=$5; shift 5
  ( time python3 -m disagg.cluster.cli plan --profile $P --dataset-name $ds --goodput ttft:$t tpot:$p --gpus $gpus $H "$@" --out $OUT/$name.yaml ) > $OUT/$name.log 2>&1
  echo "$name done: $(grep real $OUT/$name.log)"
}
run 2gpu-chat-1x 2 chat 133.215 11.4714 --seeds 3 --jobs 2
run 2gpu-chat-2x 2 chat 266.43 22.9428 --seeds 3 --jobs 2
run 2gpu-prefill-heavy-1x 2 prefill-heavy 166.168 11.7824 --seeds 3 --jobs 2
run 2gpu-prefill-heavy-2x 2 prefill-heavy 332.336 23.5648 --seeds 3 --jobs 2
run 2gpu-decode-heavy-1x 2 decode-heavy 66.0932 11.1873 --seeds 3 --jobs 2
run 2gpu-decode-heavy-2x 2 decode-heavy 132.186 22.3746 --seeds 3 --jobs 2
run 8gpu-chat-2x 8 chat 266.43 22.9428 --jobs 2 --adaptive-chunk-sizes 8192
