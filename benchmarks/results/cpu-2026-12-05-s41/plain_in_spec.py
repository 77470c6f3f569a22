"""Host ms per step: the plain engine against the serve-default engine whose gate always says plain.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s41/plain_in_spec.py 64 16

(from the repository root; SmolLM2, its drafter, this CPU: `plain_in_spec.log`)
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, "benchmarks")
from e2e import _prompt_ids, bench_config  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402

batch, tokens = int(sys.argv[1]), int(sys.argv[2])
for name, mode, gated in [("off", "off", False), ("default-forced-plain", "static", True)] * 2:
    llm = LLM(bench_config("", "", "cpu", batch, spec_mode=mode, adaptive_speculation=gated))
    if gated:
        llm.engine.gate.draft_length = lambda num_requests: 0
    ids = _prompt_ids(llm, batch)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate(params=params, prompt_token_ids=ids)
    timer = llm.engine.timer
    timer.reset()
    timer.enabled, timer.synchronize = True, False
    start = time.perf_counter()
    llm.generate(params=params, prompt_token_ids=ids)
    elapsed = time.perf_counter() - start
    timer.enabled = False
    phases = {k: round(v, 3) for k, v in timer.summary().items()}
    print(name, f"{batch * tokens / elapsed:.0f} tok/s", phases, flush=True)
    llm.close()
