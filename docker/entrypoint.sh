#!/usr/bin/env bash
# Container entry point: make sure the default model and drafter exist (idempotent), then serve in
# the foreground. `docker stop` sends SIGTERM to dspark serve, which drains and stops tritonserver.
set -euo pipefail
dspark import-gguf
dspark create-draft --if-missing
exec dspark serve "$@"
