"""LLM.generate's text made per step (the code before) against once per completion at its end
(`LLMEngine.defer_text`, the new default of `dspark.LLM`): the engine's emit phase, ms a step, one
process, rounds interleaved; and whether the texts are the same.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s34/emit_ab.py BATCH MODE
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, bench_config  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402

batch, mode = int(sys.argv[1]), sys.argv[2]
llm = LLM(bench_config("", "", "cpu", batch, spec_mode=mode, adaptive_speculation=False))
ids = _prompt_ids(llm, batch)
params = SamplingParams(max_tokens=16, ignore_eos=True)
llm.generate(params=params, prompt_token_ids=ids)
emit: dict[bool, list[float]] = {False: [], True: []}
texts = {}
for _ in range(3):
    for defer in (False, True):
        llm.engine.defer_text = defer
        timer = llm.engine.timer
        timer.reset()
        timer.enabled = True
        outputs = llm.generate(params=params, prompt_token_ids=ids)
        timer.enabled = False
        emit[defer].append(round(timer.summary()["emit"], 3))
        texts.setdefault(defer, [o.text for o in outputs])
print(
    mode,
    batch,
    "emit ms a step: per step",
    emit[False],
    "at the end",
    emit[True],
    "same text",
    texts[True] == texts[False],
)
