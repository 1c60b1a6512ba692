#!/usr/bin/env bash
# The simulator replaying this record's measured chat and decode-heavy runs: the same configs,
# settings, rates, run lengths (the same requests), SLOs and router targets as measured, on two
# profiles: the grid profile of one H100 (../simulator-2026-11-27b/profile-h100-v2.json) and the
# same refitted on the steps the two H100s served in the previous chat sitting
# (profile-h100-served.json, `disagg profile --refit ... --served-steps`), with the served
# trace's 0.9 ms between steps and 6 ms of hops. From the repository root, venv active:
#   bash benchmarks/records/headline-h100x2-2026-11-27c/replay.sh        # ~4 min on 2 cores
#   python3 benchmarks/summarize_runs.py --table results/replay-27c/*
set -euo pipefail
HERE=benchmarks/records/headline-h100x2-2026-11-27c
OUTD=${OUTD:-results/replay-27c}
declare -A PROFILES=([grid]=benchmarks/records/simulator-2026-11-27b/profile-h100-v2.json
                     [served]=$HERE/profile-h100-served.json
                     [full]=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json)
TAGS=${TAGS:-grid served}  # TAGS=full: the engine with whole mixed graphs (predictions for the next sitting)
sim() {  # PROFILE_TAG WORKLOAD LABEL CONFIG RATES TTFT TPOT [--set ...]
  local tag=$1 w=$2 label=$3 config=$4 rates=$5 ttft=$6 tpot=$7; shift 7
  python3 -m disagg.cluster.cli simulate "$config" --profile "${PROFILES[$tag]}" --dataset-name "$w" \
    --num-prompts 1000 --run-seconds 20 --min-prompts 16 --hop-ms 6 --step-gap-ms 0.9 \
    --request-rate "$rates" --goodput "ttft:$ttft" --goodput "tpot:$tpot" --label "$label" \
    --result-dir "$OUTD/$tag/$w/$label" "$@" > /dev/null 2>&1 || echo "$tag $w $label: rc $?"
}
adaptive=(--set router.placement=adaptive)
for tag in $TAGS; do
  # chat (SLOs 77.9491 : 15.1771 ms calibrated on 1P1D; CHUNK_DISAGG=2048; the router targets 2x)
  c=(--set scheduler.max_num_batched_tokens=2048)
  t=(--set router.slo_ttft_ms=155.8982 --set router.slo_tpot_ms=30.3542)
  sim $tag chat 1p1d configs/llama3-8b-1p1d.yaml 13 77.9491 15.1771 "${c[@]}" &
  sim $tag chat adaptive configs/llama3-8b-1p1d.yaml 21,28 77.9491 15.1771 "${c[@]}" "${adaptive[@]}" "${t[@]}" &
  sim $tag chat adaptive-remote configs/llama3-8b-1p1d.yaml 21,28 77.9491 15.1771 "${c[@]}" "${adaptive[@]}" "${t[@]}" \
    --set router.adaptive_prefer=remote &
  sim $tag chat adaptive-balanced configs/llama3-8b-1p1d.yaml 21,28 77.9491 15.1771 "${c[@]}" "${adaptive[@]}" "${t[@]}" \
    --set router.adaptive_prefer=balanced &
  wait
  sim $tag chat colocated-8192 configs/llama3-8b-colocated.yaml 24,27 77.9491 15.1771 &
  # decode-heavy (SLOs 70.699 : 14.8713 ms; chunk 8192; the router targets 1x)
  t=(--set router.slo_ttft_ms=70.699 --set router.slo_tpot_ms=14.8713)
  sim $tag decode-heavy 1p1d configs/llama3-8b-1p1d.yaml 14 70.699 14.8713 &
  sim $tag decode-heavy adaptive configs/llama3-8b-1p1d.yaml 16,22,28 70.699 14.8713 "${adaptive[@]}" "${t[@]}" &
  wait
  sim $tag decode-heavy adaptive-balanced configs/llama3-8b-1p1d.yaml 16,22,28 70.699 14.8713 "${adaptive[@]}" "${t[@]}" \
    --set router.adaptive_prefer=balanced &
  sim $tag decode-heavy colocated-8192 configs/llama3-8b-colocated.yaml 16,22,28 70.699 14.8713 &
  wait
done
echo "replays in $OUTD"
