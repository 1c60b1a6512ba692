# On the device: chat 32P32D-adaptive at 64 GPUs above g64c.sh's grid (it held 20.0 req/s per GPU).
O=$1; mkdir -p $O
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
G=benchmarks/records/plan-h200-2026-11-29/grid.py
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192"
timeout 570 python3 $G --profile $P --dataset-name chat --goodput ttft:266.43 tpot:22.9428 --gpus 64 --only 32P32D-adaptive \
  --rates 20.5,21,21.5,22,23,24 $H --jobs 6 --out $O/g64chat.jsonl > /dev/null 2> $O/chat.err
tail -3 $O/chat.err; rm -f $O/chat.err; cat $O/g64chat.jsonl
