#!/usr/bin/env bash
# Session 33's first work call (prepared in session 32): is `static` slower since session 31, and is it
# the attention tuning? benchmarks/ab_trees.py holds two trees' engines in one process and alternates
# short runs (the host's drift falls on both). Trees, unpacked here before the call and carried:
#   .carry/notune/backend: HEAD's backend with kernels/attention.tune returning at once (the autotuner's
#     own first-call choice, as before 988491e): `git archive HEAD backend | tar -x -C .carry/notune`,
#     then the one-line patch (a `return` at the top of tune);
#   .carry/base/backend: 3257144 (before session 31's host trims): `git archive 3257144 backend | tar -x -C .carry/base`.
# Carry [".carry/c4", ".carry/notune", ".carry/base"] after parking g01 and p2 (training/README.md).
#   OUT=$OUT bash benchmarks/results/h200-2026-12-04-s32/next_ab.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dspark-ab}
mkdir -p "$OUT"
# The GGUF converted and the package installed (no tests).
OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/check.log" 2>&1
ARGS=(--device cuda --batch-sizes 8,64 --modes off,static --rounds "${ROUNDS:-12}" --max-tokens 64)
timeout "${AB_S:-250}" python3 benchmarks/ab_trees.py --base .carry/notune/backend "${ARGS[@]}" \
  --out "$OUT/ab-notune.json" > "$OUT/ab-notune.log" 2>&1
echo "notune: exit $?"; grep -E "^\|" "$OUT/ab-notune.log"
timeout "${AB_S:-250}" python3 benchmarks/ab_trees.py --base .carry/base/backend "${ARGS[@]}" \
  --out "$OUT/ab-3257144.json" > "$OUT/ab-3257144.log" 2>&1
echo "3257144: exit $?"; grep -E "^\|" "$OUT/ab-3257144.log"
