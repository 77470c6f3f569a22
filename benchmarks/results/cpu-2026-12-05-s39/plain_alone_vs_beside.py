"""Does plain decoding run slower in a process that also holds a speculative engine? Plain alone, then
plain and the serve default side by side, then plain alone again (after deleting the other), one process,
`dspark-client bench`'s questions chat-formatted, batch 1, 64 greedy tokens. Run from the repository root:
OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s39/plain_alone_vs_beside.py"""

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, _time_engines, bench_config  # noqa: E402
from side_by_side import prompt_set  # noqa: E402

from dspark import LLM  # noqa: E402

texts = prompt_set("bench")
plain = LLM(bench_config("", "", "cpu", 1, spec_mode="off"))
ids = _prompt_ids(plain, len(texts), texts)
for phase in ("alone", "beside", "alone again"):
    engines = {"plain": plain}
    if phase == "beside":
        engines["default"] = LLM(bench_config("", "", "cpu", 1))
    results = _time_engines(engines, ids, 64, None, 3, len(ids))
    print(phase, {name: round(r[0], 1) for name, r in results.items()}, flush=True)
    engines.pop("plain")
    del engines, results
    gc.collect()
