# plan8.sh LABEL PROFILE DATASET TTFT TPOT ONLY [extra]  (8 GPUs, the planning table's flags)
cd ${TREE:-/work/main} && source .venv/bin/activate
L=$1 P=$2 DS=$3 T=$4 TP=$5 ONLY=$6; shift 6
( time python -m disagg.cluster.cli plan --profile $P --dataset-name $DS --goodput ttft:$T tpot:$TP --gpus 8 --hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --adaptive-chunk-sizes 8192 --only $ONLY "$@" ) > ${OUT:-/work/scratch/k}/$L.log 2>&1
grep 'req/s per GPU' ${OUT:-/work/scratch/k}/$L.log
