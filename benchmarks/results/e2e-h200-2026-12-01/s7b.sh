#!/usr/bin/env bash
# Session 7, GPU sequence 1: sampling-path + tier tests, b64 kernel profile, e2e with the new tiers.
set -uo pipefail
export PYTHONUNBUFFERED=1
START=$(date +%s); BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
R=$OUT/r; mkdir -p $R
finish() { cd $OUT && tar czf s7b.tgz r && rm -rf r; }
trap finish EXIT
item() {
  local name=$1 need=$2 limit=$3; shift 3
  local l; l=$(left)
  if (( l < need )); then echo "skip $name ($l s left)"; return; fi
  (( limit > l - 5 )) && limit=$(( l - 5 ))
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name exit $? in $(( $(date +%s) - t0 )) s"
}
cp /tmp/carry/*.part-0[01] .carry/
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
G=SmolLM2-135M-Instruct.Q4_1.gguf
cat .carry/$G.part-* > /tmp/$G
[[ "$(sha256sum < /tmp/$G | cut -d' ' -f1)" == "$(cat .carry/$G.sha256)" ]] || echo "GGUF checksum differs"
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .carry/gguf-*.whl
python3 training/run_dspark.py import-gguf --gguf /tmp/$G | tail -1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt 2>&1
cd benchmarks
item prof64 60 120 python3 profile_host.py --device cuda --batch 64 --max-tokens 32 --modes off,static --top 70 --out $R/prof
item prof8 40 80 python3 profile_host.py --device cuda --batch 8 --max-tokens 32 --modes off,static --top 50 --out $R/prof
head -1 $R/prof/*.txt
echo "left $(left) s"
