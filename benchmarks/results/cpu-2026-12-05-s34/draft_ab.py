"""The drafter's base logits on the CPU: projected position by position (the code before 44b8ea9) against
one product for the positions a block decodes (44b8ea9), one process, rounds interleaved.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s34/draft_ab.py BATCH
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, bench_config  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.runner.models.layers import linear  # noqa: E402
from dspark.spec.drafter import BlockHeads  # noqa: E402

ONE_PRODUCT, INDEXED = BlockHeads.project_all, BlockHeads.logits_at


def not_ahead(self: BlockHeads, num_positions: int | None = None) -> None:
    """The code before: nothing projected ahead..."""


def by_position(self: BlockHeads, position: int) -> torch.Tensor:
    """... and each position projected when the decode reaches it."""
    return linear(self.hidden[:, position], self.lm_head).float()


batch = int(sys.argv[1])
llm = LLM(bench_config("", "", "cpu", batch, spec_mode="static", adaptive_speculation=False))
ids = _prompt_ids(llm, batch)
params = SamplingParams(max_tokens=48, ignore_eos=True)
llm.generate(params=params, prompt_token_ids=ids)
results: dict[str, list[tuple[float, float]]] = {"by_position": [], "one_product": []}
tokens = {}
for _ in range(3):
    for name in results:
        one = name == "one_product"
        BlockHeads.project_all = ONE_PRODUCT if one else not_ahead
        BlockHeads.logits_at = INDEXED if one else by_position
        timer = llm.engine.timer
        timer.reset()
        timer.enabled = True
        start = time.perf_counter()
        outputs = llm.generate(params=params, prompt_token_ids=ids)
        elapsed = time.perf_counter() - start
        timer.enabled = False
        results[name].append((elapsed, timer.summary()["draft"]))
        tokens.setdefault(name, [o.token_ids for o in outputs])
for name, runs in results.items():
    print(name, "s", [round(s, 3) for s, _ in runs], "draft ms a step", [round(d, 2) for _, d in runs])
print("identical", tokens["one_product"] == tokens["by_position"])
