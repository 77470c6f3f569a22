#!/usr/bin/env bash
# The next device session's calls (written in session 36, which had no device time). First, here:
#   bash benchmarks/prepare_carry.sh
#   mkdir -p .carry/base35 && git archive 83f678b backend | tar -x -C .carry/base35
# then, with drafters/ and training/prompts_train.jsonl moved out of the tree, back to back (the machine
# goes cold 30 s after a call): run(carry=[".carry/cN"], command="mkdir -p /tmp/carry && cp .carry/cN/*
# /tmp/carry/") for N = 1, 2, 3, 5; put the two paths back; then
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh tests   carry [".carry/c4"]        (~330 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh bench   carry [".carry/c4", ".carry/base35"]
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh smt   carry [".carry/c4"]          (~430 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh diagnose   carry [".carry/c4"]     (~450 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh plain-cost   carry [".carry/c4"]   (~200 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh clients   carry [".carry/c4"]      (~330 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh window   carry [".carry/c4", ".carry/base42"] (~330 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh timeline   carry [".carry/c4"]     (~200 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh gate-order   carry [".carry/c4"]   (~200 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh served-bursts   carry [".carry/c4"] (~220 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh bursts-ahead   carry [".carry/c4"]  (~330 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh bench-burst   carry [".carry/c4"]   (~270 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh mbt1024   carry [".carry/c4"]      (~400 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh bench-defaults   carry [".carry/c4"] (~450 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh overlap   carry [".carry/c4"]      (~330 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh overlap-isolated   carry [".carry/c4"] (~400 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh anchor   carry [".carry/c4"]       (~560 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s48   carry [".carry/c4"]          (~450 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s49   carry [".carry/c4", ".carry/base49"] (~350 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh warm   carry [".carry/c4"]         (~430 s; ran in s51)
#   V=warm-anchor OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh keep   carry [".carry/c4"] (~20 s, right after warm)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh gate128   carry [".carry/c4"]      (~330 s; session 52)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh rows   no carry, nothing parked   (~500 s; sessions 54-55)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s57   carry [".carry/c4"] after parking g01, g2 (~400 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s57b   carry [".carry/c4", ".carry/base57"] after parking g01, g2 (~480 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s58   no carry, nothing parked (~260 s with the start)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s59   carry [".carry/c4", ".carry/base59"] after parking g01, g2 (~200 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh timeline64   carry [".carry/c4"] after parking g01, g2 (~100 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s60   carry [".carry/c4", ".carry/base60"] after parking g01, g2 (~250 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s61   carry [".carry/c4", ".carry/base60"] after parking c1, c2, c3+c5 (~500 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s61c   carry [".carry/c4", ".carry/base60"] after parking c1, c2, c3+c5 (~520 s;
#     s61d: a ~320 s cut of it)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s62   carry [".carry/c4", ".carry/base62"] after parking c1, c2, c3+c5 (~200 s)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh s63   carry [".carry/c4"] after parking c1, c2, c3+c5 (~380 s)
#   VARIANTS="shipped warm warm-vocab" OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh warm   carry
#     [".carry/c4"] after parking c1, c2, c3+c5 (~570 s; session 64: the shipped drafter trained on over its
#     draft vocabulary only against over every token, equal steps: steps a second, engine tau)
#   OUT=$OUT bash benchmarks/results/h200-next-s37/next_gpu.sh data-train   carry [".carry/c4", ".carry/distill"]
#     (~530 s; parked: .carry/g01 then .carry/g2, the GGUF alone, with drafters/, benchmarks/results/ and
#     training/prompts_train.jsonl moved aside meanwhile; drafters/ and the prompts back for this call,
#     benchmarks/results/ only as this script (since session 56 the tree with it and c4 is over 64 MiB))
#
# tests: the GPU tests, big-memory tests and the serving tests through tritonserver at HEAD (nothing after
#   83f678b has run on a GPU: the gate's median step times, the frozen startup heaps, session 36's
#   benchmark changes, session 37's acceptance prior in the gate; its oneDNN path is CPU only; session
#   38's prompt lookup: copies on CUDA in the sampling and eager paths, the gate's verified counts).
# bench (~480 s): issue 18's table with the new gate and frozen heaps and each side's loop-thread clock
#   (CPU share, involuntary switches: a descheduled served loop against one that runs slower), then the
#   offline engine beside spinning and memory-streaming neighbours (host_neighbours.py: does the host's
#   memory system, shared with the server's processes, slow the loop?), then the gate A/B (83f678b's
#   moving-average gate against the median with session 37's acceptance prior, plain and the serve
#   default, batch 128 and 64).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dspark-s37}
mkdir -p "$OUT"
# The serve default and plain decoding of HEAD against an older tree's (`$1`, its backend/), batches
# run to their end (128 tokens; AB_BATCHES, ROUNDS) and with lengths spread over 64-128 tokens.
gate_ab() {
  timeout "$AB_S" python3 benchmarks/ab_trees.py --base "$1" --device cuda \
    --batch-sizes "${AB_BATCHES:-64,8,128,1}" --modes off,default --rounds "${ROUNDS:-3}" --max-tokens 128 \
    --out "$OUT/ab-margin.json" > "$OUT/ab-margin.log" 2>&1
  echo "ab margin: exit $?"; grep -vE "^\{" "$OUT/ab-margin.log" | tail -12
  timeout "$AB2_S" python3 benchmarks/ab_trees.py --base "$1" --device cuda \
    --batch-sizes 64,16 --modes off,default --rounds 3 --max-tokens 128 --max-tokens-spread 0.5 \
    --out "$OUT/ab-margin-spread.json" > "$OUT/ab-margin-spread.log" 2>&1
  echo "ab margin spread: exit $?"; grep -vE "^\{" "$OUT/ab-margin-spread.log" | tail -8
}
case "${1:-}" in
  tests)
    OUT=$OUT TESTS_S=${TESTS_S:-330} SERVING_S=${SERVING_S:-110} bash benchmarks/gpu_check.sh > "$OUT/check.log" 2>&1
    echo "gpu_check: exit $?"; grep -E "passed|failed|error" "$OUT/check.log" | tail -6
    ;;
  tests-lite)
    # When machines are scarce (one call, nothing parked): the GPU tests without the SmolLM2 GGUF or the
    # serving wheels, carry [".carry/x"] (pytest-xdist and execnet: `mkdir -p .carry/x && cp
    # .carry/c2/pytest_xdist-*.whl .carry/c2/execnet-*.whl .carry/x/`). The tests that load SmolLM2
    # (in test_cuda_graphs, test_kv_budget and three kernel files) fail for want of it; the rest run.
    OUT=$OUT TESTS_S=${TESTS_S:-330} SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/check-lite.log" 2>&1
    echo "gpu_check (lite): exit $?"; grep -E "passed|failed|error" "$OUT/check-lite.log" | tail -6
    grep -E "^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -40
    ;;
  bench)
    OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-250} OVERHEAD_ARGS="--levels 1,8,64,128,256 \
      --modes off,default --requests-per-stream 8 --user-defaults --rounds 2" bash benchmarks/gpu_check.sh \
      > "$OUT/overhead-check.log" 2>&1
    echo "overhead: exit $?"; head -8 "$OUT/overhead.md"
    grep -A12 "Engine loop, offline" "$OUT/overhead.md" | tail -11
    (cd benchmarks && timeout "${NEIGHBOURS_S:-100}" python3 host_neighbours.py --device cuda \
      --batch-sizes 64,256 --neighbours none,spin:8,stream:2:64,stream:8:64 --rounds 3 --max-tokens 96 \
      --out "$OUT/neighbours.json" > "$OUT/neighbours.log" 2>&1)
    echo "neighbours: exit $?"; grep -E "^batch" "$OUT/neighbours.log"
    timeout "${AB_S:-90}" python3 benchmarks/ab_trees.py --base .carry/base35/backend --device cuda \
      --batch-sizes 128,64 --modes off,default --rounds "${ROUNDS:-6}" --max-tokens 96 \
      --out "$OUT/ab-gate.json" > "$OUT/ab-gate.log" 2>&1
    echo "ab gate: exit $?"; grep -E "^\{" "$OUT/ab-gate.log"
    ;;
  bursts-ahead)
    # Session 44 built bursts launched behind the step or burst on the device (graph-replayed bursts;
    # tested on the CPU's emulated graphs only). Their GPU tests (real CUDA graphs: bursts, launch-ahead,
    # overlap, graphs), then bursts against launch-ahead alone offline, plain and static, at 1, 8, 64 and
    # 128 (before session 44 bursts gave plain 0.81x at 64 on an H100) (~330 s, carry [".carry/c4"]).
    OUT=$OUT TESTS_S=${TESTS_S:-150} SERVING_S=0 TEST_FILES="tests/test_decode_burst.py \
      tests/test_launch_ahead.py tests/test_overlap_scheduling.py tests/test_cuda_graphs.py" \
      bash benchmarks/gpu_check.sh > "$OUT/check.log" 2>&1
    echo "gpu_check: exit $?"; grep -E "passed|failed|error" "$OUT/check.log" | tail -4
    timeout "${OVERLAP_S:-200}" python3 benchmarks/overlap.py --device cuda --batch-sizes 1,8,64,128 \
      --modes off,static --settings burst,ahead --repeats 2 --busy-steps 0 --out "$OUT/bursts-ahead.json" \
      > "$OUT/bursts-ahead.log" 2>&1
    echo "overlap: exit $?"; grep -A12 "^| batch" "$OUT/bursts-ahead.log"
    ;;
  bench-defaults)
    # Issue 18's table with the shipped defaults (since session 45 decode bursts of 4 on a GPU, prompts
    # deferred one burst), three rounds a level (one round's spread at 128-256 was 0.85-1.02) (~450 s,
    # carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-520} OVERHEAD_ARGS="--levels ${LEVELS:-1,8,64,128,256} \
      --modes off,default --requests-per-stream 8 --user-defaults --rounds ${ROUNDS:-3}" \
      bash benchmarks/gpu_check.sh > "$OUT/overhead-check.log" 2>&1
    echo "overhead: exit $?"; head -9 "$OUT/overhead.md"
    ;;
  mbt1024)
    # Session 47's question at 256 streams: a 1024-token step budget replayed from graphs (windows of up
    # to 4 positions for 256 requests, a burst's arrivals in one step) against the defaults' 512, both
    # modes, 128 and 256 streams, two rounds (~400 s, carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-520} OVERHEAD_ARGS="--levels ${LEVELS:-128,256} \
      --modes ${MODES:-off,default,off-mbt1024,default-mbt1024} --requests-per-stream 8 --user-defaults \
      --rounds ${ROUNDS:-2}" bash benchmarks/gpu_check.sh > "$OUT/overhead-check.log" 2>&1
    echo "overhead: exit $?"; head -9 "$OUT/overhead.md"
    ;;
  bench-burst)
    # Issue 18's table with decode bursts of 4 beside the defaults (modes off-burst4, default-burst4 of
    # serving_overhead.py: both sides burst), after served-bursts showed whether bursts lift served
    # tokens/s (~450 s, carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-470} OVERHEAD_ARGS="--levels ${LEVELS:-1,8,64,128,256} \
      --modes ${MODES:-off,off-burst4,default,default-burst4} --requests-per-stream 8 --user-defaults --rounds 1" \
      bash benchmarks/gpu_check.sh > "$OUT/overhead-check.log" 2>&1
    echo "overhead: exit $?"; head -12 "$OUT/overhead.md"
    ;;
  smt)
    # (The H100 machines have one thread a core: `spin:1@sibling` has no CPU there and the run exits.)
    # Session 40 (bench, H200): spinning neighbours on CPUs 1-8 made the pinned offline engine's batch-64
    # step 1.23x (every host phase 1.14-1.31x), memory-streaming ones no worse: the CPU, not the memory.
    # Which: the hyperthread beside the loop, or the host's clock with more cores busy? Then the served
    # engine process on a physical core of its own (CPU 2 and its SMT siblings; the rest of the server
    # and the load generator on the others) against unpinned, served / offline at 64 and 256 (~420 s).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    (cd benchmarks && timeout "${SMT_S:-130}" python3 host_neighbours.py --device cuda --batch-sizes 64 \
      --neighbours none,spin:1@sibling,spin:7@apart,spin:8 --rounds 4 --max-tokens 96 --out "$OUT/smt.json" \
      > "$OUT/smt.log" 2>&1)
    echo "neighbours: exit $?"; grep -E "^engine|^batch" "$OUT/smt.log"
    core=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import host_neighbours as h; \
      print(','.join(map(str, sorted(h.smt_siblings(2)))))")
    for pin in "" "$core"; do
      name=overhead-${pin:+pinned-}${pin:-unpinned}
      # shellcheck disable=SC2086  # the pin's flag is one or no argument
      timeout "${PIN_S:-130}" python3 benchmarks/serving_overhead.py --out "$OUT/$name" --levels 64,256 \
        --modes off --requests-per-stream 8 --user-defaults --rounds 2 ${pin:+--engine-cpus $pin} \
        > "$OUT/$name.log" 2>&1
      echo "$name: exit $?"; pkill -f "[t]riton_launcher"; pkill -f "[t]ritonserver"; sleep 2
      cp "$OUT/$name/overhead.md" "$OUT/$name.md" 2>/dev/null && head -6 "$OUT/$name.md"
      rm -rf "${OUT:?}/$name"
    done
    ;;
  diagnose)
    # A third call, if the bench's loop table leaves the served steps' 1.5x unexplained: the engine
    # process without tritonserver against the offline engine and the in-process closed loop (py-spy
    # samples of both at 256), then py-spy of the whole server at 256 streams (py-spy travels in c2).
    OUT=$OUT TESTS_S=0 SERVING_S=0 EPC_S=${EPC_S:-200} EPC_ARGS="--levels 64,256 --mode off --rounds 2 \
      --profile-level 256 --out-dir $OUT/epc" OVERHEAD_S=${OVERHEAD_S:-200} OVERHEAD_ARGS="--levels 256 \
      --modes off --requests-per-stream 8 --user-defaults --rounds 1 --profile-levels 256" \
      bash benchmarks/gpu_check.sh > "$OUT/diagnose-check.log" 2>&1
    echo "diagnose: exit $?"; tail -20 "$OUT/epc.log" 2>/dev/null; head -8 "$OUT/overhead.md"
    for f in "$OUT"/epc/*-top.txt; do [[ -e "$f" ]] && head -30 "$f"; done
    ;;
  plain-cost)
    # Session 41 (H100): the serve default ran 0.87x / 0.73x plain decoding offline at 128 / 256
    # requests, and its gate's probes timed a plain step at 2.2-3.2 ms where the plain engine's step
    # is ~1.9 ms (128). Does a plain step cost more in the serve default's engine (drafter loaded, its
    # features captured, its graphs) than in the plain engine? Host phases, then device kernels, of the
    # plain engine and of the default's engine held at plain steps (`profile_host.py`'s gated-plain),
    # at 128 and 256 requests (~200 s, carry [".carry/c4"] after parking c1-c3, c5).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    for batch in 128 256; do
      (cd benchmarks && timeout 100 python3 profile_host.py --device cuda --batch $batch --max-tokens 64 \
        --modes off,gated-plain,static --out "$OUT/plain-cost" > "$OUT/plain-cost-b$batch.log" 2>&1)
      echo "b$batch: exit $?"; cat "$OUT/plain-cost-b$batch.log"
      for mode in off gated-plain static; do echo "$mode: $(head -1 "$OUT/plain-cost/$mode-b$batch.txt")"; done
      (cd benchmarks && timeout 80 python3 profile_host.py --device cuda --batch $batch --max-tokens 64 \
        --modes off,gated-plain --kernels --out "$OUT/plain-cost-kernels" > /dev/null 2>&1)
      for mode in off gated-plain; do echo "$mode kernels: $(sed -n 2p "$OUT/plain-cost-kernels/$mode-b$batch.txt")"; done
    done
    ;;
  clients)
    # Issue 18 (session 41): served steps run every host phase 1.1-1.6x slower than offline, as the
    # offline loop does beside busy cores (1.16x with 7, 1.29x with 14 on the H100). The load generator
    # runs one worker process a CPU (16) beside the server; clients of a real deployment run elsewhere.
    # Served / offline with 16 client processes against 4, plain, at 8, 64 and 256 streams (~330 s).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    for procs in 16 4; do
      timeout "${CLIENTS_S:-150}" python3 benchmarks/serving_overhead.py --out "$OUT/clients-$procs" \
        --levels 8,64,256 --modes off --requests-per-stream 8 --user-defaults --rounds 2 \
        --client-processes $procs > "$OUT/clients-$procs.log" 2>&1
      echo "client processes $procs: exit $?"; head -6 "$OUT/clients-$procs/overhead.md"
      grep -A6 "^| mode | streams | steps_per_s" "$OUT/clients-$procs/overhead.md" | cut -c1-200
    done
    ;;
  window)
    # Session 42 (H100, plain-cost): the serve default held at plain steps ran 107 steps where the plain
    # engine ran 91 (256 requests, 64 tokens): its scheduler kept each decoding request's budget for a
    # whole verify window (1 + block), leaving prompts a quarter of the budget. The gate's choice now
    # sizes the windows as they are scheduled. A/B against 6173474 (carry [".carry/c4", ".carry/base42"]:
    # `git archive 6173474 backend`; with training/prompts_train.jsonl moved out of the tree, or the
    # carry passes 64 MiB), plain and the serve default, then the steps again (~190 s).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    timeout "${AB_S:-240}" python3 benchmarks/ab_trees.py --base .carry/base42/backend --device cuda \
      --batch-sizes 256,128,64 --modes off,default --rounds "${ROUNDS:-4}" --max-tokens 128 \
      --out "$OUT/ab-window.json" > "$OUT/ab-window.log" 2>&1
    echo "ab window: exit $?"; grep -vE "^\{" "$OUT/ab-window.log" | tail -14
    (cd benchmarks && timeout 80 python3 profile_host.py --device cuda --batch 256 --max-tokens 64 \
      --modes off,gated-plain --out "$OUT/plain-cost" > "$OUT/plain-cost-b256.log" 2>&1)
    echo "b256: exit $?"; cat "$OUT/plain-cost-b256.log"
    for mode in off gated-plain; do echo "$mode: $(head -1 "$OUT/plain-cost/$mode-b256.txt")"; done
    ;;
  timeline)
    # Session 42 (H100): at 64 requests the serve default's gate timed plain steps at 1.8-2.3 ms while
    # the plain engine's took 1.05-1.3 ms and the default's engine held at plain steps was as fast; it
    # chose drafting, 0.61-0.70x plain decoding offline. Every step's draft length, device time, finish-
    # to-finish time and the gate's time for it, serve default then plain, at 64 and 128, then again with
    # the synchronising calls and device allocations of each step (`--syncs`) (~260 s).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    for batch in 64 128; do
      (cd benchmarks && timeout 160 python3 gate_timeline.py --device cuda --batch $batch --max-tokens 256 --syncs \
        --out "$OUT/timeline-b$batch.json" > "$OUT/timeline-b$batch.log" 2>&1)
      echo "b$batch: exit $?"; cut -c1-400 "$OUT/timeline-b$batch.log" | tail -24
    done
    ;;
  gate-order)
    # Session 43: one engine at a time (`timeline`) the serve default ran 1.21x plain at 64 requests on
    # an H100, where session 42's `ab_trees.py --batch-sizes 256,128,64` gave 0.61x with its gate timing
    # plain steps at 1.8-2.3 ms. Does running 256 and 128 first, on engines sized for 256 (as ab_trees
    # does), move the gate at 64? 128 tokens, alone and after (~200 s, carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    for before in "" "256,128"; do
      name=order-${before:-alone}
      (cd benchmarks && timeout 150 python3 gate_timeline.py --device cuda --batch 64 --max-tokens 128 \
        --before "$before" --before-runs 5 --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1)
      echo "$name: exit $?"; cut -c1-300 "$OUT/$name.log" | tail -8
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('gate rates', d['default']['gate_rates'])" \
        "$OUT/$name.json"
    done
    ;;
  served-bursts)
    # Issue 18 (session 43): served steps at 64-128 streams are host-bound, every host phase 1.4-1.6x
    # offline's. Decode bursts (`decode_burst`) schedule, accept and emit once for K steps; offline on
    # the H200 they gave 0.92-1.02x launch-ahead (session 35), never measured through the server. Plain
    # and the serve default, with and without bursts of 4, four servers up at once, 64 streams (~220 s,
    # carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    timeout "${BURSTS_S:-300}" python3 benchmarks/served_side_by_side.py --engine plain:spec_mode=off \
      --engine plain-burst4:spec_mode=off,decode_burst=4 --engine default: --engine default-burst4:decode_burst=4 \
      --streams "${STREAMS:-64}" --max-tokens 128 --rounds 3 --out "$OUT/served-bursts" > "$OUT/served-bursts.log" 2>&1
    echo "served bursts: exit $?"; tail -6 "$OUT/served-bursts.log"
    ;;
  overlap)
    # Issue 20's tables (last measured in session 30): tokens/s with overlap scheduling and without,
    # plain, static and compact at 1, 8, 64 and 128 requests, and the GPU's busy share of steady decode
    # (~330 s, carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    timeout "${OVERLAP_S:-300}" python3 benchmarks/overlap.py --device cuda --batch-sizes 1,8,64,128 \
      --settings ahead,off --repeats 2 --out "$OUT/overlap.json" > "$OUT/overlap.log" 2>&1
    echo "overlap: exit $?"; tail -30 "$OUT/overlap.log"
    ;;
  overlap-isolated)
    # Issue 20's overlap table one mode a process (session 45: with six engines in one process plain at
    # batch 128 with launch-ahead ran 47.2k tok/s, alone 84.6k), with the GPU busy shares (~400 s,
    # carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    for mode in off static compact; do
      timeout "${OVERLAP_S:-120}" python3 benchmarks/overlap.py --device cuda --batch-sizes 1,8,64,128 \
        --modes "$mode" --settings ahead,off --repeats 3 --busy-steps "${BUSY_STEPS:-50}" \
        --out "$OUT/overlap-$mode.json" > "$OUT/overlap-$mode.log" 2>&1
      echo "overlap $mode: exit $?"; grep -A6 "^| batch" "$OUT/overlap-$mode.log"
    done
    ;;
  s48)
    # Session 48's working call (~450 s, carry [".carry/c4"]): issue 18's table with the shipped
    # defaults at every level, three rounds (the gate charging each step its own preparation), then the
    # gate's, the engine's and the launch-ahead tests on the GPU (STEP_S > 0: issue 20's 8B step too).
    OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-400} OVERHEAD_ARGS="--levels 1,8,64,128,256 \
      --modes off,default --requests-per-stream 8 --user-defaults --rounds 3" \
      bash benchmarks/gpu_check.sh > "$OUT/overhead-check.log" 2>&1
    echo "overhead: exit $?"; head -9 "$OUT/overhead.md"
    timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_engine.py \
      tests/test_speculation_gate.py tests/test_gate_timeline.py tests/test_launch_ahead.py \
      tests/test_decode_burst.py tests/test_draft_length.py > "$OUT/gate-tests.log" 2>&1
    echo "gate tests: exit $?"; grep -E "^FAILED|passed|failed" "$OUT/gate-tests.log" | tail -8
    if [[ "${STEP_S:-0}" != 0 ]]; then
      timeout "$STEP_S" python3 benchmarks/gpu_e2e.py --out "$OUT/e2e" --parts step \
        --step-batches 1,8,64 --repeats 9 > "$OUT/e2e.log" 2>&1
      echo "gpu_e2e step: exit $?"; grep -v "^step \|Loading" "$OUT/e2e.log" | tail -14
    fi
    ;;
  s49)
    # Session 49's call (~350 s, carry [".carry/c4", ".carry/base49"]; `mkdir -p .carry/base49 && git
    # archive 6685dd3 backend | tar -x -C .carry/base49`): issue 18's table at 64-256 with the gate's
    # view offline beside served (the fourth table of overhead.md: what the gate measured per length
    # at each tier), then bursts past the ends of a few requests (0d9e84e) against 6685dd3, offline,
    # requests of 64-128 tokens (`--max-tokens-spread 0.5`), plain and the serve default.
    OUT=$OUT TESTS_S=0 SERVING_S=0 OVERHEAD_S=${OVERHEAD_S:-300} OVERHEAD_ARGS="--levels ${LEVELS:-64,128,256} \
      --modes off,default --requests-per-stream 8 --user-defaults --rounds ${ROUNDS:-3}" \
      bash benchmarks/gpu_check.sh > "$OUT/overhead-check.log" 2>&1
    echo "overhead: exit $?"; head -6 "$OUT/overhead.md"; grep -A40 "^The adaptive gate's view" "$OUT/overhead.md"
    timeout "${AB_S:-150}" python3 benchmarks/ab_trees.py --base .carry/base49/backend --device cuda \
      --batch-sizes 256,128,64 --modes off,default --rounds "${AB_ROUNDS:-6}" --max-tokens 128 \
      --max-tokens-spread 0.5 --out "$OUT/ab-bursts.json" > "$OUT/ab-bursts.log" 2>&1
    echo "ab bursts: exit $?"; grep -vE "^\{" "$OUT/ab-bursts.log" | tail -10
    ;;
  warm)
    # Issue 19 (session 49): where its target is 99% sure, the shipped drafter misses 44% of its drafts
    # (21% of first ones; benchmarks/tau_limits.py on the CPU); the anchor feature was the largest gain
    # of any variant from scratch. Here each change is grown at zero onto the shipped drafter and trained on from there on
    # the same fresh data, equal steps (~570 s, carry [".carry/c4"] after parking c1-c3, c5): trained on
    # alone and with the anchor feature (VARIANTS="warm warm-anchor-two-layers": a second layer too);
    # each variant's table row, engine tau and tau_limits table (where the target is sure, does the
    # change hit more?). Its data stage reads training/prompts_train.jsonl and its variants drafters/:
    # both must be in the tree, so move benchmarks/results/* but this folder aside instead (the tree
    # then ~28 MiB, with c4 ~52 MiB of the 64 a call carries).
    # Session 50: `shipped` first (the drafter as it is, measured by the same stages on the same data).
    # The trained drafters stay in /tmp/wv/<variant>/drafter while the machine is warm (`keep` below).
    # Session 51 (H100): at DATA_MINUTES=1.5 the engine's start took ~50 s of the 90 and the stage wrote
    # the held-out answers only (3 s of generation): 3 minutes gave 14,719 training responses.
    WORK=/tmp/w1 OUT=$OUT/data DATA_MINUTES=${DATA_MINUTES:-3} TRAIN_MINUTES=0 RESPONSES=3 DATA_SEED=49 \
      SAMPLE_FRACTION=0.5 BUDGET_S=${DATA_BUDGET_S:-260} bash training/run_h200.sh > "$OUT/data.log" 2>&1
    echo "data: exit $?"; tail -3 "$OUT/data.log"
    WORK=/tmp/wv OUT=$OUT/variants DATA_IN=/tmp/w1/data VARIANTS="${VARIANTS:-shipped warm warm-anchor}" \
      TRAIN_STEPS=${TRAIN_STEPS:-500} LR=${LR:-3e-4} BUDGET_S=${VARIANTS_S:-320} bash training/variants.sh \
      > "$OUT/variants.log" 2>&1
    echo "variants: exit $?"; cat "$OUT/variants/variants.md"
    grep -B2 -A16 "^| target top-1" "$OUT/variants/run.log" | tail -60
    ;;
  gate128)
    # Session 52 (a slow H100 host): at 128 requests drafting lost (static 0.87-0.93x plain: its steps
    # 3.0-3.3 ms against plain's 1.5-1.6, no faster than their device-synchronised phases, while plain's
    # ran 1.45x faster than theirs), and the serve default drafted most steps anyway (0.83-0.84x plain).
    # The modes with the gate's view per batch (`e2e.py` prints each length's median step ms, steps
    # measured / chosen and expected tokens a request), then every step at 128 (~330 s, carry c4).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    timeout 200 python3 benchmarks/e2e.py --device cuda --batch-sizes 8,64,128 --max-tokens 128 \
      --sustained 4 --repeats 3 --no-peer --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
    echo "e2e: exit $?"; grep -A20 "^| batch" "$OUT/e2e.log" | head -40
    (cd benchmarks && timeout 120 python3 gate_timeline.py --device cuda --batch 128 --max-tokens 256 --syncs \
      --out "$OUT/timeline-b128.json" > "$OUT/timeline-b128.log" 2>&1)
    echo "timeline: exit $?"; cut -c1-400 "$OUT/timeline-b128.log" | tail -24
    ;;
  b8)
    # Session 54: at 8 requests a drafting step costs ~0.39 ms more than a plain one (1.142-1.163 ms
    # at lengths 1-3 against 0.758), at 1 and 64 ~0.16 ms: the extra does not grow with the length, so
    # not the verify rows. Kernels and host time a step, plain against static, at 1, 8 and 64 requests,
    # with and without bursts (~200 s, carry [".carry/c4"]).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    prof() {  # batch, burst, extra options
      (cd benchmarks && timeout 100 python3 profile_host.py --device cuda --batch "$1" --max-tokens 96 \
        --modes off,static --decode-burst "$2" "${@:3}" --out "$OUT/prof-b$1-burst$2${3:-}" \
        > "$OUT/prof-b$1-burst$2${3:-}.log" 2>&1)
      echo "profile b$1 burst $2 ${3:-}: exit $?"; grep -v "^{" "$OUT/prof-b$1-burst$2${3:-}.log" | tail -3
      grep -h "per step" "$OUT/prof-b$1-burst$2${3:-}"/*.txt 2>/dev/null
    }
    batches=${BATCHES:-8,1,64}
    for b in ${batches//,/ }; do prof "$b" 4 --kernels; done
    prof 8 1 --kernels
    prof 8 4
    ;;
  rows)
    # Session 54: the skinny-product kernel took 1-8 rows (ops.FEW_ROWS); a drafting step at 8 requests
    # verifies 16-32 rows, then all through cuBLAS, while plain's 8 take the kernel: is that the extra
    # ~0.4 ms a drafting step pays at 8 (see b8)? Session 55 set FEW_ROWS = 16 (9-16 rows run the 8-row
    # program); the kernel takes up to 64. No carry, no GGUF (one call, ~500 s; most telling first): the
    # target step (SmolLM2's sizes, random weights) at 1-64 requests x windows 1-4 with the kernel for
    # 1-8, 1-16 (HEAD) or 1-64 rows, or none; end to end with the shipped drafter on that target, this
    # tree against itself with FEW_ROWS=8 (did 16 pay?) and =64, plain and static, alternating in one
    # process; the kernel's parity tests; the kernel against F.linear at 8-64 rows; the device kernels of
    # plain and static at 8 requests.
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
    timeout 150 python3 benchmarks/gpu_e2e.py --parts step --shape smollm2 --work /tmp/rows-work --out "$OUT/step" \
      --step-batches ${STEP_BATCHES:-1,8,16,64} --step-windows ${STEP_WINDOWS:-1,2,4} \
      --kernel-paths ${STEP_PATHS:-gemv8,gemv,gemv64,cublas} --context 256 --repeats ${STEP_REPEATS:-15} \
      > "$OUT/step.log" 2>&1
    echo "step: exit $?"; grep -A40 "^| " "$OUT/step/results.md" 2>/dev/null | head -45
    (cd benchmarks && python3 -c "import gpu_e2e, tp_gpu, pathlib
path = tp_gpu.write_checkpoint(pathlib.Path('/tmp/rows-work/dspark-smollm2-random'), tp_gpu.SMOLLM2, 'bfloat16')
gpu_e2e.write_placeholder_tokenizer(path, tp_gpu.SMOLLM2['vocab_size'])")
    for few in ${NEW_FEW_ROWS:-8 64}; do
      rm -rf /tmp/rows && mkdir -p /tmp/rows && cp -r backend /tmp/rows/backend
      sed -i "s/^FEW_ROWS = [0-9]*$/FEW_ROWS = $few/" /tmp/rows/backend/dspark/kernels/ops.py
      grep -n "^FEW_ROWS" /tmp/rows/backend/dspark/kernels/ops.py
      timeout "${AB_S:-110}" python3 benchmarks/ab_trees.py --base backend --new /tmp/rows/backend --device cuda \
        --model /tmp/rows-work/dspark-smollm2-random --batch-sizes ${AB_BATCHES:-8,16,64,1} --modes off,static \
        --rounds "${ROUNDS:-4}" --max-tokens 128 --out "$OUT/ab-rows$few.json" > "$OUT/ab-rows$few.log" 2>&1
      echo "ab rows (new: FEW_ROWS=$few, base: HEAD's): exit $?"; grep -vE "^\{" "$OUT/ab-rows$few.log" | tail -14
    done
    [[ -n "${LITE:-}" ]] && exit 0  # LITE=1: the two above only (a call with little device time left)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py > "$OUT/gemv-tests.log" 2>&1
    echo "gemv tests: exit $?"; tail -2 "$OUT/gemv-tests.log"
    # The step (150 s), two A/Bs (2 x 110 s) and the tests (100 s) fill a call (~500 s with the start);
    # FULL=1 adds the kernel against F.linear and the device kernels at 8 requests (with AB_S=80).
    [[ -z "${FULL:-}" ]] && exit 0
    timeout 120 python3 benchmarks/gemv.py --rows ${GEMV_ROWS:-8,16,32,64} --replays 10 --out "$OUT/gemv" \
      > "$OUT/gemv.log" 2>&1
    echo "gemv: exit $?"; cat "$OUT/gemv/results.md" 2>/dev/null | head -40
    (cd benchmarks && timeout 90 python3 profile_host.py --device cuda --batch 8 --max-tokens 96 \
      --model /tmp/rows-work/dspark-smollm2-random --modes off,static --kernels --decode-burst 4 --top 40 \
      --out "$OUT/kernels-b8" > "$OUT/kernels-b8.log" 2>&1)
    echo "kernels b8: exit $?"; head -3 "$OUT"/kernels-b8/*.txt
    ;;
  data)
    # Session 53: the data stage alone (a new seed), the machine kept warm for `train` right after.
    WORK=/tmp/w1 OUT=$OUT/data DATA_MINUTES=${DATA_MINUTES:-4.5} TRAIN_MINUTES=0 RESPONSES=3 DATA_SEED=${DATA_SEED:-53} \
      SAMPLE_FRACTION=0.5 BUDGET_S=${DATA_BUDGET_S:-420} bash training/run_h200.sh > "$OUT/data.log" 2>&1
    echo "data: exit $?"; tail -3 "$OUT/data.log"; ls -l /tmp/w1/data
    ;;
  spread)
    # Session 53: the modes under steady load with answers of many lengths (128 -/+ 50%, the same for
    # every engine: `e2e.py --sustained-spread`), beside one batch; DRAFT: a drafter folder (e.g.
    # /tmp/wv/warm/drafter while the machine that trained it is warm; default: the shipped one).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    timeout ${SPREAD_S:-330} python3 benchmarks/e2e.py --device cuda --batch-sizes ${BATCHES:-1,8,64,128} --max-tokens 128 \
      --sustained 4 --sustained-spread 0.5 --repeats 2 --no-peer ${DRAFT:+--draft-model $DRAFT} \
      --out "$OUT/e2e-spread.json" > "$OUT/e2e-spread.log" 2>&1
    echo "e2e: exit $?"; grep -A30 "^| batch" "$OUT/e2e-spread.log" | grep -v "^{" | head -50
    ;;
  s57)
    # Session 56 left two questions (no carry for part 2; part 1 needs the GGUF: carry [".carry/c4"] after
    # parking .carry/g01 and .carry/g2, ~400 s in all):
    # 1. At 64 requests the serve default ran 0.91x plain on an H100: its gate timed its own plain steps at
    #    1.04 ms against the plain engine's 0.87. The device kernels of a plain step in each engine
    #    (`gated-plain`: the serve default's engine held at plain steps), side by side.
    # 2. Does a Qwen3-8B projection gain from the skinny-product kernel at 17-64 rows, as SmolLM2's did
    #    (ops.SMALL_WEIGHT_ROWS keeps 8B weights with cuBLAS past 16 rows, unmeasured)?
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    (cd benchmarks && timeout 150 python3 profile_host.py --device cuda --batch 64 --max-tokens 128 \
      --modes off,gated-plain --kernels --decode-burst 4 --top 40 --out "$OUT/kernels-b64" > "$OUT/kernels-b64.log" 2>&1)
    echo "kernels b64: exit $?"; head -4 "$OUT"/kernels-b64/*.txt
    timeout 200 python3 benchmarks/gpu_e2e.py --parts step --shape qwen3-8b --work /tmp/s57 --out "$OUT/step8b" \
      --step-batches 8,16 --step-windows 2,4 --kernel-paths gemv,gemv64,cublas --context 1024 --repeats 10 \
      > "$OUT/step8b.log" 2>&1
    echo "step 8b: exit $?"; grep -A16 "^| batch" "$OUT/step8b/results.md" 2>/dev/null | head -18
    ;;
  s57b)
    # Session 57 (carry [".carry/c4", ".carry/base57"] after parking g01, g2; base57: `git archive bb81a94
    # backend`; ~480 s): the gate's DRAFT_MARGIN and FEW_ROWS 32, each against bb81a94.
    # 1. The serve default against plain, batch run to its end (128 tokens) and with spread lengths.
    # 2. The Qwen3-8B step at 1-16 requests x windows 1-4, HEAD's kernel rows against 16 and cuBLAS.
    # 3. The skinny-product kernel's tests.
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    AB_S=${AB_S:-170} AB2_S=${AB2_S:-110} gate_ab .carry/base57/backend
    timeout ${STEP_S:-150} python3 benchmarks/gpu_e2e.py --parts step --shape qwen3-8b --work /tmp/s57 --out "$OUT/step8b" \
      --step-batches 1,8,16,32 --step-windows 1,2,4 --kernel-paths gemv,gemv16,cublas --context 1024 --repeats 10 \
      > "$OUT/step8b.log" 2>&1
    echo "step 8b: exit $?"; grep -A40 "^| batch" "$OUT/step8b/results.md" 2>/dev/null | head -42
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py > "$OUT/gemv-tests.log" 2>&1
    echo "gemv tests: exit $?"; tail -2 "$OUT/gemv-tests.log"
    ;;
  s58)
    # Session 58 (no carry, nothing parked; ~260 s with the start): FEW_ROWS 32 (9a3ede2) on a GPU: the
    # Qwen3-8B step (random bf16 weights) at 1-16 requests x windows 1-4, HEAD's kernel rows (1-32)
    # against 1-16 and cuBLAS; then the skinny-product kernel's parity tests at HEAD.
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
    timeout ${STEP_S:-130} python3 benchmarks/gpu_e2e.py --parts step --shape qwen3-8b --work /tmp/s58 --out "$OUT/step8b" \
      --step-batches ${STEP_BATCHES:-1,8,16} --step-windows ${STEP_WINDOWS:-1,2,4} --kernel-paths gemv,gemv16,cublas \
      --context 1024 --repeats ${STEP_REPEATS:-8} > "$OUT/step8b.log" 2>&1
    echo "step 8b: exit $?"; grep -A40 "^| batch" "$OUT/step8b/results.md" 2>/dev/null | head -42
    timeout ${TESTS_S:-80} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py > "$OUT/gemv-tests.log" 2>&1
    echo "gemv tests: exit $?"; tail -2 "$OUT/gemv-tests.log"
    ;;
  s59)
    # Session 59 (carry [".carry/c4", ".carry/base59"] after parking g01, g2; base59: `git archive
    # f2d4349 backend`; ~200 s): the gate's margin by request count (10% at one request, 20% from 8)
    # against the flat 10%, a batch run to its end (128 tokens) and with spread lengths.
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    AB_S=${AB_S:-200} AB2_S=${AB2_S:-120} gate_ab .carry/base59/backend
    ;;
  s60)
    # Session 60 (carry [".carry/c4", ".carry/base60"] after parking g01, g2; base60: `git archive 53971f4
    # backend`; ~250 s): a batch run to its end judged by the requests it drafts worst for (the gate's
    # `draining`) against 53971f4, batch run to its end and with spread lengths; then the timeline at 64.
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    AB_S=${AB_S:-200} AB2_S=${AB2_S:-120} gate_ab .carry/base60/backend
    (cd benchmarks && timeout ${TL_S:-100} python3 gate_timeline.py --device cuda --batch 64 --max-tokens 128 \
      --before 64 --before-runs 3 --out "$OUT/timeline64" > "$OUT/timeline64.log" 2>&1)
    echo "timeline 64: exit $?"; grep -E "tok/s" "$OUT/timeline64.log"
    ;;
  s61c)
    # Session 61's check of a2c8832 (carry [".carry/c4", ".carry/base60"] after parking c1, c2, c3+c5;
    # ~520 s): the gate's draining batches rated by when their end comes (the spread of finished
    # requests) against 53971f4 (`s60`'s A/B), the timeline at 64 with a fixed length beside (static),
    # then the GPU tests; everything but check.log comes back in one archive (8 files at most).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    AB_S=${AB_S:-170} AB2_S=${AB2_S:-90} gate_ab .carry/base60/backend
    (cd benchmarks && timeout ${TL_S:-100} python3 gate_timeline.py --device cuda --batch 64 --max-tokens 128 \
      --before 64 --before-runs 2 --modes default,off,static --out "$OUT/timeline64.json" > "$OUT/timeline64.log" 2>&1)
    echo "timeline 64: exit $?"; grep -E "tok/s" "$OUT/timeline64.log"
    TESTS_S=${TESTS_S:-300} SERVING_S=${SERVING_S:-100} bash "$0" tests
    (cd "$OUT" && tar -czf /tmp/s61c.tgz --exclude=check.log . && find . -type f ! -name check.log -delete \
      && mv /tmp/s61c.tgz .)
    ;;
  s62)
    # Session 62 (carry [".carry/c4", ".carry/base62"] after parking c1, c2, c3+c5; base62: `git archive
    # c638a56 backend`; ~200 s with the start): plain steps that keep their features for the drafter
    # (no injection in their graphs) against c638a56 (the same gate, every step injecting), at 64 and 128.
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    timeout ${AB_S:-150} python3 benchmarks/ab_trees.py --base .carry/base62/backend --device cuda \
      --batch-sizes ${AB_BATCHES:-64,128} --modes off,default --rounds 3 --max-tokens 128 \
      --out "$OUT/ab-keep.json" > "$OUT/ab-keep.log" 2>&1
    echo "ab keep: exit $?"; grep -vE "^\{" "$OUT/ab-keep.log" | tail -8
    ;;
  s63)
    # Session 62's question (carry [".carry/c4"] after parking c1, c2, c3+c5; ~380 s; TL_BATCHES="64 128"
    # with TL_S=150 for both sizes, fewer modes in TL_MODES): at 64 and 128
    # requests a fixed length of 3 tied plain while the gated default's mix of lengths lost ~20%
    # (session 62). What a length costs in the serve default's engine (fixed3, fixed2, fixed0 = plain
    # there) against the plain and static engines, and what switching costs (switch4 / switch1: 4 or 1
    # plain launches, then as many at the block, in turn).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    for b in ${TL_BATCHES:-64}; do
      (cd benchmarks && timeout ${TL_S:-220} python3 gate_timeline.py --device cuda --batch $b --max-tokens 128 \
        --before $b --before-runs 2 --modes ${TL_MODES:-off,static,default,fixed3,fixed2,fixed0,switch4,switch1} \
        --out "$OUT/timeline$b.json" > "$OUT/timeline$b.log" 2>&1)
      echo "timeline $b: exit $?"; grep -E "tok/s" "$OUT/timeline$b.log"
    done
    # Where a drafting step's host time goes at 64 (session 62's kernel profile: `static` 1.5 ms of device
    # work a step under the profiler, no more than plain's 1.6, yet 1.76 ms of wall a step against 1.02).
    (cd benchmarks && timeout ${PH_S:-120} python3 profile_host.py --device cuda --batch 64 --max-tokens 128 \
      --modes off,static,default --decode-burst 8 --top 45 --out "$OUT/host64" > "$OUT/host64.log" 2>&1)
    echo "host 64: exit $?"; cat "$OUT/host64.log" | tail -4; head -1 "$OUT"/host64/*.txt
    ;;
  s61d)
    # s61c cut to the device time left (carry [".carry/c4", ".carry/base60"] after parking c1, c2, c3+c5;
    # ~320 s): the A/B against 53971f4 at 64, 128 and 8 requests, then the gate's, engine's, burst and
    # acceptance tests on the GPU (the full suite ran at 146f140's parent in call 1).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    timeout "${AB_S:-170}" python3 benchmarks/ab_trees.py --base .carry/base60/backend --device cuda \
      --batch-sizes "${AB_BATCHES:-64,128,8}" --modes off,default --rounds "${ROUNDS:-3}" --max-tokens 128 \
      --out "$OUT/ab-margin.json" > "$OUT/ab-margin.log" 2>&1
    echo "ab margin: exit $?"; grep -vE "^\{" "$OUT/ab-margin.log" | tail -8
    OUT=$OUT TESTS_S=${TESTS_S:-120} SERVING_S=0 TEST_FILES="tests/test_speculation_gate.py tests/test_engine.py \
      tests/test_kernels_accept.py tests/test_decode_burst.py tests/test_draft_length.py" \
      bash benchmarks/gpu_check.sh > "$OUT/check.log" 2>&1
    echo "gpu_check: exit $?"; grep -E "passed|failed|error" "$OUT/check.log" | tail -4
    ;;
  s61b)
    # Session 61's second call (carry [".carry/c4"] after parking c1, c2, c3+c5; ~420 s): why the serve
    # default trails plain at 64 requests in a batch run to its end (s61: 0.85x, its gate rating length 3
    # 23% ahead): the step timeline after two runs of 64 (as ab_trees' round 2), what the speculative
    # engine's plain steps cost against the plain engine's (`gated-plain`, host phases and device
    # kernels), then the Qwen3-8B step on this GPU (issue 20's floor, H200 not measured since session 28).
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    mkdir -p /tmp/s61b
    (cd benchmarks && timeout ${TL_S:-100} python3 gate_timeline.py --device cuda --batch 64 --max-tokens 128 \
      --before 64 --before-runs 2 --modes default,off,static --out /tmp/s61b/timeline64 > /tmp/s61b/timeline64.log 2>&1)
    echo "timeline 64: exit $?"; grep -E "tok/s" /tmp/s61b/timeline64.log
    (cd benchmarks && timeout ${PROF_S:-90} python3 profile_host.py --device cuda --batch 64 --max-tokens 128 \
      --decode-burst 4 --modes off,gated-plain,static --out /tmp/s61b/profile64 > /tmp/s61b/profile64.log 2>&1)
    echo "profile 64: exit $?"; grep -E "tok/s" /tmp/s61b/profile64.log
    (cd benchmarks && timeout ${PROF_S:-90} python3 profile_host.py --device cuda --batch 64 --max-tokens 128 \
      --decode-burst 4 --modes off,gated-plain,static --kernels --out /tmp/s61b/kernels64 > /tmp/s61b/kernels64.log 2>&1)
    echo "kernels 64: exit $?"; grep -E "tok/s" /tmp/s61b/kernels64.log
    timeout ${STEP_S:-130} python3 benchmarks/gpu_e2e.py --parts step --shape qwen3-8b --work /tmp/s61b/w --out /tmp/s61b/step8b \
      --step-batches ${STEP_BATCHES:-1,8,16} --step-windows ${STEP_WINDOWS:-1,2,4} --kernel-paths gemv,cublas \
      --context 1024 --repeats ${STEP_REPEATS:-8} > /tmp/s61b/step8b.log 2>&1
    echo "step 8b: exit $?"; grep -A14 "^| batch" /tmp/s61b/step8b/results.md 2>/dev/null | head -14
    rm -rf /tmp/s61b/w; tar -czf "$OUT/s61b.tgz" -C /tmp s61b
    ;;
  s61)
    # Session 61's first device call (carry [".carry/c4", ".carry/base60"] after parking c1, c2, c3+c5 as for
    # `tests`; base60: `git archive 53971f4 backend`; ~500 s on session 60's hosts): session 60's gate
    # (draining batches by their slowest requests, 32 steps of prior, no choice during a draining batch's
    # intake, runs ended by a tier jump) and one copy a burst, against 53971f4 with its timeline at 64
    # (`s60`), then the GPU tests (the intake rule, the tier jump and one copy a burst never ran on a GPU).
    AB_S=${AB_S:-170} AB2_S=${AB2_S:-90} TL_S=${TL_S:-60} bash "$0" s60
    TESTS_S=${TESTS_S:-300} SERVING_S=${SERVING_S:-100} bash "$0" tests
    ;;
  timeline64)
    # Session 59 (carry [".carry/c4"] after parking g01, g2; ~100 s): where the serve default's gate
    # goes wrong at 64 requests (it rated drafting 17-20% ahead of plain; runs of it were 16% behind):
    # each step of a 128-token batch of 64 after three warm runs, its length, requests, tokens and time.
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    (cd benchmarks && timeout ${TL_S:-150} python3 gate_timeline.py --device cuda --batch 64 --max-tokens 128 \
      --before 64 --before-runs 3 --out "$OUT/timeline64" > "$OUT/timeline64.log" 2>&1)
    echo "timeline 64: exit $?"; tail -30 "$OUT/timeline64.log"
    ;;
  data-train)
    # Both in one call (a machine may not stay warm between two): ~530 s with the defaults below.
    DATA_MINUTES=${DATA_MINUTES:-3.2} DATA_BUDGET_S=${DATA_BUDGET_S:-230} bash "$0" data
    TRAIN_STEPS=${TRAIN_STEPS:-1800} VARIANTS_S=${VARIANTS_S:-330} bash "$0" train
    ;;
  train)
    # Session 53: `shipped` and `warm` on `data`'s fresh shards and the earlier ones carried in
    # (carry [".carry/c4", ".carry/distill"]), then the warm drafter back as `keep` does.
    # The earlier shards, where the carry still has them (a new checkout's .carry/ has none: the fresh
    # data alone then).
    extra=${EXTRA_DATA_IN-.carry/distill}
    if [[ -n $extra ]] && ! compgen -G "$extra/*.npz" > /dev/null; then
      echo "no shard in $extra: training on the fresh data alone"; extra=""
    fi
    WORK=/tmp/wv OUT=$OUT/variants DATA_IN="/tmp/w1/data $extra" VARIANTS="${VARIANTS:-shipped warm}" \
      TRAIN_STEPS=${TRAIN_STEPS:-2000} LR=${LR:-3e-4} BUDGET_S=${VARIANTS_S:-480} bash training/variants.sh \
      > "$OUT/variants.log" 2>&1
    echo "variants: exit $?"; cat "$OUT/variants/variants.md"
    grep -E "^eval: all|tau through" "$OUT/variants.log" | tail -8
    src=/tmp/wv/warm/drafter
    mkdir -p "$OUT/drafter" && cp "$src"/config.json "$src"/train_log.jsonl "$OUT/drafter/" \
      && split -b 15M -d -a 2 "$src/model.safetensors" "$OUT/drafter/model.safetensors.part-" && sha256sum "$src/model.safetensors"
    ;;
  prefill)
    # Session 53: under steady load (slots refilled) the gate's view at 8 requests expects drafting to
    # win by 1.24x, and static runs 1.01x plain: do the steps that take prompts in (unmeasured by the gate,
    # eager) cost more when drafting? Each engine's steps, decode-only and prefill-carrying, per length.
    OUT=$OUT TESTS_S=0 SERVING_S=0 bash benchmarks/gpu_check.sh > "$OUT/setup.log" 2>&1
    for b in ${BATCHES:-8 128}; do
      (cd benchmarks && timeout 150 python3 gate_timeline.py --device cuda --batch $b --max-tokens 128 --sustained 4 \
        --modes default,static,off --out "$OUT/sustained-b$b.json" > "$OUT/sustained-b$b.log" 2>&1)
      echo "b$b: exit $?"; grep -E "tok/s|\"length\"" "$OUT/sustained-b$b.log" | python3 -c "
import sys, json
for line in sys.stdin:
    line = line.strip()
    if not line.startswith('{'): print(line); continue
    r = json.loads(line)
    print('  L%d steps %d gate %s dec_gap %s dec_sum %s | prefill %d gap %s sum %s repl %s' % (r['length'], r['steps'], r['gate_ms'], r['decode_finish_gap_ms'], r['decode_gap_sum_ms'], r['prefill_steps'], r['prefill_finish_gap_ms'], r['prefill_gap_sum_ms'], r['prefill_replayed_share']))
"
    done
    ;;
  keep)
    # A trained variant back from the warm machine (V=warm-anchor): its drafter in parts under 16 MiB
    # (train-draft writes no draft vocabulary: shipping it, copy the shipped draft_vocab.safetensors in).
    src=/tmp/wv/${V:-warm-anchor}/drafter
    mkdir -p "$OUT/drafter" && cp "$src"/config.json "$src"/train_log.jsonl "$OUT/drafter/"
    split -b 15M -d -a 2 "$src/model.safetensors" "$OUT/drafter/model.safetensors.part-"
    ls -l "$OUT/drafter"; sha256sum "$src/model.safetensors"
    ;;
  anchor)
    # Issue 19's capacity table: the anchor feature (session 41, training/README.md "An anchor feature")
    # against the base, from scratch on the same fresh data, equal steps, as session 25 compared five
    # target features (~560 s, carry [".carry/c4"] after parking c1-c3, c5; the GGUF's parts are found
    # by training/lib.sh).
    WORK=/tmp/w1 OUT=$OUT/data DATA_MINUTES=2.5 TRAIN_MINUTES=0 RESPONSES=3 DATA_SEED=41 \
      SAMPLE_FRACTION=0.5 BUDGET_S=230 bash training/run_h200.sh > "$OUT/data.log" 2>&1
    echo "data: exit $?"; tail -3 "$OUT/data.log"
    # Session 43 (H200): at TRAIN_STEPS=900 the even time share (1.36 min) stopped base at 499 steps (its
    # run paid the kernels' compilation) and anchor-feature at 703; 360 steps fit both.
    WORK=/tmp/wv OUT=$OUT/variants DATA_IN=/tmp/w1/data VARIANTS="base anchor-feature" TRAIN_STEPS=360 \
      BUDGET_S=320 bash training/variants.sh > "$OUT/variants.log" 2>&1
    echo "variants: exit $?"; cat "$OUT/variants/variants.md"
    ;;
  *)
    echo "usage: next_gpu.sh tests|tests-lite|gate128|bench|mbt1024|smt|diagnose|plain-cost|clients|window|timeline|gate-order|served-bursts|bursts-ahead|bench-burst|overlap|anchor|warm|keep|s48|s49" >&2
    exit 2
    ;;
esac
