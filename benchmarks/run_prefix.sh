#!/usr/bin/env bash
# The prefix cache's benchmark on one GPU, one command: shared-prefix (2048-token shared prompt, 128-token
# questions) with the prefix cache on and off, colocated over a rate sweep (median TTFT ratio per
# rate), then 1P1D with both instances sharing the GPU (pushed bytes per request, cache on/off).
#   source .whl/gpu-env.sh && RATES=4,8,12 bash benchmarks/run_prefix.sh
# Results and logs land under ${OUT:-results/prefix} (one directory per run).
set -euo pipefail
OUT=${OUT:-results/prefix}
RATES=${RATES:-4,8,12}
NUM=${NUM:-128}
NUM_1P1D=${NUM_1P1D:-48}
RATE_1P1D=${RATE_1P1D:-4}
T=${PER_RUN_TIMEOUT:-240}
bench() { timeout "$T" python3 -m disagg.cluster.cli.app bench "$@"; }
for on in true false; do
  bench configs/llama3-8b-1gpu-colocated.yaml --no-compare --dataset-name shared-prefix \
    --num-prompts "$NUM" --request-rate "$RATES" --set cache.prefix_caching=$on \
    --label colocated-prefix-$on --save-result --result-dir "$OUT/colocated-prefix-$on" \
    > "$OUT/colocated-prefix-$on.log" 2>&1 || echo "colocated prefix=$on failed: see its log"
done
for on in true false; do
  bench configs/llama3-8b-1gpu-1p1d.yaml --no-compare --dataset-name shared-prefix \
    --num-prompts "$NUM_1P1D" --request-rate "$RATE_1P1D" --set cache.prefix_caching=$on \
    --label 1p1d-prefix-$on --save-result --result-dir "$OUT/1p1d-prefix-$on" \
    > "$OUT/1p1d-prefix-$on.log" 2>&1 || echo "1p1d prefix=$on failed: see its log"
done
python3 benchmarks/prefix_report.py "$OUT"
