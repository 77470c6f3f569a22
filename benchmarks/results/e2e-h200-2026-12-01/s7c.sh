#!/usr/bin/env bash
# Session 7, GPU sequence 1: sampling-path + tier tests, b64 kernel profile, e2e with the new tiers.
set -uo pipefail
export PYTHONUNBUFFERED=1
START=$(date +%s); BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
R=$OUT/r; mkdir -p $R
finish() { cd $OUT && tar czf s7c.tgz r && rm -rf r; }
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
item costs 40 100 python3 .carry/host_costs.py 64
grep -E "^==|StaticLayout.fill|write_verify|propose|LLMEngine.step|compute_logits" $R/costs.log
cd benchmarks
item e2e 150 230 python3 e2e.py --device cuda --batch-sizes 1,8,64 --max-tokens 96 --sustained 4 --repeats 3 --phases --out $R/e2e.json
grep -A30 "^| batch" $R/e2e.log | head -30
cd ..
item tests 60 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_kernels_layout.py -k "not emulated"
tail -3 $R/tests.log
echo "left $(left) s"
