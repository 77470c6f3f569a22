"""Session 46: `dspark-client bench`'s questions as the server receives them (raw text, to EOS, at most
96 tokens), one request at a time in one engine, twice over: tok/s, steps, ms a step and decode tokens
a step. `python gate_sequence.py default|static|off`."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e import bench_config

import dspark.engine.llm_engine as llm_engine
from dspark import LLM, SamplingParams
from dspark_client.prompts import PROMPTS

mode = sys.argv[1]
counted = {"steps": 0, "seconds": 0.0}
step = llm_engine.LLMEngine.step


def counted_step(self, *args, **kwargs):
    start = time.perf_counter()
    result = step(self, *args, **kwargs)
    counted["seconds"] += time.perf_counter() - start
    counted["steps"] += 1
    return result


llm_engine.LLMEngine.step = counted_step
llm = LLM(bench_config("", "", "cpu", 1, **({} if mode == "default" else {"spec_mode": mode})))
params = SamplingParams(max_tokens=96)
llm.generate(params=params, prompt_token_ids=[llm.tokenizer.encode(PROMPTS[0])])
counted.update(steps=0, seconds=0.0)
tokens, requests, start = 0, 0, time.perf_counter()
for _ in range(2):
    for question in PROMPTS:
        tokens += len(
            llm.generate(params=params, prompt_token_ids=[llm.tokenizer.encode(question)])[0].token_ids
        )
        requests += 1
elapsed = time.perf_counter() - start
steps = counted["steps"]
print(
    mode,
    "tok/s",
    round(tokens / elapsed, 1),
    "tokens",
    tokens,
    "steps",
    steps,
    "ms/step",
    round(counted["seconds"] / steps * 1e3, 1),
    "decode tokens/step",
    round((tokens - requests) / (steps - requests), 3),
)
