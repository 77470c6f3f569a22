#!/usr/bin/env bash
# One device call that re-validates the GPU path and refreshes the GPU tables of benchmarks/RESULTS.md.
#
#   bash benchmarks/gpu_check.sh            # on an nvidia-h200 machine, through the `device` tool
#
# Stages (each under its own time limit, each writing into $OUT even when a later one fails):
#   1. the SmolLM2 target: converted from .carry/ GGUF parts (parked in /tmp/carry by earlier calls, as
#      training/README.md describes) unless models/SmolLM2-135M-Instruct already exists;
#   2. the GPU tests: CUDA graphs == eager, sampling on the GPU path, training gradients, kernel
#      parity, planner, draft context and the engine suite (on the GPU when there is one; the slow
#      losslessness suite stays in CI);
#   3. benchmarks/profile_host.py: cProfile of one batch-64 SmolLM2 generate() per speculation mode;
#   4. benchmarks/gpu_e2e.py: SmolLM2 end to end, the Qwen3-8B-shaped step against its floor, and the
#      8B forced-acceptance end to end (see that script);
#   5. serving on the GPU: the real tritonserver (`dspark serve`, the nvidia-pytriton wheel) started by
#      the serving integration tests (text and ids, streaming and not, cancel, faults), when the wheels
#      are here (parked in /tmp/carry like the GGUF parts, see below);
#   6. benchmarks/serving_overhead.py: the offline engine against the same engine behind the server;
#   7. benchmarks/stress.py: the CUDA-graph stress and regression run through tritonserver (fresh-start
#      captures, four servers under 5 minutes of mixed gRPC traffic, checks, compute-sanitizer);
#   (between 4 and 5) gpu_e2e.py --parts profile: where the Qwen3-8B-shaped step's time goes (kernels by
#      category, GEMM bandwidth against the copy bandwidth and F.linear alone, gaps; batch 1, 8, 64 and
#      batch 1 window 8; chrome traces of batch 1) in $OUT/step-profile/ (STEP_PROFILE_S, default 0:
#      skipped; the run is told to start nothing 20 s before it; STEP_PROFILE_ARGS);
#   (before 6) benchmarks/engine_process_check.py: the offline engine, the same engine stepped in
#      process by a closed loop, and in its engine process without tritonserver, interleaved rounds
#      (EPC_S, default 0: skipped; EPC_ARGS, e.g. "--levels 1,8,64 --mode static"; $OUT/epc.{json,log});
#   (between 4 and 5) benchmarks/overlap.py: overlap scheduling on and off, tokens/s per mode and batch
#      size and the GPU's busy share of steady decode (OVERLAP_S, default 0: skipped; OVERLAP_ARGS).
#   (after 6) benchmarks/served_drift.py: one server kept up through quiet, burst, after and rested
#      windows, each beside the offline engine (DRIFT_S, default 0: skipped; DRIFT_ARGS; ~20 s a window
#      of SmolLM2 at 8 streams on the H200; $OUT/drift.{md,json,log}).
# Limits (seconds): TESTS_S (default 420; 0 skips them), PROFILE_S and E2E_S (default 0: skipped, the
# tests need the call's time; e.g. TESTS_S=0 PROFILE_S=100 E2E_S=330 refreshes the tables in a call of its
# own; E2E_ARGS are added to gpu_e2e.py's, e.g. "--kernel-paths gemv,no-pdl,cublas"). PROFILE_ARGS go
# to profile_host.py (e.g. "--kernels --modes off,static"). SERVING_S (default
# 300; 0 skips; SERVING_TESTS: which test files, text and ids, streaming and not, cancel, several instances
# sharing the engine by default) and
# OVERHEAD_S (default 0: skipped), OVERHEAD_ARGS for serving_overhead.py (it measures each level's pair
# --rounds times, default 3: one round of two modes at five levels took ~200 s on the H200 with the
# start-ups, so three fit one call with one mode, or two modes at --rounds 2). STRESS_S (default 0: skipped; it
# needs a call of its own: TESTS_S=0 SERVING_S=0 STRESS_S=540), STRESS_ARGS for stress.py; the run is
# told to end 15 s before STRESS_S (--deadline-s) and writes $OUT/stress/{stress.json,stress.md,...}.
# The tests run in TEST_WORKERS (default 8) pytest-xdist processes sharing the GPU: they are mostly bound
# by the host (small models, Triton compiles, graph captures), so one process leaves the GPU idle. The
# whole list took 143 s so on an H200 (2026-12-01, the big_gpu_memory test alone after the workers);
# one process had done about a third of it in 270 s.
# Serving wheels (the device's Python 3.12 has none of them): `bash benchmarks/prepare_carry.sh` puts
# them (and the GGUF parts) into .carry/c1 .. c5; by hand: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 ...` (the device README's platform flags) nvidia-pytriton==0.7.0
# numpy==1.26.4 python-rapidjson tritonclient grpcio protobuf geventhttpclient gevent greenlet zope.event
# zope.interface brotli into .carry/, the pytriton wheel split in two (`split -n 2 -d -a 2 WHEEL
# WHEEL.part-`), and park them in /tmp/carry over calls as the GGUF parts (64 MiB a call).
# TEST_FILES and PARTS (gpu_e2e.py --parts) narrow a call down. Results: $OUT/gpu-tests.log,
# $OUT/gpu-tests-big-memory.log, $OUT/profile/<mode>-b64.txt, $OUT/e2e/results.{json,md}, $OUT/e2e.log,
# $OUT/step-profile/{results.json,results.md,trace-*.json.gz}, $OUT/step-profile.log, $OUT/overhead.{json,md} and
# $OUT/overhead-raw.tgz (py-spy samples and server logs).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dspark-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"

# Wheels for serving (parked in /tmp/carry; nvidia-pytriton in parts): the stub embeds this Python and
# needs numpy < 2 in it, so numpy 1.26 replaces the image's (torch runs with either).
# What the call carried in a subfolder of .carry/ (e.g. .carry/c4) counts as carried in .carry/ itself.
mkdir -p .carry
cp /tmp/carry/*.whl* .carry/*/*.whl* .carry/*/*.gguf.* .carry/ 2>/dev/null || true
if compgen -G ".carry/*.whl.part-*" >/dev/null || compgen -G ".carry/*.whl" >/dev/null; then
  mkdir -p /tmp/wheels
  for first in .carry/*.whl.part-00; do
    [[ -e "$first" ]] && cat "${first%.part-00}".part-* > /tmp/wheels/"$(basename "${first%.part-00}")"
  done
  cp .carry/*.whl /tmp/wheels/ 2>/dev/null
  rm -f /tmp/wheels/gguf-*.whl
  python3 -m pip install -q --no-deps --no-index /tmp/wheels/*.whl 2>&1 | tail -2
  python3 -c "import numpy, importlib.util as u, tritonclient.grpc; assert u.find_spec('pytriton'); print('serving wheels: numpy', numpy.__version__)"
fi

# A stage stopped by its timeout leaves the servers it started (each in its own session) serving: the
# next stage's server would find its ports taken. (Bracketed patterns: pkill must not match this shell.)
end_leftover_servers() {
  pkill -TERM -f "[t]riton_launcher" 2>/dev/null
  pkill -TERM -f "[t]ritonserver" 2>/dev/null
  sleep 3
  pkill -KILL -f "[t]ritonserver" 2>/dev/null
  pkill -KILL -f "[t]riton_launcher" 2>/dev/null
  true
}

# The serving stages need tritonserver (the nvidia-pytriton wheel) and its gRPC client here.
serving_wheels_installed() {
  python3 -c "import importlib.util as u, tritonclient.grpc; assert u.find_spec('pytriton')" 2>/dev/null
}

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f models/SmolLM2-135M-Instruct/config.json ]]; then
  cp /tmp/carry/"$GGUF_NAME".part-* .carry/ 2>/dev/null || true
  if compgen -G ".carry/$GGUF_NAME.part-*" >/dev/null; then
    cat .carry/"$GGUF_NAME".part-* > /tmp/"$GGUF_NAME"
    python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .carry/gguf-*.whl
    python3 training/run_dspark.py import-gguf --gguf /tmp/"$GGUF_NAME" | tail -1
  else
    echo "no SmolLM2 GGUF parts in .carry/ or /tmp/carry: SmolLM2 tests and benchmarks will fail"
  fi
fi

echo "=== GPU tests"
TEST_FILES=${TEST_FILES:-"tests/test_cuda_graphs.py tests/test_training_loss.py \
  tests/test_kernels_norm_rotary.py tests/test_kernels_activation.py tests/test_kernels_attention.py tests/test_kernels_accept.py tests/test_kernels_gemv.py tests/test_dependent_launch.py \
  tests/test_kernels_layout.py tests/test_kernels_markov.py tests/test_planner.py tests/test_draft_context.py \
  tests/test_host_to_device.py tests/test_penalties_logprobs_gpu.py \
  tests/test_engine.py tests/test_launch_ahead.py tests/test_overlap_scheduling.py tests/test_decode_burst.py \
  tests/test_draft_vocab.py tests/test_speculation_gate.py tests/test_draft_length.py tests/test_scheduler.py \
  tests/test_kv_budget.py tests/test_overlap_bench.py"}
WORKERS=()
if [[ "${TEST_WORKERS:-8}" -gt 1 ]] && python3 -c "import xdist" 2>/dev/null; then
  WORKERS=(-n "${TEST_WORKERS:-8}" --dist load)
fi
# -v and --durations: a call that runs out of time still says which test it was in and what was slow;
# faulthandler dumps the stacks of a test that runs past 120 s. Two CPU threads a worker: the workers
# share 16 cores. Tests marked big_gpu_memory run after the workers, alone: beside them the workers'
# engines ran out of GPU memory.
if [[ "${TESTS_S:-420}" == 0 ]]; then
  echo "skipped (TESTS_S=0)"
else
  started=$SECONDS
  # shellcheck disable=SC2086  # a list of paths
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} timeout "${TESTS_S:-420}" python3 -m pytest -v --durations=30 \
    -o faulthandler_timeout=120 -p no:cacheprovider "${WORKERS[@]}" -m "not big_gpu_memory" $TEST_FILES \
    > "$OUT/gpu-tests.log" 2>&1
  status=$?
  echo "pytest exit $status after $((SECONDS - started)) s (${WORKERS[*]:-one process})"
  tail -3 "$OUT/gpu-tests.log"
  left=$((${TESTS_S:-420} - (SECONDS - started)))
  # shellcheck disable=SC2086  # a list of paths
  timeout "$((left > 1 ? left : 1))" python3 -m pytest -v --durations=10 -o faulthandler_timeout=120 \
    -p no:cacheprovider -m big_gpu_memory $TEST_FILES > "$OUT/gpu-tests-big-memory.log" 2>&1
  status=$?
  [[ $status == 5 ]] && status="0 (none selected)"
  echo "pytest (big_gpu_memory, one process) exit $status after $((SECONDS - started)) s in all"
  tail -1 "$OUT/gpu-tests-big-memory.log"
fi

echo "=== benchmarks/profile_host.py (where the host time of a batch-64 step goes)"
if [[ "${PROFILE_S:-0}" == 0 ]]; then
  echo "skipped (PROFILE_S=0)"
else
  # shellcheck disable=SC2086  # PROFILE_ARGS is a list of arguments
  (cd benchmarks && timeout "$PROFILE_S" python3 profile_host.py --device cuda --batch 64 \
    --max-tokens 32 --out "$OUT/profile" ${PROFILE_ARGS:-}) > "$OUT/profile.log" 2>&1
  echo "profile exit $?"
  tail -3 "$OUT/profile.log"
fi

echo "=== benchmarks/gpu_e2e.py"
if [[ "${E2E_S:-0}" == 0 ]]; then
  echo "skipped (E2E_S=0)"
else
  # shellcheck disable=SC2086  # E2E_ARGS is a list of arguments (later ones override the defaults)
  timeout "$E2E_S" python3 benchmarks/gpu_e2e.py --out "$OUT/e2e" --parts "${PARTS:-step,smollm2,e2e8b}" \
    --step-batches 1,8,64,256 --repeats 9 --e2e-batches 1,8,64 --max-tokens 96 --accept 4 ${E2E_ARGS:-} \
    > "$OUT/e2e.log" 2>&1
  echo "gpu_e2e exit $?"
  grep -v "^step \|Loading" "$OUT/e2e.log" | tail -40
fi

echo "=== gpu_e2e.py --parts profile (where a target step's time goes)"
if [[ "${STEP_PROFILE_S:-0}" == 0 ]]; then
  echo "skipped (STEP_PROFILE_S=0)"
else
  # shellcheck disable=SC2086  # STEP_PROFILE_ARGS is a list of arguments
  timeout "$STEP_PROFILE_S" python3 benchmarks/gpu_e2e.py --out "$OUT/step-profile" --parts profile --trace \
    --budget-s "$((STEP_PROFILE_S > 40 ? STEP_PROFILE_S - 20 : STEP_PROFILE_S / 2))" ${STEP_PROFILE_ARGS:-} \
    > "$OUT/step-profile.log" 2>&1
  echo "step profile exit $?"
  grep "^batch \|^profile \|FAILED\|Error" "$OUT/step-profile.log" | tail -30
fi

echo "=== benchmarks/overlap.py (overlap scheduling on and off: tokens/s and GPU busy share)"
if [[ "${OVERLAP_S:-0}" == 0 ]]; then
  echo "skipped (OVERLAP_S=0)"
else
  # shellcheck disable=SC2086  # OVERLAP_ARGS is a list of arguments
  timeout "$OVERLAP_S" python3 benchmarks/overlap.py --device cuda --out "$OUT/overlap.json" \
    ${OVERLAP_ARGS:-} > "$OUT/overlap.log" 2>&1
  echo "overlap exit $?"
  tail -16 "$OUT/overlap.log"
fi

echo "=== serving on the GPU (tritonserver + the serving integration tests)"
if [[ "${SERVING_S:-300}" == 0 ]]; then
  echo "skipped (SERVING_S=0)"
elif ! serving_wheels_installed; then
  echo "skipped: no nvidia-pytriton / tritonclient here (carry the wheels)"
else
  started=$SECONDS
  # shellcheck disable=SC2086  # a list of paths
  timeout "$SERVING_S" python3 -m pytest -v --durations=10 -o faulthandler_timeout=120 -p no:cacheprovider \
    ${SERVING_TESTS:-tests/test_serving_grpc.py tests/test_serving_http.py tests/test_serving_cancel.py \
      tests/test_serving_instances.py} \
    > "$OUT/gpu-serving-tests.log" 2>&1
  echo "pytest exit $? after $((SECONDS - started)) s"
  tail -3 "$OUT/gpu-serving-tests.log"
  end_leftover_servers
fi

echo "=== benchmarks/engine_process_check.py (offline, in-process loop, engine process; no server)"
if [[ "${EPC_S:-0}" == 0 ]]; then
  echo "skipped (EPC_S=0)"
else
  # shellcheck disable=SC2086  # EPC_ARGS is a list of arguments
  timeout "$EPC_S" python3 benchmarks/engine_process_check.py --out "$OUT/epc.json" ${EPC_ARGS:-} \
    > "$OUT/epc.log" 2>&1
  echo "engine_process_check exit $?"
  grep "^level\|^synchronizing" "$OUT/epc.log" | tail -10
fi

echo "=== benchmarks/serving_overhead.py (offline engine vs the same engine behind the server)"
if [[ "${OVERHEAD_S:-0}" == 0 ]]; then
  echo "skipped (OVERHEAD_S=0)"
else
  # shellcheck disable=SC2086  # OVERHEAD_ARGS is a list of arguments
  timeout "$OVERHEAD_S" python3 benchmarks/serving_overhead.py --out "$OUT/overhead" ${OVERHEAD_ARGS:-} \
    > "$OUT/overhead.log" 2>&1
  echo "serving_overhead exit $?"
  end_leftover_servers
  grep -v "^=== " "$OUT/overhead.log" | tail -20
  cp "$OUT"/overhead/overhead.{json,md} "$OUT"/ 2>/dev/null
  for profile in "$OUT"/overhead/*/py-spy-*.txt; do  # --profile-levels in OVERHEAD_ARGS
    [[ -e "$profile" ]] && python3 benchmarks/pyspy_top.py "$profile" > "${profile%.txt}-top.txt"
  done
  tail -30 "$OUT"/overhead/*/server.log > "$OUT/overhead-server-logs.txt" 2>/dev/null
  # One file for the rest (py-spy samples and tops, server logs): a call brings back 8 files at most.
  tar -czf "$OUT/overhead-raw.tgz" -C "$OUT" --exclude model_repository overhead && rm -rf "$OUT/overhead"
fi

echo "=== benchmarks/served_drift.py (one server through quiet, burst, after and rested windows)"
if [[ "${DRIFT_S:-0}" == 0 ]]; then
  echo "skipped (DRIFT_S=0)"
elif ! serving_wheels_installed; then
  echo "skipped: no nvidia-pytriton / tritonclient here (carry the wheels)"
else
  # shellcheck disable=SC2086  # DRIFT_ARGS is a list of arguments
  timeout "$DRIFT_S" python3 benchmarks/served_drift.py --out "$OUT/drift" ${DRIFT_ARGS:-} > "$OUT/drift.log" 2>&1
  echo "served_drift exit $?"
  end_leftover_servers
  cat "$OUT/drift/drift.md" 2>/dev/null
  cp "$OUT"/drift/drift.{md,json} "$OUT"/ 2>/dev/null
  rm -rf "$OUT/drift"
fi

echo "=== benchmarks/stress.py (CUDA-graph stress and regression run through tritonserver)"
if [[ "${STRESS_S:-0}" == 0 ]]; then
  echo "skipped (STRESS_S=0)"
elif ! serving_wheels_installed; then
  echo "skipped: no nvidia-pytriton / tritonclient here (carry the wheels)"
else
  # shellcheck disable=SC2086  # STRESS_ARGS is a list of arguments
  timeout "$STRESS_S" python3 benchmarks/stress.py --out "$OUT/stress" --deadline-s "$((STRESS_S - 15))" \
    ${STRESS_ARGS:-} > "$OUT/stress.log" 2>&1
  echo "stress exit $? (0 passed, 1 a check failed, 2 a phase did not run)"
  end_leftover_servers
  tail -40 "$OUT/stress.log"
fi
