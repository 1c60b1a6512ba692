# The seat-aware placement in simulation: decode-heavy on two GPUs at this record's SLOs, `fastest`
# and `balanced`, 4 rates x 4 seeds, 20-s runs. From the repository root, venv active, once at
# b30edfa (before) and once after it (~1 min each on 2 cores); then seats-table.py OUTD...
# usage: SEEDS="0 1 2 3" bash benchmarks/records/headline-h100x2-2026-11-27e/seats-sim.sh . OUTD
cd $1; OUTD=$2
P=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json
t=(--set router.placement=adaptive --set router.slo_ttft_ms=85.7555 --set router.slo_tpot_ms=14.9512)
sim() { local label=$1 seed=$2; shift 2; python3 -m disagg.cluster.cli simulate configs/llama3-8b-1p1d.yaml --profile $P --dataset-name decode-heavy \
  --num-prompts 1000 --run-seconds 20 --min-prompts 16 --hop-ms 6 --step-gap-ms 0.17 --seed $seed \
  --request-rate 20,22,24,26 --goodput ttft:85.7555 --goodput tpot:14.9512 --label $label --result-dir $OUTD/$label-$seed "$@" > /dev/null 2>&1 || echo "$label rc $?"; }
for seed in ${SEEDS:-0 1 2 3}; do
sim fastest $seed "${t[@]}" &
sim balanced $seed "${t[@]}" --set router.adaptive_prefer=balanced &
wait
done
