# ab8-local.sh SEED: the 8-GPU A/B grid of plan-h200-2026-11-29b/scripts/ab8.sh for the working tree alone, on
# this machine (--jobs 2); its base is that record's results/ab8-new.jsonl (2dff67f = bd24482 decisions).
cd ${TREE:-$(git rev-parse --show-toplevel)} && source .venv/bin/activate
O=${OUT:-results/ab8}; S=${1:-0}; mkdir -p $O
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --jobs 2"
G=benchmarks/records/plan-h200-2026-11-29/grid.py
python3 $G --profile $P --dataset-name chat --goodput ttft:266.43 tpot:22.9428 --gpus 8 --only 4P4D-adaptive,5P3D-adaptive --rates 17.5,18,18.5 $H --seed $S --out $O/new-chat-s$S.jsonl > /dev/null 2> $O/new-chat-s$S.err
python3 $G --profile $P --dataset-name prefill-heavy --goodput ttft:166.168 tpot:11.7824 --gpus 8 --only 7P1D-adaptive,6P2D-adaptive --rates 14.5,15,15.5 $H --seed $S --out $O/new-ph-s$S.jsonl > /dev/null 2> $O/new-ph-s$S.err
python3 $G --profile $P --dataset-name decode-heavy --goodput ttft:66.0932 tpot:11.1873 --gpus 8 --only 1P7D-adaptive,2P6D-adaptive --rates 13.25,13.75,14.25 $H --seed $S --out $O/new-dh-s$S.jsonl > /dev/null 2> $O/new-dh-s$S.err
