"""Session 47: plain decoding, `static` and the serve default at several block sizes on this CPU, one
engine each in one process, rounds alternated (SmolLM2 fp32, batch 1, greedy, e2e.PROMPTS one at a time).
The drafter directory (last argument) is a copy of the shipped one with block_size 7 and temperatures
1.0 for positions 4-7 (the shipped config allows blocks of 3 at most).

    python block_sizes.py off,static:3,static:5,default:3,default:5 96 12 3 /tmp/d7
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, bench_config

from dspark import LLM, SamplingParams


def engine(spec: str, drafter: str) -> LLM:
    """`off`, `static:B` (every step drafts) or `default:B` (behind the gate), blocks of B."""
    mode, _, block = spec.partition(":")
    config = bench_config("", drafter, "cpu", 1, spec_mode="off" if mode == "off" else "static")
    config = config.replace(adaptive_speculation=mode == "default")
    return LLM(config.replace(block_size=int(block)) if block else config)


def main() -> None:
    specs = sys.argv[1].split(",")
    max_tokens, count, rounds, drafter = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    engines = {spec: engine(spec, drafter) for spec in specs}
    ids = _prompt_ids(engines[specs[0]], count)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(params=params, prompt_token_ids=ids[:1])
    rates: dict[str, list[float]] = {spec: [] for spec in specs}
    tokens: dict[str, list] = {}
    steps = dict.fromkeys(specs, 0)
    for round_ in range(rounds):
        for spec in specs if round_ % 2 == 0 else specs[::-1]:
            seconds, outputs = 0.0, []
            for prompt in ids:
                started = time.perf_counter()
                output = engines[spec].generate(params=params, prompt_token_ids=[prompt])[0]
                seconds += time.perf_counter() - started
                outputs.append(output.token_ids)
                steps[spec] += output.spec_stats.steps if round_ == 0 else 0
            rates[spec].append(count * max_tokens / seconds)
            tokens[spec] = outputs
    for spec in specs:
        per_step = count * max_tokens / max(steps[spec], 1)
        print(
            f"{spec:12s} tokens/step {per_step:.3f} tok/s {statistics.median(rates[spec]):.2f}",
            [round(rate, 1) for rate in rates[spec]],
            "same tokens",
            tokens[spec] == tokens[specs[0]],
        )


if __name__ == "__main__":
    main()
