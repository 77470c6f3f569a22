"""Session 30, issue 19 (CPU): MKL's packed GEMM (`torch.ops.mkl._mkl_linear` over a weight reordered
once by `_mkl_reorder_linear_weight`) in place of `layers.linear` for 1-16 rows, end to end at batch 1:
plain, the serve default and `static` (blocks of 3), each with the measured paths and with packed
weights, two interleaved rounds in one process (4 bench prompts x 32 tokens). A quick try, not wired
into the engine; log beside it.

    .venv/bin/python benchmarks/results/cpu-2026-12-04-s30/packed_gemm_try.py [BATCH]

BATCH (default 1): the prompts run BATCH at a time (4 prompts at batch 1, 8 at batch 4 or 8).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.models import layers

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "client"))
from bench import PROMPTS  # noqa: E402

MEASURED = layers.linear


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """1-16 rows of a packed weight by MKL's packed GEMM; anything else as `layers.linear`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    packed = getattr(weight, "_packed", None)
    if packed is None or not 0 < rows <= layers.CPU_FEW_ROWS:
        return MEASURED(x, weight, bias)
    y = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed, weight, bias, rows)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def pack(llm: LLM) -> None:
    """Every 2-D weight of the target gets its packed copy (about 2.3x its size)."""
    for weight in llm.engine.runner.model.parameters():
        if weight.dim() == 2:
            weight._packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 4)


def tokens_per_s(llm: LLM, prompts: list[str], batch: int = 1) -> float:
    """The prompts `batch` at a time, 32 greedy tokens each."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), batch):
        tokens += sum(len(o.token_ids) for o in llm.generate(prompts[first : first + batch], params))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    prompts = PROMPTS[:4] if batch == 1 else PROMPTS[:8]
    engines = {
        "off": LLM(EngineConfig(spec_mode="off", device="cpu")),
        "default": LLM(EngineConfig(device="cpu")),
        "static": LLM(EngineConfig(device="cpu", adaptive_speculation=False)),
    }
    for llm in engines.values():
        pack(llm)
        tokens_per_s(llm, PROMPTS[:1])
    # `linear` as the modules that call it imported it.
    users = [m for m in list(sys.modules.values()) if m and getattr(m, "linear", None) is MEASURED]
    for round_ in range(2):
        result = {}
        for linear, label in ((MEASURED, "measured"), (packed_linear, "packed")):
            for module in users:
                module.linear = linear
            for name, llm in engines.items():
                result[f"{name}/{label}"] = round(tokens_per_s(llm, prompts, batch), 1)
        for module in users:
            module.linear = MEASURED
        print(f"batch {batch}, round {round_}: {result}", flush=True)


if __name__ == "__main__":
    main()
