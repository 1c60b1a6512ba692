#!/usr/bin/env bash
# The simulated side of this record's accuracy table (CPU, ~1 minute): the measured runs'
# workloads, seeds, counts, rates and SLOs, on the profile measured before them.
# Usage: bash benchmarks/records/simulator-accuracy-2026-11-27/simulate.sh [OUT]
set -euo pipefail
HERE=$(dirname "$0")
OUT=${1:-results/simulator-accuracy}
P=$HERE/profile-h100-full-graphs.json
mkdir -p "$OUT"
P32K=$OUT/profile-ctx33792.json  # the same profile, its engine's context limit raised to 33,792
python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d['engine']['max_model_len'] = 33792; \
json.dump(d, open(sys.argv[2], 'w'))" "$P" "$P32K"
HOPS="--hop-ms 7 --step-gap-ms 0.1"  # the traces' hops outside the engine (README) and step gap
SIM="python3 -m disagg.cluster.cli simulate"
C=configs/llama3-8b-1gpu-colocated.yaml
$SIM $C --profile $P $HOPS --dataset-name chat --num-prompts 120 --request-rate 6,10,14 \
  --goodput ttft:1000 tpot:50 --result-dir "$OUT/chat" > /dev/null &
$SIM $C --profile $P $HOPS --dataset-name prefill-heavy --num-prompts 120 --request-rate 8,14,20 \
  --goodput ttft:1000 tpot:50 --result-dir "$OUT/ph" > /dev/null &
$SIM $C --profile $P $HOPS --dataset-name decode-heavy --num-prompts 80 --request-rate 4,8,12 \
  --goodput ttft:1000 tpot:50 --result-dir "$OUT/dh" > /dev/null &
# Long prompts need an engine of 33,792-token contexts (the profiled one holds 8,192 and the
# simulator would clip the prompts): the step model is the same, its contexts extrapolated.
$SIM configs/llama3.1-8b-colocated.yaml --set instances.colocated=1 --profile $P32K $HOPS \
  --dataset-name long-prompt --num-prompts 24 --request-rate 0.5,1,1.5 --goodput ttft:5000 tpot:100 \
  --result-dir "$OUT/lp" > /dev/null &
wait
