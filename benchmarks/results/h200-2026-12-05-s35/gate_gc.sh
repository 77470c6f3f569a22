#!/usr/bin/env bash
# Session 35's second machine (the first was taken back mid-call): the gate's step times as a median of
# the latest (no longer a moving average one pause could skew) and the serving processes' startup heap
# frozen (gc.freeze), on the H200. After parking the GGUF parts and wheels (training/README.md):
#   OUT=$OUT bash benchmarks/results/h200-2026-12-05-s35/gate_gc.sh   carry [".carry/c4", ".carry/base35"]
# where .carry/base35/backend is the tree before them (`git archive 83f678b backend | tar -x -C .carry/base35`).
# 1. set-up (and the serving tests through the real tritonserver when SERVING_S > 0);
# 2. issue 18's table again (served / offline, 1-256 streams, the users' defaults): its offline side
#    is the serve default against plain decoding with the new gate;
# 3. the gate A/B: both trees' offline engines in one process, plain and the serve default, rounds
#    alternated (default / plain per tree from the same rounds), for the time left.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dspark-s35}
mkdir -p "$OUT"
OUT=$OUT TESTS_S=0 SERVING_S=${SERVING_S:-0} bash benchmarks/gpu_check.sh > "$OUT/check.log" 2>&1
echo "set-up / serving tests: exit $?"; grep -E "passed|failed" "$OUT/check.log" | tail -3
OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-230} OVERHEAD_ARGS="--levels 1,8,64,128,256 \
  --modes off,default --requests-per-stream 8 --user-defaults --rounds 2" bash benchmarks/gpu_check.sh \
  > "$OUT/overhead-check.log" 2>&1
echo "overhead: exit $?"; head -8 "$OUT/overhead.md"
timeout "${AB_S:-90}" python3 benchmarks/ab_trees.py --base .carry/base35/backend --device cuda \
  --batch-sizes 128,64 --modes off,default --rounds "${ROUNDS:-6}" --max-tokens 96 \
  --out "$OUT/ab-gate.json" > "$OUT/ab-gate.log" 2>&1
echo "ab gate: exit $?"; grep -E "^\{" "$OUT/ab-gate.log"
