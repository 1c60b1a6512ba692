# plan8lp.sh LABEL ONLY [extra]  (8-GPU long-prompt 1x)
cd ${TREE:-$(git rev-parse --show-toplevel)} && source .venv/bin/activate
P=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json
L=$1 ONLY=$2; shift 2
python -m disagg.cluster.cli plan --profile $P --dataset-name long-prompt --goodput ttft:1559.32 tpot:14.0574 --gpus 8 --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --adaptive-chunk-sizes 8192 --only $ONLY "$@" > ${OUT:-results/plan-2026-11-29b}/$L.log 2>&1
grep 'req/s per GPU' ${OUT:-results/plan-2026-11-29b}/$L.log
