# On the device (16 CPU cores): the 64-GPU candidates not judged before, at bd24482's placement.
# long-prompt: `disagg plan --only` (doubling + bisection, 11 workers); chat 32P32D-adaptive: a
# grid of rates (grid.py, 5 workers). Output: $1/g64c.log (plan's table) and $1/g64c.jsonl (grid).
O=$1; mkdir -p $O
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
PL=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json
G=benchmarks/records/plan-h200-2026-11-29/grid.py
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192"
timeout 560 disagg plan --profile $PL --dataset-name long-prompt --goodput ttft:1559.32 tpot:14.0574 --gpus 64 \
  $H --adaptive-chunk-sizes 8192 --only 8P56D,11P53D,11P53D-adaptive,16P48D,16P48D-adaptive,21P43D,21P43D-adaptive,32P32D,32P32D-adaptive,43P21D,43P21D-adaptive \
  --start-rate 0.25 --jobs 11 > $O/lp.log 2>&1 &
timeout 560 python3 $G --profile $P --dataset-name chat --goodput ttft:266.43 tpot:22.9428 --gpus 64 --only 32P32D-adaptive \
  --rates 17.5,18.5,19,19.5,20 $H --jobs 5 --out $O/chat.jsonl > /dev/null 2> $O/chat.err &
wait
{ cat $O/lp.log; echo "--- chat grid"; cat $O/chat.jsonl; tail -3 $O/chat.err; } > $O/g64c.log; rm -f $O/lp.log $O/chat.jsonl $O/chat.err; cat $O/g64c.log | tail -40
