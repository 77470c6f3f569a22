#!/usr/bin/env bash
# Session 31's host trims (03cf2d3) against the tree before them (3257144, unpacked in .carry/base by
# `git archive 3257144 backend | tar -x -C .carry/base`), on the H200: benchmarks/overlap.py with launch
# ahead (the default loop), plain and static, rounds alternating the two trees (one process each, so a
# slow spell of the host falls on both in turn). Output: $OUT/ab/<tree>-<round>.log (a JSON row per
# batch size, then the table).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROUNDS=${ROUNDS:-3}
ARGS=${AB_ARGS:-"--batch-sizes 8,64,128 --modes off,static --settings ahead --repeats 2 --max-tokens 96 --busy-steps 40"}
mkdir -p "$OUT/ab"
# Both trees read the same checkpoints (the base tree's defaults would look beside .carry/base).
MODELS="--model $(pwd)/models/SmolLM2-135M-Instruct --draft-model $(pwd)/drafters/SmolLM2-135M-Instruct-dspark"
for round in $(seq "$ROUNDS"); do
  for tree in base main; do
    if [[ $tree == base ]]; then src=$(pwd)/.carry/base/backend; else src=$(pwd)/backend; fi
    # shellcheck disable=SC2086
    PYTHONPATH=$src timeout "${AB_RUN_S:-120}" python3 benchmarks/overlap.py --device cuda $MODELS $ARGS \
      > "$OUT/ab/$tree-$round.log" 2>&1
    echo "$tree round $round: exit $?"
    PYTHONPATH=$src python3 -c "import dspark; print(' ', dspark.__file__)"
  done
done
