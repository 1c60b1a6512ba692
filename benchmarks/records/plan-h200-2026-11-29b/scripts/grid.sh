# grid.sh TREE OUT PROFILE DATASET TTFT TPOT GPUS ONLY RATES [jobs]
cd $1 && source .venv/bin/activate
python3 benchmarks/records/plan-h200-2026-11-29/grid.py --profile $3 --dataset-name $4 --goodput ttft:$5 tpot:$6 --gpus $7 --only $8 --rates $9 --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --jobs ${10:-1} --seed ${SEED:-0} --out $2 > /dev/null 2>&1
