#!/usr/bin/env bash
# Session 41 (H100, no SMT): the served engine process on a core of its own against unpinned, then
# the offline loop beside spinners on other cores (clock), then the gate A/B with gate_timed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/s41}; mkdir -p "$OUT"
wait_port_free() { for _ in $(seq 30); do ss -ltn | grep -q ":$1 " || return 0; sleep 1; done; }
end_servers() { pkill -9 -f "[t]riton_launcher"; pkill -9 -f "[t]ritonserver"; pkill -9 -f "[t]riton_python_backend_stub"; sleep 1; wait_port_free 18600; wait_port_free 18601; wait_port_free 18602; }
end_servers
for pin in "2" ""; do
  name=overhead-${pin:+pinned-}${pin:-unpinned}
  timeout "${PIN_S:-130}" python3 benchmarks/serving_overhead.py --out "$OUT/$name" --levels 64,256 \
    --modes off --requests-per-stream 8 --user-defaults --rounds 2 ${pin:+--engine-cpus $pin} \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"; end_servers
  cp "$OUT/$name/overhead.md" "$OUT/$name.md" 2>/dev/null && head -8 "$OUT/$name.md"
  rm -rf "${OUT:?}/$name"
done
(cd benchmarks && timeout "${SMT_S:-80}" python3 host_neighbours.py --device cuda --batch-sizes 64 \
  --neighbours none,spin:7@apart,spin:14@apart --rounds 3 --max-tokens 96 --out "$OUT/apart.json" \
  > "$OUT/apart.log" 2>&1)
echo "neighbours: exit $?"; grep -E "^engine|^batch" "$OUT/apart.log"
timeout "${AB_S:-110}" python3 benchmarks/ab_trees.py --base .carry/base35/backend --device cuda \
  --batch-sizes 128,64 --modes off,default --rounds "${ROUNDS:-6}" --max-tokens 96 \
  --out "$OUT/ab-gate.json" > "$OUT/ab-gate.log" 2>&1
echo "ab gate: exit $?"; grep -E "^\{" "$OUT/ab-gate.log" | head -20
