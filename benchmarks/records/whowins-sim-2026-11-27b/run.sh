#!/usr/bin/env bash
# The two-GPU who-wins rows of whowins-sim-2026-11-27, re-planned on today's main with 3 draws per
# rate (`--seeds 3`), two rows at a time. From the repository root:
#   bash benchmarks/records/whowins-sim-2026-11-27b/run.sh [TAG ...]    (default: every row)
set -euo pipefail
HERE=${HERE:-benchmarks/records/whowins-sim-2026-11-27b}  # the record whose logs/ these go to
P=${P:-benchmarks/records/simulator-2026-11-27b/profile-h100-v2.json}              # the step profile
X=${X:-benchmarks/records/whowins-sim-2026-11-27/profile-h100-v2-ctx33792.json}  # its 33,792-token copy
declare -A ROWS=(
  [chat-s]="$P chat 74 17"            [chat-r]="$P chat 148 34"
  [ph-s]="$P prefill-heavy 149 17"    [ph-r]="$P prefill-heavy 298 34"
  [dh-s]="$P decode-heavy 25 17"      [dh-r]="$P decode-heavy 50 34"
  [lp-s]="$P long-prompt 712 18"      [lp-r]="$P long-prompt 1424 36"
  [lpx-s]="$X long-prompt 2470 19"    [lpx-r]="$X long-prompt 4940 38"
)
TAGS=("$@"); [ ${#TAGS[@]} -gt 0 ] || TAGS=(dh-r dh-s chat-r chat-s ph-r ph-s lp-r lp-s lpx-r lpx-s)
one() {
  read -r prof w ttft tpot <<< "${ROWS[$1]}"
  python -m disagg.cluster.cli plan --profile "$prof" --gpus 2 --dataset-name "$w" \
    --goodput "ttft:$ttft" "tpot:$tpot" --chunk-sizes 512,2048,8192 --seeds 3 ${PLAN_FLAGS:-} > "$HERE/logs/$1.log" 2>&1
}
for ((i = 0; i < ${#TAGS[@]}; i += 2)); do
  one "${TAGS[i]}" & [ $((i + 1)) -lt ${#TAGS[@]} ] && one "${TAGS[i + 1]}" & wait
done
