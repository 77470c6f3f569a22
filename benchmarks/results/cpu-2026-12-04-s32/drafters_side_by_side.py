"""Drafter run 5 against run 6 end to end on this CPU, batch 1, in one process: plain, and `static` and
the serve default with each drafter, timed runs interleaved round by round (the host's drift falls on
all). `dspark-client bench`'s 8 questions, 64 greedy tokens each, one at a time.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-04-s32/drafters_side_by_side.py \
        /tmp/run5 drafters/SmolLM2-135M-Instruct-dspark [ROUNDS]

(/tmp/run5: `git show 138d886:drafters/SmolLM2-135M-Instruct-dspark/<file>` for its four files.)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client"))
from prompts import PROMPTS  # noqa: E402

from dspark import LLM, EngineConfig, SamplingParams  # noqa: E402
from dspark.training.data import encode_prompt  # noqa: E402


def main() -> None:
    """Print tokens/s per engine (median of rounds) and tokens a step."""
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    base = dict(
        model=str(ROOT / "models/SmolLM2-135M-Instruct"), device="cpu", max_num_seqs=4, num_kv_pages=256
    )
    engines = {
        "plain": LLM(EngineConfig(spec_mode="off", **base)),
        "static run 5": LLM(
            EngineConfig(spec_mode="static", draft_model=old, adaptive_speculation=False, **base)
        ),
        "static run 6": LLM(
            EngineConfig(spec_mode="static", draft_model=new, adaptive_speculation=False, **base)
        ),
        "default run 5": LLM(EngineConfig(draft_model=old, **base)),
        "default run 6": LLM(EngineConfig(draft_model=new, **base)),
    }
    ids = [encode_prompt(engines["plain"].tokenizer, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for llm in engines.values():
        llm.generate(params=SamplingParams(max_tokens=16, ignore_eos=True), prompt_token_ids=ids[:2])
    rates: dict[str, list[float]] = {name: [] for name in engines}
    steps: dict[str, float] = {}
    names = list(engines)
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            tokens, took, committed_steps = 0, 0.0, 0
            for prompt in ids:
                start = time.perf_counter()
                out = engines[name].generate(params=params, prompt_token_ids=[prompt])[0]
                took += time.perf_counter() - start
                tokens += len(out.token_ids)
                committed_steps += out.spec_stats.steps
            rates[name].append(tokens / took)
            steps[name] = tokens / max(committed_steps, 1)
        print(f"round {k}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names), flush=True)
    plain = statistics.median(rates["plain"])
    print("| engine | tok/s (median) | / plain | tokens a step |")
    print("|---|---:|---:|---:|")
    for name in names:
        rate = statistics.median(rates[name])
        print(f"| {name} | {rate:.1f} | {rate / plain:.2f} | {steps[name]:.2f} |")


if __name__ == "__main__":
    main()
