# The planning rows: `disagg plan` over derive.sh's profiles (every TP that fits: 70B at 2, 4, 8;
# 32B at 1, 2, 4, 8), SLOs from slos.py, the 8B table's hops and link. Usage:
#   bash plan.sh DERIVED_DIR OUT_DIR GPUS [ROW ...]     ROW: 70b-chat 70b-prefill-heavy 70b-long-prompt
#                                                            32b-chat 32b-prefill-heavy 32b-long-prompt
# Each row's output: OUT_DIR/<row>-<gpus>.log (the screen, the table, the best YAML) with its wall time;
# TIMEOUT=S stops a row after S seconds (the candidates judged by then are in its log).
D=$1; O=$2; G=$3; shift 3; mkdir -p $O
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --adaptive-chunk-sizes 8192"
[ "$G" -gt 8 ] && H="$H --chunk-sizes 8192"
for row in "$@"; do
  case $row in
    70b-chat) P="$D/llama3-70b-tp2.json $D/llama3-70b-tp4.json $D/llama3-70b-tp8.json"; W=chat; S="ttft:1389 tpot:116.1";;
    70b-prefill-heavy) P="$D/llama3-70b-tp2.json $D/llama3-70b-tp4.json $D/llama3-70b-tp8.json"; W=prefill-heavy; S="ttft:854 tpot:59.5";;
    70b-long-prompt) P="$D/llama3.1-70b-tp2.json $D/llama3.1-70b-tp4.json $D/llama3.1-70b-tp8.json"; W=long-prompt; S="ttft:6618 tpot:65.6";;
    32b-chat) P="$D/qwen2.5-32b-tp1.json $D/qwen2.5-32b-tp2.json $D/qwen2.5-32b-tp4.json $D/qwen2.5-32b-tp8.json"; W=chat; S="ttft:1165 tpot:97.4";;
    32b-prefill-heavy) P="$D/qwen2.5-32b-tp1.json $D/qwen2.5-32b-tp2.json $D/qwen2.5-32b-tp4.json $D/qwen2.5-32b-tp8.json"; W=prefill-heavy; S="ttft:720 tpot:50.0";;
    32b-long-prompt) P="$D/qwen2.5-32b-32k-tp1.json $D/qwen2.5-32b-32k-tp2.json $D/qwen2.5-32b-32k-tp4.json $D/qwen2.5-32b-32k-tp8.json"; W=long-prompt; S="ttft:5803 tpot:56.4";;
    *) echo "unknown row $row"; exit 2;;
  esac
  start=$(date +%s)
  ${TIMEOUT:+timeout $TIMEOUT} disagg plan $(for p in $P; do echo --profile $p; done) --dataset-name $W --goodput $S --gpus $G $H ${PLAN_ARGS:-} \
    > $O/$row-$G.log 2>&1
  rc=$?
  echo "wall_s $(( $(date +%s) - start )) (rc $rc, load $(cut -d' ' -f1-3 /proc/loadavg))" >> $O/$row-$G.log
done
