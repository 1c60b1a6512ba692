# ab2.sh TREE OUTDIR: 2-GPU 1P1D-adaptive (chunk 8192) on the planning table's workloads and SLOs
cd $1 && source .venv/bin/activate; O=$2; mkdir -p $O
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
PL=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --adaptive-chunk-sizes 8192 --only 1P1D-adaptive --jobs 1"
r() { n=$1 prof=$2 ds=$3 t=$4 p=$5; shift 5
  python -m disagg.cluster.cli plan --profile $prof --dataset-name $ds --goodput ttft:$t tpot:$p --gpus 2 $H "$@" > $O/$n.log 2>&1
  echo "$n $(grep 'req/s per GPU' $O/$n.log | head -1)"; }
r chat-1x $P chat 133.215 11.4714 --seeds 3
r chat-2x $P chat 266.43 22.9428 --seeds 3
r ph-1x $P prefill-heavy 166.168 11.7824 --seeds 3
r ph-2x $P prefill-heavy 332.336 23.5648 --seeds 3
r dh-1x $P decode-heavy 66.0932 11.1873 --seeds 3
r dh-2x $P decode-heavy 132.186 22.3746 --seeds 3
r lp-1x $PL long-prompt 1559.32 14.0574
r lp-2x $PL long-prompt 3118.64 28.1148
