"""Session 46's CPU step measurements, SmolLM2 fp32, 96 greedy tokens.

python cpu_step.py parts off|static [batch]
    wall-clock ms a target forward in each piece of the model (linears, attention, rotary, norms,
    LM head), timed by wrappers around them
python cpu_step.py ab off|static [batch] host_windows|host_rotation
    tok/s with the CPU layout's field on and off (`AttentionBatch.build` dropping it), alternated
    round by round in one engine, 8 rounds each, and whether the tokens are the same
"""

import collections
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, bench_config

import dspark.kernels.ops as ops
import dspark.runner.attention_batch as attention_batch
import dspark.runner.models.layers as layers
import dspark.runner.models.llama as llama
from dspark import LLM, SamplingParams

MAX_TOKENS = 96


def engine(mode: str, batch: int) -> tuple[LLM, list[list[int]], SamplingParams]:
    """A warmed engine of this mode, `batch` prompts and the sampling parameters."""
    llm = LLM(bench_config("", "", "cpu", batch, spec_mode=mode))
    ids = _prompt_ids(llm, batch)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(params=params, prompt_token_ids=ids)
    return llm, ids, params


def parts(mode: str, batch: int) -> None:
    seconds, calls = collections.Counter(), collections.Counter()

    def wrap(owner, name, label):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            seconds[label] += time.perf_counter() - start
            calls[label] += 1
            return result

        setattr(owner, name, timed)

    for owner, name, label in [
        (ops, "paged_attention", "attention"),
        (ops, "rotary_store_kv", "rotary_store"),
        (layers.ColumnParallelLinear, "forward", "col.forward"),
        (layers.RMSNorm, "forward", "rmsnorm"),
        (layers.ColumnParallelLinear, "forward_silu_mul", "gateup"),
        (layers.RowParallelLinear, "forward", "rowlinear"),
        (llama.CausalLM, "forward", "CAUSAL_FWD"),
        (llama.CausalLM, "compute_logits", "logits"),
    ]:
        wrap(owner, name, label)
    llm, ids, params = engine(mode, batch)
    seconds.clear()
    calls.clear()
    llm.generate(params=params, prompt_token_ids=ids)
    forwards = calls["CAUSAL_FWD"]
    print(mode, "batch", batch, "target forwards", forwards)
    for label, total in sorted(seconds.items(), key=lambda item: -item[1]):
        per_call = total / calls[label] * 1e6
        print(
            f"  {label:15s} {total / forwards * 1e3:8.3f} ms/fwd  {calls[label] / forwards:6.1f} calls/fwd",
            f"{per_call:8.1f} us/call",
        )


def ab(mode: str, batch: int, field: str) -> None:
    build = attention_batch.AttentionBatch.build.__func__
    on = {"value": True}

    def switched(cls, *args, **kwargs):
        made = build(cls, *args, **kwargs)
        return made if on["value"] else dataclasses.replace(made, **{field: None})

    attention_batch.AttentionBatch.build = classmethod(switched)
    llm, ids, params = engine(mode, batch)
    times, tokens = {"off": [], "on": []}, {}
    for round_ in range(8):
        for side in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            on["value"] = side == "on"
            start = time.perf_counter()
            outputs = llm.generate(params=params, prompt_token_ids=ids)
            times[side].append(time.perf_counter() - start)
            tokens[side] = [output.token_ids for output in outputs]
    for side, taken in times.items():
        rates = [round(MAX_TOKENS * batch / t, 1) for t in taken]
        print(
            mode, field, side, "median tok/s", round(MAX_TOKENS * batch / statistics.median(taken), 2), rates
        )
    print("same tokens", tokens["off"] == tokens["on"])


if __name__ == "__main__":
    command, mode = sys.argv[1], sys.argv[2]
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    if command == "parts":
        parts(mode, size)
    else:
        ab(mode, size, sys.argv[4])
