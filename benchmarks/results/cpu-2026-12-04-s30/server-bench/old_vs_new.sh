#!/usr/bin/env bash
# Session 30: through the server on the CPU, the code before the packed CPU path (a clone at 72c5af0 with
# its own `make setup`, OLD) against this tree (NEW), servers started in turn, two rounds, concurrency
# 4 and 1, plain (`--num-draft-tokens 0`) and the serve default, 8 bench prompts x 32 tokens.
#   OLD=/tmp/old bash benchmarks/results/cpu-2026-12-04-s30/server-bench/old_vs_new.sh
set -uo pipefail
NEW=$(cd "$(dirname "$0")/../../../.." && pwd)
OLD=${OLD:-/tmp/old}
OUT=${OUT:-$NEW/benchmarks/results/cpu-2026-12-04-s30/server-bench}
bench() {  # tree label
  (cd "$1" && setsid .venv/bin/dspark serve --http-port 18000 --grpc-port 18001 --metrics-port 18002 \
    --openai-port 18003 --model-repository model_repository > /tmp/serve-"$2".log 2>&1 &)
  for _ in $(seq 1 120); do curl -sf localhost:18000/v2/health/ready > /dev/null && break; sleep 1; done
  local b="$NEW/.venv/bin/dspark-client bench --url localhost:18001 --num-prompts 8 --max-tokens 32 --ignore-eos"
  $b --concurrency 4 > /dev/null 2>&1  # warm-up
  for c in 4 1; do
    $b --concurrency $c --num-draft-tokens 0 --json "$OUT/$2-plain-c$c-r$3.json" | tail -1 | sed "s/^/$2 plain   /"
    $b --concurrency $c --json "$OUT/$2-default-c$c-r$3.json" | tail -1 | sed "s/^/$2 default /"
  done
  pkill -f "dspark serve"; sleep 3; pkill -9 -f triton_python_backend_stub; pkill -9 -f tritonserver; sleep 1
}
for round in 1 2; do
  bench "$OLD" old "$round"
  bench "$NEW" new "$round"
done
