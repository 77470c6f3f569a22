#!/usr/bin/env bash
# Session 41 (H100): the gate whose warm-up times are provisional against HEAD's (d269ea0), then
# issue 18's table (served / offline, plain and the serve default) with it.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/s41}; mkdir -p "$OUT"
OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-250} OVERHEAD_ARGS="--levels 1,8,64,128,256 \
  --modes off,default --requests-per-stream 8 --user-defaults --rounds 2" bash benchmarks/gpu_check.sh \
  > "$OUT/overhead-check.log" 2>&1
echo "overhead: exit $?"; head -9 "$OUT/overhead.md"
timeout "${AB_S:-200}" python3 benchmarks/ab_trees.py --base .carry/base40/backend --device cuda \
  --batch-sizes 128,64,8 --modes off,default --rounds "${ROUNDS:-6}" --max-tokens 96 \
  --out "$OUT/ab-gate.json" > "$OUT/ab-gate.log" 2>&1
echo "ab gate: exit $?"; grep -E "^\|" "$OUT/ab-gate.log"
