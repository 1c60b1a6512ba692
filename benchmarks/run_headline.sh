#!/usr/bin/env bash
# One run of the headline comparison (benchmarks/records/runbooks/HEADLINE.md) on two H200s:
# one deployment x one workload, under 10 minutes, results tarred into $OUT.
# Usage (the GPU wheels in .whl/):
#   source .whl/gpu-env.sh && bash benchmarks/run_headline.sh WORKLOAD 1p1d [BUDGET]
#   source .whl/gpu-env.sh && SLO_TTFT=<ms> SLO_TPOT=<ms> bash benchmarks/run_headline.sh WORKLOAD colocated CHUNK
# WORKLOAD: chat | prefill-heavy | decode-heavy | long-prompt. `1p1d` without BUDGET calibrates
# the SLOs (printed as "SLOs {...}" and stored in every result); every other run of the
# workload is judged by them: pass them as SLO_TTFT / SLO_TPOT. BUDGET (1p1d) or CHUNK
# (colocated) sets scheduler.max_num_batched_tokens, the variant the merge picks the best of.
# Then here, on the CPU, after unpacking every tarball under results/:
#   disagg bench --from-results results/W/* --slo-scales 1,2 --result-dir results/W
set -euo pipefail
W=${1:?workload}; SIDE=${2:?1p1d or colocated}; BUDGET=${3:-}
OUT=${OUT:-results/headline}
mkdir -p "$OUT"
case $W in
  chat|decode-heavy) RATES=1,2,4,6,8,12,16,24; MODEL=llama3-8b; MIN=30 ;;
  prefill-heavy) RATES=1,2,4,6,8,12,16; MODEL=llama3-8b; MIN=30 ;;
  # Long prompts (8k-32k): one colocated H200 served 0.5 req/s with a 252 ms p99 ITL
  # (benchmarks/records/engine-2026-11-25), so the sweep starts low; 8 requests at least per rate
  # keep the low rates inside the 10 minutes.
  long-prompt) RATES=0.1,0.2,0.3,0.5,0.75,1,1.5,2; MODEL=llama3.1-8b; MIN=8 ;;
  *) echo "unknown workload $W" >&2; exit 2 ;;
esac
# Smoke check on the CPU: HEADLINE_MODEL=tiny HEADLINE_RATES=2 HEADLINE_SECONDS=3 (tiny-*.yaml).
MODEL=${HEADLINE_MODEL:-$MODEL}; RATES=${HEADLINE_RATES:-$RATES}
case $SIDE in
  1p1d) CONFIG=configs/$MODEL-1p1d.yaml ;;
  colocated) CONFIG=configs/$MODEL-colocated.yaml; : "${BUDGET:?colocated needs a CHUNK}" ;;
  *) echo "unknown side $SIDE" >&2; exit 2 ;;
esac
args=(--no-compare --dataset-name "$W" --request-rate "$RATES" --early-stop
      --run-seconds "${HEADLINE_SECONDS:-30}" --min-prompts "$MIN" --num-prompts 1000 --num-warmups 16 --slo-scales 1,2 --save-result
      --disable-tqdm)
label=$SIDE${BUDGET:+-$BUDGET}
[ -n "$BUDGET" ] && args+=(--set "scheduler.max_num_batched_tokens=$BUDGET")
if [ "$SIDE" = 1p1d ] && [ -z "$BUDGET" ] && [ -z "${SLO_TTFT:-}" ]; then
  args+=(--slo-calibrate)
else
  args+=(--goodput "ttft:${SLO_TTFT:?the SLOs of the calibrating 1p1d run}" --goodput "tpot:${SLO_TPOT:?}")
fi
nvidia-smi -L || true
status=0
timeout 560 python3 -m disagg.cluster.cli.app bench "$CONFIG" "${args[@]}" \
  --result-dir "results/$W/$label" 2>&1 | tee "$OUT/$W-$label.log" | grep -v '^\s*$' | tail -60 || status=$?
tar czf "$OUT/$W-$label.tgz" "results/$W/$label" "$OUT/$W-$label.log"
echo "headline $W $label: rc $status; $OUT/$W-$label.tgz"
exit "$status"
