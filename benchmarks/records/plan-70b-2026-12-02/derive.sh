# Derive the H200 profiles of llama3-70b (llama3.1-70b for the 32k-context long-prompt workload) and
# qwen2.5-32b from the measured llama3-8b-shaped TP 1 profiles, into $1 (default /tmp/plan-70b):
# CPU arithmetic, a second each. The profiles are not committed: this makes them again, the same.
set -e
O=${1:-/tmp/plan-70b}; mkdir -p $O
# The 8B planning table's profiles (docs/results.md): chat and prefill-heavy, long-prompt.
P8=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
P32K=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json
for k in 2 4 8; do
  disagg profile --derive $P8 --model dummy:llama3-70b --tensor-parallel $k --out $O/llama3-70b-tp$k.json > /dev/null
  disagg profile --derive $P32K --model dummy:llama3.1-70b --tensor-parallel $k --out $O/llama3.1-70b-tp$k.json > /dev/null
done
for k in 1 2 4 8; do
  disagg profile --derive $P8 --model dummy:qwen2.5-32b --tensor-parallel $k --out $O/qwen2.5-32b-tp$k.json > /dev/null
  disagg profile --derive $P32K --model dummy:qwen2.5-32b --tensor-parallel $k --out $O/qwen2.5-32b-32k-tp$k.json > /dev/null
done
# TP 1 of a 70B: refused (141 GB of bf16 weights on a 141 GB GPU); the message says why.
disagg profile --derive $P8 --model dummy:llama3-70b --tensor-parallel 1 --out $O/refused.json 2>&1 | tail -1 || true
