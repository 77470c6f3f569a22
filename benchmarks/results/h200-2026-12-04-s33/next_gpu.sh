#!/usr/bin/env bash
# Session 34's first work call (prepared in session 33): the GPU tests of session 33's code (decode
# bursts: `decode_burst`, `dspark.engine.burst`, `ModelRunner.run_following`, the gate's
# `finish_burst`; none of it has run on a GPU), then bursts measured side by side with launch-ahead:
# benchmarks/overlap.py, plain and `static` (no gate), batch 8 / 64 / 128, tokens/s and GPU busy.
#
# Parking first (training/README.md, "Preparing the carry"; session 33 re-split the folders so that each
# fits): with drafters/ and training/prompts_train.jsonl moved aside here, three calls
#   mkdir -p /tmp/carry && cp .carry/cN/* /tmp/carry/            carry [".carry/cN"], N = 1, 2, 3
# then, with them restored, one call
#   mkdir -p /tmp/carry/distill && cp .carry/c5/*.whl /tmp/carry/ && cp .carry/c5/distill/* /tmp/carry/distill/
# with carry [".carry/c5"] (the serving wheels left over and the drafter's distill shards of runs 6-7),
# and then (~560 s)
#   OUT=$OUT bash benchmarks/results/h200-2026-12-04-s33/next_gpu.sh      carry [".carry/c4"]
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dspark-next}
mkdir -p "$OUT"
OUT=$OUT TESTS_S=${TESTS_S:-330} SERVING_S=${SERVING_S:-110} bash benchmarks/gpu_check.sh > "$OUT/check.log" 2>&1
echo "gpu_check exit $?"
grep -E "passed|failed|exit" "$OUT/check.log" | tail -8
timeout "${OVERLAP_S:-170}" python3 benchmarks/overlap.py --device cuda --out "$OUT/bursts.json" \
  --modes off,static --settings burst,ahead --burst "${BURST:-4}" --batch-sizes 8,64,128 --repeats 3 \
  --max-tokens 96 --busy-steps 40 > "$OUT/bursts.log" 2>&1
echo "bursts exit $?"
grep -E "^\|" "$OUT/bursts.log"
