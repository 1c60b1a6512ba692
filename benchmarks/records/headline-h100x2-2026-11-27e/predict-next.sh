#!/usr/bin/env bash
# Predictions for the next two-GPU sitting (section 7 of the README), made before it: the router
# with seats (203a0ac) and the reservation round trip (--reserve-ms 8), on the one-H100 grid
# profile of today's engine, at the last calibrated SLOs of each workload (the sitting recalibrates:
# replay at its own SLOs before comparing, as replay.sh does for this one). From the repository
# root, venv active (~3 min on 2 cores):
#   bash benchmarks/records/headline-h100x2-2026-11-27e/predict-next.sh
#   python3 benchmarks/summarize_runs.py --table results/predict-27f/*
set -euo pipefail
OUTD=${OUTD:-results/predict-27f}
P=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json
X=${TMPDIR:-/tmp}/predict-27f-profile-ctx33792.json
python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d['engine']['max_model_len'] = 33792; \
json.dump(d, open(sys.argv[2], 'w'))" "$P" "$X"
sim() {  # PROFILE WORKLOAD LABEL CONFIG RATES SECONDS MIN_PROMPTS TTFT TPOT [--set ...]
  local prof=$1 w=$2 label=$3 config=$4 rates=$5 secs=$6 minp=$7 ttft=$8 tpot=$9; shift 9
  python3 -m disagg.cluster.cli simulate "$config" --profile "$prof" --dataset-name "$w" \
    --num-prompts 1000 --run-seconds "$secs" --min-prompts "$minp" --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 \
    --request-rate "$rates" --goodput "ttft:$ttft" --goodput "tpot:$tpot" --label "$label" \
    --result-dir "$OUTD/$w/$label" "$@" > /dev/null 2>&1 || echo "$w $label: rc $?"
}
a() { echo --set router.placement=adaptive --set "router.slo_ttft_ms=$1" --set "router.slo_tpot_ms=$2"; }
# decode-heavy at this record's SLOs (85.7555 : 14.9512), the router targeting 1x
dh=(85.7555 14.9512)
sim "$P" decode-heavy 1p1d configs/llama3-8b-1p1d.yaml 14 20 16 "${dh[@]}" &
sim "$P" decode-heavy adaptive configs/llama3-8b-1p1d.yaml 22,26,30 20 16 "${dh[@]}" $(a "${dh[@]}") &
wait
sim "$P" decode-heavy adaptive-balanced configs/llama3-8b-1p1d.yaml 22,26,30 20 16 "${dh[@]}" $(a "${dh[@]}") \
  --set router.adaptive_prefer=balanced &
sim "$P" decode-heavy colocated-8192 configs/llama3-8b-colocated.yaml 22,26,30 20 16 "${dh[@]}" &
wait
# chat at 27b's SLOs (95.7 : 15.5, calibrated uncached), the disaggregated side at 2048, the router targeting 2x
ch=(95.7 15.5); c=(--set scheduler.max_num_batched_tokens=2048)
sim "$P" chat 1p1d configs/llama3-8b-1p1d.yaml 13 20 16 "${ch[@]}" "${c[@]}" &
sim "$P" chat adaptive configs/llama3-8b-1p1d.yaml 21,28 20 16 "${ch[@]}" "${c[@]}" $(a 191.4 31.0) &
wait
sim "$P" chat adaptive-balanced configs/llama3-8b-1p1d.yaml 21,28 20 16 "${ch[@]}" "${c[@]}" $(a 191.4 31.0) \
  --set router.adaptive_prefer=balanced &
sim "$P" chat colocated-8192 configs/llama3-8b-colocated.yaml 24,28 20 16 "${ch[@]}" &
wait
# prefill-heavy at the SLOs of its last calibration (two H200s, 2026-11-23: 158 : 14.3), the router at 1x
ph=(158 14.3)
sim "$P" prefill-heavy 1p1d configs/llama3-8b-1p1d.yaml 8 20 16 "${ph[@]}" &
sim "$P" prefill-heavy adaptive configs/llama3-8b-1p1d.yaml 12,16 20 16 "${ph[@]}" $(a "${ph[@]}") &
wait
sim "$P" prefill-heavy adaptive-balanced configs/llama3-8b-1p1d.yaml 12,16 20 16 "${ph[@]}" $(a "${ph[@]}") \
  --set router.adaptive_prefer=balanced &
sim "$P" prefill-heavy colocated-8192 configs/llama3-8b-colocated.yaml 12,16 20 16 "${ph[@]}" &
wait
# long-prompt at this record's SLOs (1529.66 : 18.1971): the default `fastest`, not measured yet
lp=(1529.66 18.1971)
sim "$X" long-prompt adaptive-fastest configs/llama3.1-8b-1p1d.yaml 0.5,0.8,1.1 30 8 "${lp[@]}" $(a "${lp[@]}") &
sim "$X" long-prompt colocated-8192 configs/llama3.1-8b-colocated.yaml 0.5,0.8,1.1 30 8 "${lp[@]}" &
wait
echo "predictions in $OUTD"
