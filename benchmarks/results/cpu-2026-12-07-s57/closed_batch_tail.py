"""One closed batch (every request starts together, none refilled): how many steps each request takes.

Usage (from the repository root): .venv/bin/python benchmarks/results/cpu-2026-12-07-s57/closed_batch_tail.py
[BATCH [MAX_TOKENS [SPEC_MODE]]] (defaults 64 128 static). Plain decoding takes MAX_TOKENS steps a request;
speculation takes fewer, each request as many as its own acceptance gives, and the batch runs until its
slowest request ends, so the batch's speed-up is MAX_TOKENS / max(steps), not MAX_TOKENS / mean(steps).
Session 57 wrote it to explain why the serve default lost to plain decoding at 64 requests on an H100
while its gate rated drafting ~3% ahead (the gate sees the batch's mean tokens a step).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for e2e's prompts

from e2e import PROMPTS, bench_config  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.training.data import encode_prompt  # noqa: E402


def main() -> None:
    """Print the steps a request took (min, mean, max) and per-request tau, for one closed batch."""
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    mode = sys.argv[3] if len(sys.argv) > 3 else "static"
    llm = LLM(bench_config("", "", "cpu", batch, spec_mode=mode))
    ids = [encode_prompt(llm.tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
    outs = llm.generate(params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), prompt_token_ids=ids)
    steps = [o.spec_stats.steps for o in outs]
    taus = [len(o.token_ids) / max(o.spec_stats.steps, 1) for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"batch {batch}, {max_tokens} tokens, spec_mode {mode}, device cpu")
    print(f"steps a request: min {min(steps)}, mean {statistics.mean(steps):.1f}, max {max(steps)}")
    print(f"per-request tau: min {min(taus):.2f}, max {max(taus):.2f}; pooled {tokens / sum(steps):.2f}")
    kept = statistics.mean(steps) / max(steps)
    print(f"mean/max steps (what the tail leaves of the pooled gain): {kept:.2f}")


if __name__ == "__main__":
    main()
