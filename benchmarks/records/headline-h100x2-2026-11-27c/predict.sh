#!/usr/bin/env bash
# The simulator's prediction of every sitting of this record, made before it ran (issue 27,
# item 3): the same configs, settings, rates, run lengths and SLOs (the previous sitting's
# calibration, ../headline-h100x2-2026-11-27b/: chat 95.7 : 15.5 ms, decode-heavy 89.6 : 15.0;
# long-prompt the plan's 712 : 18), on two profiles: the grid profile of one H100
# (../simulator-2026-11-27b/profile-h100-v2.json) and the same refitted on the steps the two
# H100s served in the previous chat sitting (profile-h100-served.json, `disagg profile --refit
# ... --served-steps`), with the served trace's 0.9 ms gap between steps and 6 ms of hops.
#   bash benchmarks/records/headline-h100x2-2026-11-27c/predict.sh    # ~3 min on 2 cores
#   python3 benchmarks/records/headline-h100x2-2026-11-27c/summarize.py predictions
set -euo pipefail
HERE=benchmarks/records/headline-h100x2-2026-11-27c
OUTD=${OUTD:-results/predict-27c}
declare -A PROFILES=([grid]=benchmarks/records/simulator-2026-11-27b/profile-h100-v2.json
                     [served]=$HERE/profile-h100-served.json)
sim() {  # PROFILE_TAG WORKLOAD LABEL CONFIG RATES SECONDS MIN_PROMPTS TTFT TPOT [--set ...]
  local tag=$1 w=$2 label=$3 config=$4 rates=$5 secs=$6 minp=$7 ttft=$8 tpot=$9; shift 9
  python3 -m disagg.cluster.cli simulate "$config" --profile "${PROFILES[$tag]}" --dataset-name "$w" \
    --num-prompts 1000 --run-seconds "$secs" --min-prompts "$minp" --hop-ms 6 --step-gap-ms 0.9 \
    --request-rate "$rates" --goodput "ttft:$ttft" --goodput "tpot:$tpot" --label "$label" \
    --result-dir "$OUTD/$tag/$w/$label" "$@" > /dev/null 2>&1 || echo "$tag $w $label: rc $?"
}
adaptive() {  # TTFT TPOT (the router's targets)
  echo --set router.placement=adaptive --set "router.slo_ttft_ms=$1" --set "router.slo_tpot_ms=$2"
}
for tag in grid served; do
  c2048=(--set scheduler.max_num_batched_tokens=2048)
  # chat: CHUNK_DISAGG=2048, the adaptive router targets 2x (191.4 : 31)
  sim $tag chat 1p1d configs/llama3-8b-1p1d.yaml 13 20 16 95.7 15.5 "${c2048[@]}" &
  sim $tag chat adaptive configs/llama3-8b-1p1d.yaml 21,28 20 16 95.7 15.5 "${c2048[@]}" $(adaptive 191.4 31) &
  sim $tag chat adaptive-remote configs/llama3-8b-1p1d.yaml 21,28 20 16 95.7 15.5 "${c2048[@]}" \
    $(adaptive 191.4 31) --set router.adaptive_prefer=remote &
  sim $tag chat colocated-8192 configs/llama3-8b-colocated.yaml 24,27,30 20 16 95.7 15.5 &
  wait
  # decode-heavy: chunk 8192, the adaptive router targets 1x
  sim $tag decode-heavy 1p1d configs/llama3-8b-1p1d.yaml 14 20 16 89.6 15.0 &
  sim $tag decode-heavy adaptive configs/llama3-8b-1p1d.yaml 16,22 20 16 89.6 15.0 $(adaptive 89.6 15.0) &
  sim $tag decode-heavy adaptive-remote configs/llama3-8b-1p1d.yaml 16,22 20 16 89.6 15.0 \
    $(adaptive 89.6 15.0) --set router.adaptive_prefer=remote &
  sim $tag decode-heavy colocated-8192 configs/llama3-8b-colocated.yaml 16,22,28 20 16 89.6 15.0 &
  wait
  # long-prompt (llama3.1-8b, 8k prompts): the adaptive router targets 1x
  sim $tag long-prompt 1p1d configs/llama3.1-8b-1p1d.yaml 0.3,0.5,0.7 30 8 712 18 &
  sim $tag long-prompt adaptive configs/llama3.1-8b-1p1d.yaml 0.5,0.8,1.4 30 8 712 18 $(adaptive 712 18) &
  sim $tag long-prompt colocated-8192 configs/llama3.1-8b-colocated.yaml 0.4,0.8,1.4 30 8 712 18 &
  wait
done
echo "predictions in $OUTD"
