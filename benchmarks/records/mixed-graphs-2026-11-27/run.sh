#!/usr/bin/env bash
# The commands of this record, on one GPU (source .whl/gpu-env.sh first). "old" = the defaults
# before this change; the new defaults need no --set.
set -u
OUT=${OUT:-results/mixed-graphs}
mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/engine/test_engine_gpu.py
python3 -m pytest -q -m multigpu tests/engine tests/cluster/test_cluster_gpu.py
python3 benchmarks/bench_engine.py --only short --batches 24 --contexts 1024 --out "$OUT/short.json"
OLD="--set scheduler.cuda_graphs=full_and_piecewise --set scheduler.async_prompts=false"
B="python3 -m disagg.cluster.cli bench configs/llama3-8b-1gpu-colocated.yaml --no-compare"
$B --dataset-name decode-heavy --num-prompts 45 --request-rate 3 > "$OUT/dh-new.log" 2>&1
$B --dataset-name decode-heavy --num-prompts 45 --request-rate 3 $OLD > "$OUT/dh-old.log" 2>&1
$B --dataset-name chat --num-prompts 80 --request-rate 8 > "$OUT/chat-new.log" 2>&1
$B --dataset-name chat --num-prompts 80 --request-rate 8 $OLD > "$OUT/chat-old.log" 2>&1
$B --dataset-name shared-prefix --num-prompts 64 --request-rate 4 > "$OUT/sp4-new-cached.log" 2>&1
$B --dataset-name shared-prefix --num-prompts 64 --request-rate 4 $OLD > "$OUT/sp4-old-cached.log" 2>&1
$B --dataset-name shared-prefix --num-prompts 64 --request-rate 4 --set cache.prefix_caching=false \
  > "$OUT/sp4-new-uncached.log" 2>&1
$B --dataset-name shared-prefix --num-prompts 96 --request-rate 8,12,14 > "$OUT/sp-cached.log" 2>&1
$B --dataset-name shared-prefix --num-prompts 96 --request-rate 8,12,14 --set cache.prefix_caching=false \
  > "$OUT/sp-uncached.log" 2>&1
