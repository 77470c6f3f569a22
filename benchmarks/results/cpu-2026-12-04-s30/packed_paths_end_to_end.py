"""Session 30, issue 19 (CPU): the engine with the packed path measured in (`layers.PACKED`, the weights'
packed copies made at load) against the same engines without it, plain and the serve default, at batch
1 (4 bench prompts) and batch 4 (8 prompts, 4 at a time), 32 greedy tokens, interleaved rounds in one
process. `CPU_LINEAR_PATHS` is one process-wide choice: each engine's is set before it runs.

    .venv/bin/python benchmarks/results/cpu-2026-12-04-s30/packed_paths_end_to_end.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.models import layers

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "client"))
from bench import PROMPTS  # noqa: E402


def tokens_per_s(llm: LLM, prompts: list[str], batch: int) -> tuple[float, list[list[int]]]:
    """The prompts `batch` at a time, 32 greedy tokens each: tok/s and the tokens."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    start, outputs = time.perf_counter(), []
    for first in range(0, len(prompts), batch):
        outputs += [list(o.token_ids) for o in llm.generate(prompts[first : first + batch], params)]
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def main() -> None:
    engines, paths = {}, {}
    for label, packs in (("without", False), ("packed", True)):
        layers._MEASURED.clear()
        real = layers.packs_on_this_cpu
        if not packs:
            layers.packs_on_this_cpu = lambda: False
        for mode in ("off", "default"):
            name = f"{mode}/{label}"
            engines[name] = LLM(EngineConfig(device="cpu", **({"spec_mode": "off"} if mode == "off" else {})))
            paths[name] = layers.CPU_LINEAR_PATHS.by_rows
        layers.packs_on_this_cpu = real
        print(label, " ".join(f"{n}:{p}" for n, p in enumerate(paths[f"off/{label}"], 1)), flush=True)
    for batch, prompts in ((1, PROMPTS[:4]), (4, PROMPTS[:8])):
        for name, llm in engines.items():  # warm-up
            layers.CPU_LINEAR_PATHS.by_rows = paths[name]
            tokens_per_s(llm, prompts[:batch], batch)
        for round_ in range(3):
            rates, tokens = {}, {}
            for name, llm in engines.items():
                layers.CPU_LINEAR_PATHS.by_rows = paths[name]
                rates[name], tokens[name] = tokens_per_s(llm, prompts, batch)
            same = all(t == tokens["off/without"] for t in tokens.values())
            ratios = {
                "default/off without": rates["default/without"] / rates["off/without"],
                "default/off packed": rates["default/packed"] / rates["off/without"],
                "off packed/without": rates["off/packed"] / rates["off/without"],
            }
            print(
                f"batch {batch} round {round_}: "
                + ", ".join(f"{n} {r:.1f}" for n, r in rates.items())
                + " | "
                + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items())
                + f" | greedy tokens identical: {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
