# On the device: 8-GPU grid A/B of the adaptive placement, base (.base, HEAD) vs the working tree.
# usage: bash .base/ab8.sh OUTDIR
set -u
O=$1; mkdir -p $O
rm -rf /tmp/base-site && mkdir -p /tmp/base-site && cp -r .base/disagg /tmp/base-site/disagg
for d in kernels transfer cluster; do cp -r .base/$d /tmp/base-site/disagg/$d; done
cp .base/run_base.py /tmp/base-site/  # run from there: sys.path[0] must hold the laid-out package
P=benchmarks/records/headline-h200x2-2026-11-28b/profile-h200.json
H="--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8 --chunk-sizes 8192 --jobs 2"
G=benchmarks/records/plan-h200-2026-11-29/grid.py
runs() { # tree-label pythonpath seed
  local L=$1 PP=$2 S=$3; local PY="python3"; [ $L = base ] && PY="python3 /tmp/base-site/run_base.py"
  PYTHONPATH=$PP timeout 540 $PY $G --profile $P --dataset-name chat --goodput ttft:266.43 tpot:22.9428 --gpus 8 --only 4P4D-adaptive,5P3D-adaptive --rates 17.5,18,18.5 $H --seed $S --out $O/$L-chat-s$S.jsonl > /dev/null 2> $O/$L-chat-s$S.err &
  PYTHONPATH=$PP timeout 540 $PY $G --profile $P --dataset-name prefill-heavy --goodput ttft:166.168 tpot:11.7824 --gpus 8 --only 7P1D-adaptive,6P2D-adaptive --rates 14.5,15,15.5 $H --seed $S --out $O/$L-ph-s$S.jsonl > /dev/null 2> $O/$L-ph-s$S.err &
  PYTHONPATH=$PP timeout 540 $PY $G --profile $P --dataset-name decode-heavy --goodput ttft:66.0932 tpot:11.1873 --gpus 8 --only 1P7D-adaptive,2P6D-adaptive --rates 13.25,13.75,14.25 $H --seed $S --out $O/$L-dh-s$S.jsonl > /dev/null 2> $O/$L-dh-s$S.err &
}
echo 'import disagg.cluster.placement as p; print(p.__file__)' > /tmp/which.py
PYTHONPATH=/tmp/base-site:/tmp/site python3 /tmp/base-site/run_base.py /tmp/which.py
python3 -c "import disagg; print('new', disagg.__file__)"
for S in 0 1 2; do for T in ${TREES:-base new}; do [ $T = base ] && runs base /tmp/base-site:/tmp/site $S || runs new /tmp/site $S; done; done
wait
python3 - $O <<'PY'
import glob, json, os, sys
out = open(os.path.join(sys.argv[1], "ab8.jsonl"), "w")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-s*.jsonl"))):
    tree, wl, seed = os.path.basename(f)[:-6].split("-")
    for line in open(f):
        out.write(json.dumps({"tree": tree, "workload": wl, "seed": seed, **json.loads(line)}) + "\n")
    os.remove(f)
errs = [l for f in glob.glob(os.path.join(sys.argv[1], "*.err")) for l in open(f) if "Error" in l or "Traceback" in l]
print("errors:", errs[:5])
PY
rm -f $O/*.err; wc -l $O/ab8.jsonl
