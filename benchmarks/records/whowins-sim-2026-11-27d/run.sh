#!/usr/bin/env bash
# The two-GPU who-wins rows re-planned on the step profile of today's engine (whole mixed graphs,
# async prompts: ../simulator-accuracy-2026-11-27/profile-h100-full-graphs.json; long-prompt rows
# on the same profile with its context limit raised to 33,792), at the SLOs of the earlier rows,
# both adaptive preferences, 3 draws per rate: ../whowins-sim-2026-11-27b/run.sh with this record's
# logs/. From the repository root (~20 minutes on 2 cores):
#   bash benchmarks/records/whowins-sim-2026-11-27d/run.sh [TAG ...]    (default: every row)
set -euo pipefail
HERE=benchmarks/records/whowins-sim-2026-11-27d
P=benchmarks/records/simulator-accuracy-2026-11-27/profile-h100-full-graphs.json
X=${TMPDIR:-/tmp}/whowins-27d-profile-ctx33792.json  # generated, not kept
python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d['engine']['max_model_len'] = 33792; \
json.dump(d, open(sys.argv[2], 'w'))" "$P" "$X"
HERE=$HERE P=$P X=$X PLAN_FLAGS="--adaptive-prefer fastest,balanced" \
  exec bash benchmarks/records/whowins-sim-2026-11-27b/run.sh "$@"
