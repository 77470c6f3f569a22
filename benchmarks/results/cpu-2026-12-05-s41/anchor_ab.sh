#!/usr/bin/env bash
# CPU A/B: the shipped drafter (run 7) trained N more steps with and without a zero-started anchor feature.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=2
D=.venv/bin/dspark
STEPS=${STEPS:-60}
if [ ! -e /tmp/ax/data/done ]; then
  $D distill-data --device cpu --dtype float32 --prompts training/prompts_train.jsonl --out-dir /tmp/ax/data \
    --shard-name cpu-s41 --num-prompts ${PROMPTS:-700} --val-prompts 48 --max-new-tokens 128 --sample-fraction 0 \
    --batch-size 64 --max-minutes ${DATA_MIN:-7} --seed 41 && touch /tmp/ax/data/done
fi
rm -rf /tmp/ax/run7 && cp -r drafters/SmolLM2-135M-Instruct-dspark /tmp/ax/run7
.venv/bin/python - <<'PY'
import json; p='/tmp/ax/run7/config.json'; c=json.load(open(p)); c['block_size']=7; c['confidence_temperatures']=[1.0]*7
json.dump(c, open(p,'w'))
PY
$D calibrate-draft --device cpu --draft /tmp/ax/run7 --data /tmp/ax/data --report /tmp/ax/run7-cal.json --anchors 32 --batch-size 8

for arm in base anchor; do
  flag=""; [ $arm = anchor ] && flag="--anchor-feature"
  $D train-draft --device cpu --data /tmp/ax/data --out /tmp/ax/$arm --work-dir /tmp/ax/$arm.work --restart \
    --init-draft drafters/SmolLM2-135M-Instruct-dspark --block-size 7 --run-index 8 --lr ${LR:-3e-4} \
    --steps $STEPS --batch-size 8 --anchors 16 --warmup-steps 5 --log-every 10 --save-every 100000 $flag
  $D calibrate-draft --device cpu --draft /tmp/ax/$arm --data /tmp/ax/data --report /tmp/ax/$arm-cal.json \
    --anchors 32 --batch-size 8
done
