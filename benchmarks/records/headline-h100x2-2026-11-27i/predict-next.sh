#!/usr/bin/env bash
# Predictions for the next two-GPU sitting (section 6 of the README), made before it at the tree
# that sitting will run (8b4ecc9 or later: the prediction with P's step in flight; the simulator's
# dispatch already went on while reservations were answered), at this record's SLOs (the sitting
# recalibrates: replay at its own SLOs before comparing). HEADLINE_SECONDS=30 as the command sets.
# From the repository root, venv active (~1 min on 2 cores):
#   bash benchmarks/records/headline-h100x2-2026-11-27i/predict-next.sh
#   python3 benchmarks/summarize_runs.py results/predict-27j/* > predict-next.json
set -euo pipefail
OUTD=${OUTD:-results/predict-27j}
P=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json
sim() {  # WORKLOAD LABEL CONFIG RATES SECONDS TTFT TPOT [--set ...]
  local w=$1 label=$2 config=$3 rates=$4 secs=$5 ttft=$6 tpot=$7; shift 7
  python3 -m disagg.cluster.cli simulate "$config" --profile "$P" --dataset-name "$w" \
    --num-prompts 1000 --run-seconds "$secs" --min-prompts 16 --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 \
    --request-rate "$rates" --goodput "ttft:$ttft" --goodput "tpot:$tpot" --label "$label" \
    --result-dir "$OUTD/$w/$label" "$@" > /dev/null 2>&1 || echo "$w $label: rc $?"
}
s=(--set scheduler.max_num_seqs=256)
a=(--set router.placement=adaptive --set router.slo_ttft_ms=80.0074 --set router.slo_tpot_ms=14.8682
   --set router.adaptive_prefer=balanced)
sim decode-heavy 1p1d configs/llama3-8b-1p1d.yaml 14 30 80.0074 14.8682 "${s[@]}" &
sim decode-heavy adaptive configs/llama3-8b-1p1d.yaml 26,30 30 80.0074 14.8682 "${s[@]}" "${a[@]}" &
wait
sim decode-heavy colocated-8192 configs/llama3-8b-colocated.yaml 26,30 30 80.0074 14.8682 "${s[@]}" &
a=(--set router.placement=adaptive --set router.slo_ttft_ms=167.69 --set router.slo_tpot_ms=15.5534)
sim prefill-heavy 1p1d configs/llama3-8b-1p1d.yaml 8 20 167.69 15.5534 &
wait
sim prefill-heavy adaptive configs/llama3-8b-1p1d.yaml 12,16 20 167.69 15.5534 "${a[@]}" &
sim prefill-heavy colocated-8192 configs/llama3-8b-colocated.yaml 12,16 20 167.69 15.5534 &
wait
echo "predictions in $OUTD"
