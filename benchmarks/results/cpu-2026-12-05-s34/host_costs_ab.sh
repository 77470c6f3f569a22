#!/usr/bin/env bash
# host_costs at batch 256 (tiny, CPU) for the tree in $1
cd "$1/benchmarks" && PYTHONPATH="$1/backend" OMP_NUM_THREADS=2 "${PYTHON:-python3}" host_costs.py --tiny --device cpu --batch 256 --max-tokens 32 --modes off,static 2>&1 | grep -E "==|_commit_tokens|PendingDelta.make|LLMEngine._commit |LLMEngine._complete|llm_engine.accept|LLMEngine.step |Scheduler.schedule|pack_step"
