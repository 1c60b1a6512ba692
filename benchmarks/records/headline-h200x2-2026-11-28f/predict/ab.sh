#!/usr/bin/env bash
# usage: sim.sh TAG  (runs adaptive-only predictions of the sitting rates)
set -u
cd /work/main
T=$1; O=/work/scratch/s1/ab/$T; mkdir -p $O
P=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200.json
H="--hop-ms 6 --step-gap-ms 1.2 --reserve-ms 12"
export PYTHON=.venv/bin/python DEPLOYMENTS=adaptive
for seed in 0; do
PREDICT=$P SLOS=63.5742:11.333 HOPS="$H" SET_ALL=scheduler.max_num_seqs=256 RATES=27,28 OUT=$O/dh bash benchmarks/sitting_headline_workload.sh decode-heavy > $O/dh.out 2>&1
PREDICT=$P SLOS=137.834:11.605 HOPS="$H" RATES=26,30 CHUNK_DISAGG=2048 ADAPTIVE_SLO_SCALE=2 OUT=$O/chat bash benchmarks/sitting_headline_workload.sh chat > $O/chat.out 2>&1
PREDICT=$P SLOS=176.641:11.9944 HOPS="$H" RATES=12,14,16 OUT=$O/ph bash benchmarks/sitting_headline_workload.sh prefill-heavy > $O/ph.out 2>&1
PREDICT=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json SLOS=1535.33:13.9643 HOPS="$H" RATES=0.6,0.7,0.8,1.4 HEADLINE_SECONDS=30 MIN_PROMPTS=8 OUT=$O/lp bash benchmarks/sitting_headline_workload.sh long-prompt > $O/lp.out 2>&1
done
for w in dh chat ph lp; do grep "adaptive |" $O/$w/*-runs.md; done > $O/summary.md
echo done $T
