#!/usr/bin/env bash
# The next device session's first work call (prepared in session 34, which was lent no machine; it
# replaces session 33's next_gpu.sh, which no machine ran, and adds the A/B at its end): the GPU
# tests of sessions 33-34 (decode bursts, `ModelRunner.run_following`, the gate's `finish_burst`, the
# per-request step values as named tuples, the scheduler's and packing's trims: none of it has run on a
# GPU), then decode bursts against launch-ahead (benchmarks/overlap.py: plain and `static`, batch 8 / 64
# / 128, tokens/s and GPU busy), then session 34's host trims against the tree before them
# (benchmarks/ab_trees.py, both trees' engines in one process, rounds alternated).
#
# Parking first (training/README.md, "Preparing the carry"): with drafters/ and
# training/prompts_train.jsonl moved aside here, three calls
#   mkdir -p /tmp/carry && cp .carry/cN/* /tmp/carry/            carry [".carry/cN"], N = 1, 2, 3
# then, with them restored, one call
#   mkdir -p /tmp/carry/distill && cp .carry/c5/*.whl /tmp/carry/ && cp .carry/c5/distill/* /tmp/carry/distill/
# with carry [".carry/c5"], and then two calls, back to back (a call may run 600 s at most):
#   OUT=$OUT bash benchmarks/results/h200-next-s35/next_gpu.sh tests   carry [".carry/c4"]   (~450 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s35/next_gpu.sh bench   carry [".carry/c4", ".carry/base34"]
#                                                                                             (~300 s)
# where .carry/base34/backend is the tree before session 34 (`git archive a31fe22 backend | tar -x -C
# .carry/base34`). `bench` sets the machine up again (no tests) if the first call's set-up is gone.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dspark-next}
PART=${1:-tests}
mkdir -p "$OUT"
if [[ $PART == tests ]]; then
  OUT=$OUT TESTS_S=${TESTS_S:-330} SERVING_S=${SERVING_S:-110} bash benchmarks/gpu_check.sh > "$OUT/check.log" 2>&1
  echo "gpu_check exit $?"
  grep -E "passed|failed|exit" "$OUT/check.log" | tail -8
  exit 0
fi
# The GGUF converted and the package installed (no tests), when the machine is a fresh one.
OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
timeout "${OVERLAP_S:-150}" python3 benchmarks/overlap.py --device cuda --out "$OUT/bursts.json" \
  --modes off,static --settings burst,ahead --burst "${BURST:-4}" --batch-sizes 8,64,128 --repeats 3 \
  --max-tokens 96 --busy-steps 40 > "$OUT/bursts.log" 2>&1
echo "bursts exit $?"
grep -E "^\|" "$OUT/bursts.log"
if [[ -d .carry/base34/backend ]]; then
  timeout "${AB_S:-100}" python3 benchmarks/ab_trees.py --base .carry/base34/backend --device cuda \
    --batch-sizes 64,128 --modes off,static --rounds "${ROUNDS:-8}" --max-tokens 64 \
    --out "$OUT/ab-a31fe22.json" > "$OUT/ab-a31fe22.log" 2>&1
  echo "ab a31fe22: exit $?"
  grep -E "^\|" "$OUT/ab-a31fe22.log"
fi
