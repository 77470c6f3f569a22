#!/bin/bash
# Two trees' host time a step, alternating processes: host_ab.sh BATCH MODE ROUNDS
# BASE: the older tree's backend/ (e.g. `git worktree add /tmp/base 3257144`: /tmp/base/backend).
B=$1; MODE=$2; R=${3:-4}
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../../.." && pwd)
for i in $(seq "$R"); do
  for t in base new; do
    src=${BASE:-/tmp/base/backend}; [[ $t == new ]] && src=$root/backend
    echo -n "$t "; PYTHONPATH=$src "$root/.venv/bin/python" "$here/host_ab_step.py" "$B" "$MODE" 2>&1 | tail -1
  done
done
