#!/usr/bin/env bash
# The two-GPU who-wins rows of whowins-sim-2026-11-27, re-planned at 769fa11 (the prefill-queue
# bound and near-tie fixes) with both adaptive preferences, 3 draws per rate (`--seeds 3`), two
# rows at a time: ../whowins-sim-2026-11-27b/run.sh with this record's logs/ and one more flag.
# From the repository root:
#   bash benchmarks/records/whowins-sim-2026-11-27c/run.sh [TAG ...]    (default: every row)
set -euo pipefail
HERE=benchmarks/records/whowins-sim-2026-11-27c PLAN_FLAGS="--adaptive-prefer fastest,balanced" \
  exec bash benchmarks/records/whowins-sim-2026-11-27b/run.sh "$@"
