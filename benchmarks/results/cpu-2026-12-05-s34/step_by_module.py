"""Where a CPU decode step goes, by module: wall-clock timers around the decoder layer, attention, MLP,
the linears, norms, rotary + store and paged attention, by row count (1: a plain step; 4: a `static`
window of a block of 3), medians and totals a step over one generate() of 64 greedy tokens.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s34/step_by_module.py off,static
"""

import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, bench_config  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.kernels import ops  # noqa: E402
from dspark.runner.models import layers, llama  # noqa: E402

TIMES: dict[tuple[str, int], list[float]] = collections.defaultdict(list)


def timed(owner: object, name: str, label: str) -> None:
    """Wrap owner.name to record its wall time under (label, rows of its first tensor argument)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        tensors = [a for a in args if hasattr(a, "shape")]
        TIMES[(label, tensors[0].shape[0] if tensors else -1)].append(time.perf_counter() - start)
        return out

    setattr(owner, name, wrapper)


for owner, name, label in (
    (llama.DecoderLayer, "forward", "layer"),
    (llama.Attention, "forward", "attention"),
    (llama.MLP, "forward", "mlp"),
    (layers.ColumnParallelLinear, "forward", "qkv / gate_up"),
    (layers.RowParallelLinear, "forward", "o / down"),
    (layers.RMSNorm, "forward", "norm"),
    (ops, "rotary_store_kv", "rotary + store"),
    (ops, "paged_attention", "paged attention"),
):
    timed(owner, name, label)

for mode in sys.argv[1].split(","):
    llm = LLM(bench_config("", "", "cpu", 1, spec_mode=mode, adaptive_speculation=False))
    ids = _prompt_ids(llm, 1)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    llm.generate(params=params, prompt_token_ids=ids)
    TIMES.clear()
    steps = llm.generate(params=params, prompt_token_ids=ids)[0].spec_stats.steps
    print(mode, steps, "steps")
    for (label, rows), times in sorted(TIMES.items()):
        if rows in (1, 4):
            median_us = statistics.median(times) * 1e6
            print(
                f"  {label:16s} rows {rows}  calls {len(times):5d}  median {median_us:7.1f} us"
                f"  {sum(times) * 1e3 / steps:6.2f} ms a step"
            )
    llm.close()
