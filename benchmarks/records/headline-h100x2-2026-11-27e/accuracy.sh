#!/usr/bin/env bash
# The two-GPU accuracy table (issue 25): the sitting's measured runs against replay.sh's, per
# deployment and rate (p50 / p99 TTFT, mean TPOT, goodput), with the one-GPU record's table.py.
#   bash benchmarks/records/headline-h100x2-2026-11-27e/accuracy.sh MEASURED_ROOT SIM_ROOT
# MEASURED_ROOT: the sitting's results/ (decode-heavy/<deployment>/, long-prompt/<deployment>/,
# from the tars of section 2); SIM_ROOT: replay.sh's OUTD.
set -euo pipefail
M=$1 S=$2 T=${TMPDIR:-/tmp}/accuracy-27e
rm -rf "$T" && mkdir -p "$T/m" "$T/s"
for side in m s; do
  root=$M; [ $side = s ] && root=$S
  for run in "$root"/decode-heavy/*/ "$root"/long-prompt/*/; do
    dep=$(basename "$run"); [ "$dep" = merged ] && continue
    w=$(basename "$(dirname "$run")")
    ls "$run"/*qps*.json > /dev/null 2>&1 || continue
    mkdir -p "$T/$side/${w%%-*}-$dep" && cp "$run"/*qps*.json "$T/$side/${w%%-*}-$dep/"
  done
done
python3 benchmarks/records/simulator-accuracy-2026-11-27/table.py "$T/m" "$T/s"
