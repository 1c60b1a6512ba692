#!/usr/bin/env bash
# The 64-GPU planning rows of session s (issue 25): one `disagg plan --only` run per candidate,
# one after the other (session s ran two of these queues beside each other on two cores). START:
# the --start-rate, req/s per GPU (session s: 8; 12 for decode-heavy's adaptive candidate).
#   bash benchmarks/records/plan-h200-2026-11-29/plan64.sh chat-43a ph-56a chat-53
set -u
cd "$(git rev-parse --show-toplevel)"
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
OUT=${OUT:-results/plan64}; mkdir -p "$OUT"
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --adaptive-chunk-sizes 8192 --jobs 1 --start-rate ${START:-8}"
run() { # name dataset ttft tpot only
  local name=$1 ds=$2 t=$3 p=$4 only=$5
  ( time nice -n 5 .venv/bin/python -m disagg.cluster.cli plan --profile $P --dataset-name $ds --goodput ttft:$t tpot:$p --gpus 64 $H --only "$only" --out $OUT/$name.yaml ) > $OUT/$name.log 2>&1
  echo "$name done $(date +%T): $(grep real $OUT/$name.log)"
}
for job in "$@"; do
  case $job in
    chat-43a) run chat-43P21D-adaptive chat 266.43 22.9428 "43P21D-adaptive" ;;
    chat-32a) run chat-32P32D-adaptive chat 266.43 22.9428 "32P32D-adaptive" ;;
    chat-53) run chat-53P11D chat 266.43 22.9428 "53P11D" ;;
    ph-56a) run ph-56P8D-adaptive prefill-heavy 166.168 11.7824 "56P8D-adaptive" ;;
    dh-colo) run dh-colocated-64 decode-heavy 66.0932 11.1873 "colocated-64[chunk=8192]" ;;
    dh-8) run dh-8P56D decode-heavy 66.0932 11.1873 "8P56D" ;;
    dh-8a) run dh-8P56D-adaptive decode-heavy 66.0932 11.1873 "8P56D-adaptive" ;;
    *) echo "unknown job $job (chat-43a chat-32a chat-53 ph-56a dh-colo dh-8 dh-8a)" >&2; exit 2 ;;
  esac
done
