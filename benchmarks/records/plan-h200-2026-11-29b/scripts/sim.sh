# usage: sim.sh LABEL RATE P D [extra]; 8-GPU long-prompt adaptive trace
cd ${TREE:-$(git rev-parse --show-toplevel)} && source .venv/bin/activate
P=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json
L=$1 R=$2 NP=$3 ND=$4; shift 4
rm -rf ${OUT:-results/plan-2026-11-29b}/$L; mkdir -p ${OUT:-results/plan-2026-11-29b}/$L
disagg simulate configs/llama3.1-8b-1p1d.yaml --profile $P --set instances.prefill=$NP --set instances.decode=$ND \
  --set router.placement=adaptive --set router.slo_ttft_ms=1559.32 --set router.slo_tpot_ms=14.0574 \
  --dataset-name long-prompt --request-rate $R --goodput ttft:1559.32 tpot:14.0574 --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 \
  --trace-dir ${OUT:-results/plan-2026-11-29b}/$L/trace --result-dir ${OUT:-results/plan-2026-11-29b}/$L/res ${RUNLEN:---run-seconds 30 --num-prompts 1000} "$@" > ${OUT:-results/plan-2026-11-29b}/$L/log 2>&1
