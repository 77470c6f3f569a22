#!/usr/bin/env bash
# Session 30, issue 18: why the served engine's host phases run ~1.3x their offline time at every
# level, 1 stream too. One stub against four at 1 and 8 streams (plain, three rounds each), and which
# processes hold a CUDA context on the GPU while four stubs serve. Run from the repository root on the
# H200 after `TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh` (wheels, SmolLM2).
set -uo pipefail
OUT=${OUT:-/tmp/diag}
mkdir -p "$OUT"
for instances in 1 4; do
  if [[ $instances == 4 ]]; then
    # While the four-stub run serves: the GPU's compute processes and what each process is.
    (sleep 45; nvidia-smi --query-compute-apps=pid,used_memory --format=csv;
     ps -eo pid,ppid,nlwp,pcpu,cmd | grep -E "stub|spawn_main|tritonserver|load_generator" | grep -v grep | cut -c1-160
    ) > "$OUT/gpu-procs-$instances.txt" 2>&1 &
  fi
  timeout 230 python3 benchmarks/serving_overhead.py --out /tmp/ov-$instances --levels 1,8 --modes off \
    --requests-per-stream 8 --user-defaults --rounds 3 --instances "$instances" > "$OUT/overhead-$instances.log" 2>&1
  echo "instances $instances exit $?"
  cp /tmp/ov-$instances/overhead.md "$OUT/overhead-$instances.md" 2>/dev/null
  head -4 "$OUT/overhead-$instances.md"
  grep -A4 "host_schedule_ms" "$OUT/overhead-$instances.md" | head -5
done
wait
cat "$OUT/gpu-procs-4.txt"
