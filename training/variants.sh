#!/usr/bin/env bash
# Capacity variants of the DSpark drafter, compared in one GPU call: each is trained from scratch on the
# same data in the same order (DATA_IN's shards, no generation), then measured: teacher-forced tau on
# the held-out responses, tau through the engine (greedy, a few evaluation prompts per domain) and the
# drafter's cost per decoding step at batch 1 and 64.
#
#   DATA_IN=.carry/distill bash training/variants.sh [GGUF] [--tiny]
#
# GGUF and --tiny as for run_h200.sh (--tiny wants DATA_IN too: run_h200.sh --tiny's $OUT/data).
# VARIANTS (space-separated, default "base two-layers five-features rank64"; the first is the baseline
# of the table's differences):
#   base           1 layer, target layers 1,14,27 (3), Markov rank 32: the shipped architecture
#   two-layers     a second drafter layer
#   five-features  5 target layers feed the drafter (1,8,14,20,27)
#   rank64         Markov rank 64
#   block3         the base trained on blocks of 3 (the block the shipped drafter serves)
#   data-ce        the base with its cross-entropy against the data's next token (--ce-target data; the
#                  default was this until the base, against the target's distribution, won: +3% tau)
#   argmax-ce      the base with its cross-entropy against the target's argmax (--ce-target argmax: the
#                  token greedy verification accepts, where the soft label also fits the tail)
#   top-layer      the target's last layer (29) in place of 27 among the 3 features (1,14,29): the state
#                  the target's own head reads, as EAGLE feeds its drafter
#   anchor-feature the base with the anchor's context row (the projected target features of the position
#                  before the block) added to every block input, as EAGLE feeds its drafter the target's
#                  state directly (DraftConfig.anchor_feature; +0.33M parameters)
# Warm starts from INIT_DRAFT (default: the shipped drafter), its shape kept but for what the name adds
# (grown at zero, so each starts where INIT_DRAFT is): what continued training buys with each change,
# without the from-scratch runs' bias towards whatever learns fastest in a few hundred steps:
#   warm                 INIT_DRAFT trained on
#   warm-anchor          plus the anchor feature
#   warm-two-layers      plus a second layer
#   warm-anchor-two-layers  both
#   warm-vocab           INIT_DRAFT trained on over its draft vocabulary only (train-draft
#                        --draft-vocab-size 0: the K tokens its draft_vocab.safetensors serves by default; the
#                        loss's vocabulary tensors K/vocab the size), and measured drafting from them, as served
#                        (every other row drafts from the whole vocabulary: K 8192 cost ~1% tau, RESULTS.md
#                        session 14)
#   shipped              INIT_DRAFT as it is, not trained: the baseline the warm variants are read against
# All train on blocks of 7 but block3 and the warm ones (WARM_BLOCK, default 3). Each variant trains
# TRAIN_MINUTES (default: an equal share of the budget) or, with TRAIN_STEPS, that many steps (equal
# steps, unless the time share stops a variant first: it also bends that variant's learning-rate
# schedule, and variants_table.py says when steps differ).
# $OUT receives 3 files: variants.md (the table, rewritten after every variant), run.log and
# reports.tar.gz (each variant's train log, calibration, cost and evaluation JSON).
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
WORK=${WORK:-/tmp/dspark-variants}
VARIANTS=${VARIANTS:-base two-layers five-features rank64}
TRAIN_STEPS=${TRAIN_STEPS:-0}
INIT_DRAFT=${INIT_DRAFT:-drafters/SmolLM2-135M-Instruct-dspark}
LR=${LR:-1e-3}
# The warm variants' block: the shipped drafter's (3) by default, so they and `shipped` are measured alike.
WARM_BLOCK=${WARM_BLOCK:-3}
START=$(date +%s)
export PYTHONUNBUFFERED=1
# shellcheck source=training/lib.sh
source "$ROOT/training/lib.sh"

if (( TINY )); then
  BUDGET_S=${BUDGET_S:-3600}
  TRAIN_ARGS=(--batch-size 2 --anchors 4 --log-every 1 --save-every 100)
  TRAIN_STEPS=1
  CAL_ARGS=(--anchors 4 --batch-size 2)
  LIMITS_ARGS=(--anchors 4 --batch-size 2)
  COST_ARGS=(--batches 1,4 --context 16 --repeats 2)
  EVAL_ARGS=(--per-domain 1 --max-tokens 8 --num-kv-pages 256 --max-num-seqs 4)
  VARIANT_RESERVE_S=0
else
  BUDGET_S=${BUDGET_S:-585}
  TRAIN_ARGS=(--batch-size 32 --anchors 48 --log-every 50 --save-every 100000)
  CAL_ARGS=(--anchors 32 --batch-size 16)
  LIMITS_ARGS=(--anchors 16 --batch-size 16)
  COST_ARGS=(--batches 1,64 --context 256 --repeats 50)
  EVAL_ARGS=(--per-domain "${EVAL_PER_DOMAIN:-8}" --max-tokens "${MAX_NEW:-96}")
  # What calibration, the cost timing and the evaluation of one variant take, with some slack.
  VARIANT_RESERVE_S=${VARIANT_RESERVE_S:-75}
fi

variant_flags() {
  case "$1" in
    base) echo "--block-size 7 --num-layers 1 --num-target-features 3 --markov-rank 32" ;;
    two-layers) echo "--block-size 7 --num-layers 2 --num-target-features 3 --markov-rank 32" ;;
    five-features) echo "--block-size 7 --num-layers 1 --num-target-features 5 --markov-rank 32" ;;
    rank64) echo "--block-size 7 --num-layers 1 --num-target-features 3 --markov-rank 64" ;;
    block3) echo "--block-size 3 --num-layers 1 --num-target-features 3 --markov-rank 32" ;;
    data-ce) echo "--block-size 7 --num-layers 1 --num-target-features 3 --markov-rank 32 --ce-target data" ;;
    argmax-ce) echo "--block-size 7 --num-layers 1 --num-target-features 3 --markov-rank 32 --ce-target argmax" ;;
    top-layer) echo "--block-size 7 --num-layers 1 --target-layers 1,14,29 --markov-rank 32" ;;
    anchor-feature) echo "--block-size 7 --num-layers 1 --num-target-features 3 --markov-rank 32 --anchor-feature" ;;
    shipped) echo "" ;;
    warm) echo "--block-size $WARM_BLOCK --init-draft $INIT_DRAFT" ;;
    warm-anchor) echo "--block-size $WARM_BLOCK --init-draft $INIT_DRAFT --anchor-feature" ;;
    warm-two-layers) echo "--block-size $WARM_BLOCK --init-draft $INIT_DRAFT --num-layers 2" ;;
    warm-anchor-two-layers) echo "--block-size $WARM_BLOCK --init-draft $INIT_DRAFT --num-layers 2 --anchor-feature" ;;
    warm-vocab) echo "--block-size $WARM_BLOCK --init-draft $INIT_DRAFT --draft-vocab-size 0" ;;
    *) echo "unknown variant: $1" >&2; return 1 ;;
  esac
}

run() {
  local variants
  read -ra variants <<< "$VARIANTS"
  local v
  for v in "${variants[@]}"; do variant_flags "$v" >/dev/null; done
  environment
  import_target
  collect_data_in
  (( ${#DATA[@]} )) || { echo "DATA_IN: name the folders of the shards to train on"; exit 1; }

  local minutes=0 trained=0
  for v in "${variants[@]}"; do [[ $v == shipped ]] || trained=$(( trained + 1 )); done
  if (( ! TINY && trained )); then
    minutes=$("$PY" -c "print(round(max(0.5, min(${TRAIN_MINUTES:-99},
      ($(left) - ${#variants[@]} * $VARIANT_RESERVE_S) / $trained / 60)), 2))")
  fi
  local steps=$(( TRAIN_STEPS > 0 ? TRAIN_STEPS : 100000 )) train_s
  train_s=$("$PY" -c "print(int(60 * $minutes))")
  local i=0
  for v in "${variants[@]}"; do
    i=$(( i + 1 ))
    local dir="$WORK/$v" flags
    read -ra flags <<< "$(variant_flags "$v")"
    mkdir -p "$dir"
    if [[ $v == shipped ]]; then
      # The baseline: INIT_DRAFT as it is, measured by the same stages. Only what a trained variant's
      # folder holds: its old train log stays behind (the table's loss and step columns compare the
      # trained variants), and so does its draft vocabulary (train-draft writes none, so every row
      # drafts from the whole vocabulary).
      stage "variant $i/${#variants[@]}: shipped ($INIT_DRAFT, untrained here)"
      mkdir -p "$dir/drafter"
      cp "$INIT_DRAFT"/config.json "$INIT_DRAFT"/model.safetensors "$dir/drafter/"
    else
      stage "variant $i/${#variants[@]}: $v (${flags[*]}; ${minutes} min, 0: steps only; $steps steps at most)"
      dspark train-draft --data "${DATA[@]}" --out "$dir/drafter" --work-dir "$dir/train" --restart \
        "${flags[@]}" --seed 0 --run-index 0 --lr "$LR" --steps "$steps" --max-minutes "$minutes" "${TRAIN_ARGS[@]}"
    fi

    stage "$v: held-out teacher-forced tau (calibration)"
    dspark calibrate-draft --draft "$dir/drafter" --data "${DATA[@]}" --report "$dir/calibration.json" \
      "${CAL_ARGS[@]}"

    stage "$v: where its drafts miss, by the target's own certainty (benchmarks/tau_limits.py)"
    "$PY" "$ROOT/benchmarks/tau_limits.py" --data "${DATA[@]}" --draft "$dir/drafter" \
      --json "$dir/tau_limits.json" "${LIMITS_ARGS[@]}" || echo "tau_limits of $v failed (exit $?)"

    stage "$v: drafter cost per step"
    dspark draft-cost --draft-model "$dir/drafter" --out "$dir/cost.json" "${COST_ARGS[@]}"

    stage "$v: tau through the engine (static, greedy)"
    local limit
    # The time left, less what the variants after this one need.
    limit=$(( $(left) - (${#variants[@]} - i) * (VARIANT_RESERVE_S + train_s) - 5 ))
    (( limit > 30 )) || limit=30
    timeout "$limit" "$PY" "$ROOT/training/run_dspark.py" eval-acceptance --draft-model "$dir/drafter" \
      --prompts training/prompts_eval.jsonl --modes static --temperatures 0 --out "$dir/eval.json" \
      "${EVAL_ARGS[@]}" || echo "evaluation of $v stopped (exit $?)"

    "$PY" "$ROOT/training/variants_table.py" "$WORK" "${variants[@]:0:i}" > "$OUT/variants.md"
    cat "$OUT/variants.md"
  done
}

finish() {
  (cd "$WORK" && find . \( -name '*.json' -o -name 'train_log.jsonl' \) -not -path '*/train/*' -print0 \
    | tar -czf "$OUT/reports.tar.gz" --null -T -)
  count_out | tee -a "$OUT/run.log"
}

rm -rf "$OUT/variants.md" "$OUT/reports.tar.gz" "$WORK"
mkdir -p "$OUT" "$WORK"
trap finish EXIT
run 2>&1 | tee "$OUT/run.log"
