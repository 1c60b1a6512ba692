# On the device: 64-GPU adaptive candidates re-judged on a grid of rates (grid.py), the working tree.
O=$1; mkdir -p $O
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
PL=benchmarks/records/headline-h200x2-2026-11-28c/profile-h200-llama3.1-32k.json
G=benchmarks/records/plan-h200-2026-11-29/grid.py
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192"
timeout 430 python3 $G --profile $PL --dataset-name long-prompt --goodput ttft:1559.32 tpot:14.0574 --gpus 64 --only 56P8D-adaptive --rates 0.5625,0.625,0.6875,0.75,0.8125,0.875 $H --jobs 6 --out $O/lp.jsonl > /dev/null 2> $O/lp.err &
timeout 430 python3 $G --profile $P --dataset-name chat --goodput ttft:266.43 tpot:22.9428 --gpus 64 --only 43P21D-adaptive --rates 17,17.5,18,18.5 $H --jobs 4 --out $O/chat.jsonl > /dev/null 2> $O/chat.err &
timeout 430 python3 $G --profile $P --dataset-name prefill-heavy --goodput ttft:166.168 tpot:11.7824 --gpus 64 --only 56P8D-adaptive --rates 16.5,17,17.5 $H --jobs 3 --out $O/ph.jsonl > /dev/null 2> $O/ph.err &
wait
cat $O/*.jsonl > $O/g64.jsonl; tail -2 $O/*.err | grep -i error; rm -f $O/lp.jsonl $O/chat.jsonl $O/ph.jsonl $O/*.err; cat $O/g64.jsonl
