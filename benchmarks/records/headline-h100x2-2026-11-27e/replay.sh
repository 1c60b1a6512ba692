#!/usr/bin/env bash
# The simulator replaying this record's sitting: the same configs, settings, rates, run lengths
# (the same requests) and SLOs as measured, on the one-H100 grid profile of today's engine
# (../simulator-accuracy-2026-11-27/profile-h100-full-graphs.json; long-prompt on the same with
# its context limit raised to 33,792, as ../whowins-sim-2026-11-27d/ does). From the repository
# root, venv active (~1 min on 2 cores):
#   bash benchmarks/records/headline-h100x2-2026-11-27e/replay.sh
#   REPLAY_FLAGS="--reserve-ms 8" OUTD=results/replay-27e-r8 bash benchmarks/records/headline-h100x2-2026-11-27e/replay.sh
# The sitting's router is b30edfa's (before the seats): replay its runs with that
# cluster/placement.py and cluster/placer.py (`git show b30edfa:PATH > PATH`, restored afterwards).
#   python3 benchmarks/summarize_runs.py --table results/replay-27e/*
set -euo pipefail
OUTD=${OUTD:-results/replay-27e}
P=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json
X=${TMPDIR:-/tmp}/replay-27e-profile-ctx33792.json  # generated, not kept
python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d['engine']['max_model_len'] = 33792; \
json.dump(d, open(sys.argv[2], 'w'))" "$P" "$X"
sim() {  # PROFILE WORKLOAD LABEL CONFIG RATES SECONDS MIN_PROMPTS TTFT TPOT [--set ...]
  local prof=$1 w=$2 label=$3 config=$4 rates=$5 secs=$6 minp=$7 ttft=$8 tpot=$9; shift 9
  python3 -m disagg.cluster.cli simulate "$config" --profile "$prof" --dataset-name "$w" \
    --num-prompts 1000 --run-seconds "$secs" --min-prompts "$minp" --hop-ms 6 --step-gap-ms 0.17 ${REPLAY_FLAGS:-} \
    --request-rate "$rates" --goodput "ttft:$ttft" --goodput "tpot:$tpot" --label "$label" \
    --result-dir "$OUTD/$w/$label" "$@" > /dev/null 2>&1 || echo "$w $label: rc $?"
}
# decode-heavy: SLOs 85.7555 : 14.9512 ms calibrated on 1P1D; the router targets 1x
t=(--set router.placement=adaptive --set router.slo_ttft_ms=85.7555 --set router.slo_tpot_ms=14.9512)
sim "$P" decode-heavy 1p1d configs/llama3-8b-1p1d.yaml 14 20 16 85.7555 14.9512 &
sim "$P" decode-heavy adaptive configs/llama3-8b-1p1d.yaml 16,22 20 16 85.7555 14.9512 "${t[@]}" &
wait
sim "$P" decode-heavy adaptive-balanced configs/llama3-8b-1p1d.yaml 16,22 20 16 85.7555 14.9512 "${t[@]}" \
  --set router.adaptive_prefer=balanced &
sim "$P" decode-heavy colocated-8192 configs/llama3-8b-colocated.yaml 16,22 20 16 85.7555 14.9512 &
wait
# long-prompt: SLOs 1529.66 : 18.1971 ms calibrated on 1P1D; every disaggregated fleet remote-first
t=(--set router.placement=adaptive --set router.slo_ttft_ms=1529.66 --set router.slo_tpot_ms=18.1971)
r=(--set router.adaptive_prefer=remote)
sim "$X" long-prompt 1p1d configs/llama3.1-8b-1p1d.yaml 0.5,0.8 30 8 1529.66 18.1971 "${r[@]}" &
sim "$X" long-prompt adaptive configs/llama3.1-8b-1p1d.yaml 0.5,0.8 30 8 1529.66 18.1971 "${r[@]}" "${t[@]}" &
wait
sim "$X" long-prompt adaptive-fastest configs/llama3.1-8b-1p1d.yaml 0.5,0.8 30 8 1529.66 18.1971 "${t[@]}" &
sim "$X" long-prompt colocated-8192 configs/llama3.1-8b-colocated.yaml 0.5,0.8 30 8 1529.66 18.1971 &
wait
echo "replays in $OUTD"
