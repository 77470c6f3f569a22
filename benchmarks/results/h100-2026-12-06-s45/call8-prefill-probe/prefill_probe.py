"""Probe (session 45): what a step that takes prompts in costs beside decode-only steps, on the GPU (SmolLM2
plain, 224 decoding requests, no bursts). Run from the repository root: `python3 <this file>`."""

import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "backend")
from dspark import LLMEngine, SamplingParams  # noqa: E402
from dspark.config import EngineConfig  # noqa: E402

engine = LLMEngine(EngineConfig(spec_mode="off", max_num_seqs=256, decode_burst=1))
rng = random.Random(0)


def prompt(length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


for i in range(224):
    engine.add_request(f"d{i}", prompt(40), SamplingParams(max_tokens=100000, ignore_eos=True))
for _ in range(60):
    engine.step()
torch.cuda.synchronize()


def timed(steps: int, new: int = 0, length: int = 40) -> float:
    """ms a step over `steps` steps, `new` prompts of `length` tokens added before the first."""
    for j in range(new):
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        engine.add_request(f"n{time.time_ns()}{j}", prompt(length), params)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000 / steps


print("decode-only step ms", [round(timed(20), 3) for _ in range(3)])
for new, length in [(1, 40), (4, 40), (8, 40), (8, 100), (16, 40)]:
    runs = [round(timed(1, new, length), 3) for _ in range(4)]
    print(f"step with {new} prompts of {length}: ms", runs, "then", round(timed(5), 3))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        timed(1, 8, 40)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
