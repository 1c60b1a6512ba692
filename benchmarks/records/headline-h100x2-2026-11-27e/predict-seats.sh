#!/usr/bin/env bash
# Decode-heavy on two GPUs with 256 seats per engine (scheduler.max_num_seqs, 128 in the configs)
# against 128, every deployment, at this record's SLOs: the seat limit, not the GPUs, set the
# knee measured here (section 4). Router with seats, --reserve-ms 8. From the repository root,
# venv active (~3 min on 2 cores):
#   bash benchmarks/records/headline-h100x2-2026-11-27e/predict-seats.sh
#   python3 benchmarks/summarize_runs.py --table results/predict-seats/*
set -euo pipefail
OUTD=${OUTD:-results/predict-seats}
P=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json
sim() {  # LABEL CONFIG RATES [--set ...]
  local label=$1 config=$2 rates=$3; shift 3
  python3 -m disagg.cluster.cli simulate "$config" --profile "$P" --dataset-name decode-heavy \
    --num-prompts 1000 --run-seconds 20 --min-prompts 16 --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 \
    --request-rate "$rates" --goodput ttft:85.7555 --goodput tpot:14.9512 --label "$label" \
    --result-dir "$OUTD/$label" "$@" > /dev/null 2>&1 || echo "$label: rc $?"
}
a=(--set router.placement=adaptive --set router.slo_ttft_ms=85.7555 --set router.slo_tpot_ms=14.9512)
s=(--set scheduler.max_num_seqs=256)
sim 1p1d-256 configs/llama3-8b-1p1d.yaml 14,18 "${s[@]}" &
sim colocated-256 configs/llama3-8b-colocated.yaml 30,34,38 "${s[@]}" &
wait
sim adaptive-256 configs/llama3-8b-1p1d.yaml 30,34,38 "${s[@]}" "${a[@]}" &
sim adaptive-balanced-256 configs/llama3-8b-1p1d.yaml 30,34,38 "${s[@]}" "${a[@]}" --set router.adaptive_prefer=balanced &
wait
echo "predictions in $OUTD"
