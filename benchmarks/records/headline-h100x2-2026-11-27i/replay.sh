#!/usr/bin/env bash
# The simulator replaying this record's sitting (77400dc): the same configs, settings, rates, run
# lengths and SLOs as measured, on the one-H100 grid profile of the engine
# (../simulator-accuracy-2026-11-27/profile-h100-full-graphs.json), with the traced hops and the
# reservation round trip of ../headline-h100x2-2026-11-27e/ (--hop-ms 6 --step-gap-ms 0.17
# --reserve-ms 8). From the repository root, venv active (~2 min on 2 cores):
#   bash benchmarks/records/headline-h100x2-2026-11-27i/replay.sh
#   python3 benchmarks/summarize_runs.py results/replay-27i/* > replay.json
set -euo pipefail
OUTD=${OUTD:-results/replay-27i}
P=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json
sim() {  # WORKLOAD LABEL CONFIG RATES TTFT TPOT [--set ...]
  local w=$1 label=$2 config=$3 rates=$4 ttft=$5 tpot=$6; shift 6
  python3 -m disagg.cluster.cli simulate "$config" --profile "$P" --dataset-name "$w" \
    --num-prompts 1000 --run-seconds 20 --min-prompts 16 --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 \
    ${REPLAY_FLAGS:-} --request-rate "$rates" --goodput "ttft:$ttft" --goodput "tpot:$tpot" --label "$label" \
    --result-dir "$OUTD/$w/$label" "$@" > /dev/null 2>&1 || echo "$w $label: rc $?"
}
# decode-heavy, 256 seats everywhere (SET_ALL), SLOs 80.0074 : 14.8682 calibrated on 1P1D; the
# adaptive fleet `balanced` (SET_DISAGG), targeting 1x
s=(--set scheduler.max_num_seqs=256)
a=(--set router.placement=adaptive --set router.slo_ttft_ms=80.0074 --set router.slo_tpot_ms=14.8682
   --set router.adaptive_prefer=balanced)
sim decode-heavy 1p1d configs/llama3-8b-1p1d.yaml 14 80.0074 14.8682 "${s[@]}" &
sim decode-heavy adaptive configs/llama3-8b-1p1d.yaml 26,30,34 80.0074 14.8682 "${s[@]}" "${a[@]}" &
wait
sim decode-heavy colocated-8192 configs/llama3-8b-colocated.yaml 26,30,34 80.0074 14.8682 "${s[@]}" &
# chat: SLOs 149.275 : 15.1462; disaggregated side's prefill budget 2048; the router targets 2x
c=(--set scheduler.max_num_batched_tokens=2048)
a=(--set router.placement=adaptive --set router.slo_ttft_ms=298.55 --set router.slo_tpot_ms=30.2924)
sim chat 1p1d configs/llama3-8b-1p1d.yaml 13 149.275 15.1462 "${c[@]}" &
wait
sim chat adaptive configs/llama3-8b-1p1d.yaml 21,28 149.275 15.1462 "${c[@]}" "${a[@]}" &
sim chat adaptive-balanced configs/llama3-8b-1p1d.yaml 21,28 149.275 15.1462 "${c[@]}" "${a[@]}" \
  --set router.adaptive_prefer=balanced &
wait
sim chat colocated-8192 configs/llama3-8b-colocated.yaml 24,28 149.275 15.1462 &
# prefill-heavy: SLOs 167.69 : 15.5534; the router (`fastest`) targets 1x
a=(--set router.placement=adaptive --set router.slo_ttft_ms=167.69 --set router.slo_tpot_ms=15.5534)
sim prefill-heavy 1p1d configs/llama3-8b-1p1d.yaml 8 167.69 15.5534 &
wait
sim prefill-heavy adaptive configs/llama3-8b-1p1d.yaml 12,16 167.69 15.5534 "${a[@]}" &
sim prefill-heavy colocated-8192 configs/llama3-8b-colocated.yaml 12,16 167.69 15.5534 &
wait
echo "replays in $OUTD"
