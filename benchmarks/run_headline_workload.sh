#!/usr/bin/env bash
# Every deployment of one workload in ONE command (under 10 minutes on two GPUs), so that two or
# three workloads are measured at one commit in half an hour: 1P1D (it calibrates the SLOs as
# benchmarks/records/runbooks/HEADLINE.md says), the same fleet with
# `router.placement: adaptive` (targets = the SLOs), and colocated at one chunk size or more
# (CHUNK=8192,512: one run each; long-prompt's relaxed SLOs are planned best at 512), each at a
# few rates around the knee the simulator predicts (benchmarks/records/whowins-sim-2026-11-27/),
# with shorter runs than benchmarks/run_headline.sh (which sweeps every rate of one
# deployment per command). The merged comparison runs here too, and everything is tarred to $OUT.
# Usage (two H200s or H100s, the GPU wheels in .whl/):
#   source .whl/gpu-env.sh && RATES=4,6,8 CHUNK=8192 bash benchmarks/run_headline_workload.sh chat
# Per deployment: RATES_1P1D, RATES_ADAPTIVE, RATES_COLOCATED (default RATES; RATES_COLOCATED_<chunk>
# for one chunk size), e.g. the knees of
# benchmarks/records/headline-plan-2026-11-27/README.md. CHUNK_DISAGG: the prefill budget of the
# 1P1D and adaptive fleets (default: the config's), the disaggregated side of HEADLINE.md's sweep.
# DISAGG_TRACE_DIR (optional): per-request and per-step traces of every run, tarred apart.
# The summary of every run (benchmarks/summarize_runs.py) lands in $OUT/<workload>-runs.md/.json.
# SET_DISAGG (optional): one more KEY=VALUE for the 1P1D and adaptive fleets, e.g.
# SET_DISAGG=scheduler.overlap_reservations=true. SET_ALL (optional): one KEY=VALUE for every
# deployment, colocated included, e.g. SET_ALL=scheduler.max_num_seqs=256 (an A/B of the same
# setting on both sides). ADAPTIVE_VARIANTS (optional): space-separated
# NAME:KEY=VALUE, each one more adaptive fleet with that setting, run after the default one as
# "adaptive-NAME" (an A/B at one tree, e.g. "remote:router.adaptive_prefer=remote"). ADAPTIVE_SLO_SCALE (default 1): the adaptive
# router's targets are this multiple of the calibrated SLOs; it optimizes the SLO it is given, so
# judge it at the scale it targeted (two H100s: a router targeting 1x held 2x worse than it could).
# STEP_PROFILE=1 (optional): first `disagg profile` on GPU 0 (the model's one-GPU colocated config,
# about a minute), its fit seeding the adaptive routers' step-time models (`router.step_profile`)
# where they would start from the built-in prior (an H100's order, per prompt token 4x high on an
# H200: the prefill instance's TTFT is predicted 2x long until it has served prompts, so the
# decode instance takes every prompt); the profile comes back as $OUT/<workload>-profile.json for
# `disagg simulate --profile`. STEP_PROFILE=FILE: seed them with that profile instead (one an
# earlier command made, kept in the tree: no second minute of profiling).
# PER_RUN_TIMEOUT (default 170): seconds for one deployment's whole sweep (every rate of it: long-prompt
# at 30-s runs takes ~45 s a rate).
# MAX_TAR_BYTES (default 15000000): above it the per-deployment tars are kept instead of one.
# CPU smoke check: HEADLINE_MODEL=tiny RATES=2 HEADLINE_SECONDS=3 bash benchmarks/run_headline_workload.sh chat
# PREDICT=PROFILE SLOS=TTFT:TPOT (CPU, before the GPU runs): the same runs with `disagg simulate` on
# that profile instead of `disagg bench` (no GPU; the SLOs given, as only a served 1P1D calibrates
# them; HOPS: the simulator's host constants, default "--hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8",
# measured on two H200s: benchmarks/records/headline-h200x2-2026-11-28c): the simulator's
# prediction of the served runs, in the same summary, made by the same command.
set -euo pipefail
W=${1:?workload: chat | prefill-heavy | decode-heavy | long-prompt | shared-prefix}
OUT=${OUT:-results/headline-workload}
mkdir -p "$OUT"
PY=${PYTHON:-python3}  # the interpreter with disagg installed (the GPU hosts: python3)
MODEL=llama3-8b
[ "$W" = long-prompt ] && MODEL=llama3.1-8b
MODEL=${HEADLINE_MODEL:-$MODEL}
RATES=${RATES:?rates around the predicted knee, e.g. RATES=4,6,8}
CHUNK=${CHUNK:-8192}
common=(--dataset-name "$W" --run-seconds "${HEADLINE_SECONDS:-20}" --min-prompts "${MIN_PROMPTS:-16}"
        --num-prompts 1000)
if [ -n "${PREDICT:-}" ]; then
  [ -n "${SLOS:-}" ] || { echo "PREDICT needs SLOS=TTFT_MS:TPOT_MS (the SLOs a served 1P1D calibrated)" >&2; exit 2; }
  read -r -a hops <<< "${HOPS:---hop-ms 6 --step-gap-ms 0.17 --reserve-ms 8}"
  tool=(simulate --profile "$PREDICT" "${hops[@]}" --seed 0)
  [ -n "${STEP_PROFILE:-}" ] || STEP_PROFILE=$PREDICT  # the routers' seed: the profile simulated
else
  tool=(bench --no-compare --num-warmups 8 --slo-scales 1,2 --save-result --disable-tqdm)
  nvidia-smi -L 2>/dev/null || true
fi
run() {  # LABEL CONFIG [bench flags]
  local label=$1; shift
  timeout "${PER_RUN_TIMEOUT:-170}" "$PY" -m disagg.cluster.cli.app "${tool[@]}" "$@" "${common[@]}" --label "$label" \
    --result-dir "results/$W/$label" > "$OUT/$W-$label.log" 2>&1 || echo "$label: rc $?"
  grep -E "SLOs|Request goodput|Median TTFT|Mean TPOT" "$OUT/$W-$label.log" | head -8 || true
  # each deployment's results reach $OUT as soon as it ends (a command stopped by a time limit
  # still leaves the deployments it finished)
  [ -d "results/$W/$label" ] && tar czf "$OUT/$W-$label.tgz" "results/$W/$label" || true
}
all_set=()
[ -n "${SET_ALL:-}" ] && all_set=(--set "$SET_ALL")
disagg_set=("${all_set[@]}")
[ -n "${CHUNK_DISAGG:-}" ] && disagg_set+=(--set "scheduler.max_num_batched_tokens=$CHUNK_DISAGG")
[ -n "${SET_DISAGG:-}" ] && disagg_set+=(--set "$SET_DISAGG")
# DEPLOYMENTS (default "1p1d adaptive colocated"): the deployments this command runs, e.g. the
# colocated runs alone in a second command when one command of ten minutes cannot hold them all.
# Without 1p1d a served run needs SLOS=TTFT:TPOT (calibrated by an earlier command's 1P1D).
DEPLOYMENTS=" ${DEPLOYMENTS:-1p1d adaptive colocated} "
merged=()
if [[ $DEPLOYMENTS != *" 1p1d "* ]]; then
  [ -n "${SLOS:-}" ] || { echo "DEPLOYMENTS without 1p1d needs SLOS=TTFT_MS:TPOT_MS (calibrated earlier)" >&2; exit 2; }
  T=${SLOS%%:*}; P=${SLOS#*:}
elif [ -n "${PREDICT:-}" ]; then
  T=${SLOS%%:*}; P=${SLOS#*:}
  run 1p1d "configs/$MODEL-1p1d.yaml" --request-rate "${RATES_1P1D:-$RATES}" --goodput "ttft:$T" --goodput "tpot:$P" \
    "${disagg_set[@]}"
else
  run 1p1d "configs/$MODEL-1p1d.yaml" --request-rate "${RATES_1P1D:-$RATES}" --slo-calibrate "${disagg_set[@]}"
  slos=$(grep -o "SLOs TTFT [0-9.]* ms, TPOT [0-9.]* ms" "$OUT/$W-1p1d.log" | head -1 || true)
  T=$(echo "$slos" | awk '{print $3}'); P=$(echo "$slos" | awk '{print $6}')
fi
[[ $DEPLOYMENTS == *" 1p1d "* ]] && merged+=(--from-results "results/$W/1p1d")
[ -n "$T" ] && [ -n "$P" ] || { echo "no SLOs in $OUT/$W-1p1d.log" >&2; exit 1; }
echo "SLOs: TTFT $T ms, TPOT $P ms"
judge=(--goodput "ttft:$T" --goodput "tpot:$P")
scale=${ADAPTIVE_SLO_SCALE:-1}
TA=$(awk -v t="$T" -v k="$scale" 'BEGIN{print t*k}'); PA=$(awk -v p="$P" -v k="$scale" 'BEGIN{print p*k}')
adaptive=("configs/$MODEL-1p1d.yaml" --request-rate "${RATES_ADAPTIVE:-$RATES}" "${disagg_set[@]}"
          --set router.placement=adaptive --set "router.slo_ttft_ms=$TA" --set "router.slo_tpot_ms=$PA" "${judge[@]}")
if [ -n "${STEP_PROFILE:-}" ] && [ -f "$STEP_PROFILE" ]; then
  adaptive+=(--set "router.step_profile=$STEP_PROFILE")
elif [ -n "${STEP_PROFILE:-}" ]; then
  pconf="configs/$MODEL-1gpu-colocated.yaml"
  [ -f "$pconf" ] || pconf="configs/$MODEL-colocated.yaml"
  grid=(); [ "$MODEL" = tiny ] && grid=(--small-grid)
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout "${PER_RUN_TIMEOUT:-170}" "$PY" -m disagg.cluster.cli.app \
    profile "$pconf" "${grid[@]}" --out "$OUT/$W-profile.json" > "$OUT/$W-profile.log" 2>&1 \
    && adaptive+=(--set "router.step_profile=$OUT/$W-profile.json") || echo "profile: rc $? (the prior seeds the routers)"
  tail -5 "$OUT/$W-profile.log"
fi
if [[ $DEPLOYMENTS == *" adaptive "* ]]; then
  run adaptive "${adaptive[@]}"
  merged+=(--from-results "results/$W/adaptive")
  for variant in ${ADAPTIVE_VARIANTS:-}; do  # NAME:KEY=VALUE -> the run "adaptive-NAME"
    run "adaptive-${variant%%:*}" "${adaptive[@]}" --set "${variant#*:}"
    merged+=(--from-results "results/$W/adaptive-${variant%%:*}")
  done
fi
[[ $DEPLOYMENTS == *" colocated "* ]] || CHUNK=
for chunk in ${CHUNK//,/ }; do  # CHUNK=8192,512: colocated at each chunk size (its best one is the comparison)
  rates_chunk="RATES_COLOCATED_$chunk"  # RATES_COLOCATED_512=...: that chunk size's own rates
  run "colocated-$chunk" "configs/$MODEL-colocated.yaml" --request-rate "${!rates_chunk:-${RATES_COLOCATED:-$RATES}}" \
    --set "scheduler.max_num_batched_tokens=$chunk" "${all_set[@]}" "${judge[@]}"
  merged+=(--from-results "results/$W/colocated-$chunk")
done
"$PY" -m disagg.cluster.cli.app bench "${merged[@]}" --slo-scales 1,2 \
  --result-dir "results/$W/merged" > "$OUT/$W-merged.log" 2>&1 || echo "merge: rc $?"
grep -v '^\s*$' "$OUT/$W-merged.log" | tail -40
# Small enough to copy back from a remote GPU host: every run's summary and the logs; the raw
# results and the traces in their own tars.
"$PY" benchmarks/summarize_runs.py --table "results/$W" > "$OUT/$W-runs.md" || true
"$PY" benchmarks/summarize_runs.py "results/$W" > "$OUT/$W-runs.json" || true
cat "$OUT/$W-runs.md"
tar czf "$OUT/$W.tgz" "results/$W" "$OUT"/"$W"-*.log
# The whole tar replaces the per-deployment ones and the logs in it (the merged log, runs.md and
# runs.json stay beside it), so few files come back. A whole tar over MAX_TAR_BYTES (decode-heavy
# at 26-34 req/s writes one) goes; the per-deployment tars stay instead, the logs in one small tar
# beside them.
if [ "$(stat -c %s "$OUT/$W.tgz")" -le "${MAX_TAR_BYTES:-15000000}" ]; then
  find "$OUT" -maxdepth 1 \( -name "$W-*.tgz" -o -name "$W-*.log" \) ! -name "$W-merged.log" -delete
else
  rm "$OUT/$W.tgz"
  tar czf "$OUT/$W-logs.tgz" "$OUT"/"$W"-*.log
  find "$OUT" -maxdepth 1 -name "$W-*.log" -delete
fi
[ -n "${DISAGG_TRACE_DIR:-}" ] && tar czf "$OUT/$W-trace.tgz" "$DISAGG_TRACE_DIR"
echo "workload $W: $(ls "$OUT" | grep "^$W" | tr '\n' ' ')"
