"""A pass over SmolLM2's layer weights (120, the LM head left out) at 1, 3 and 4 rows on this CPU: F.linear
and MKL's packed GEMM, with and without small single-threaded ops between the products (as a model's
layers have), best of 5 alternated rounds, ms a pass.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s34/products_by_rows.py
"""

import time

import torch
import torch.nn.functional as F

from dspark.config import EngineConfig
from dspark.runner.models import layers
from dspark.runner.models.loader import load_target_model

torch.manual_seed(0)
model = load_target_model(str(EngineConfig().model_path), dtype=torch.float32, device=torch.device("cpu"))
weights = [p for p in model.parameters() if p.dim() == 2 and p.shape[0] != model.config.vocab_size]
layers.pack_cpu_weights(weights)
print(len(weights), "weights", round(sum(w.numel() for w in weights) * 4 / 1e6), "MB")


def one_pass(rows: int, path: str, between: int) -> float:
    """ms for a pass of `rows` rows over every weight by `path`, with `between` small ops after each."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    start = time.perf_counter()
    for w in weights:
        x = xs[w.shape[1]]
        if path == "linear":
            F.linear(x, w)
        else:
            torch.ops.mkl._mkl_linear(x, w.mkl_packed, w, None, rows)
        for _ in range(between):
            F.silu(x) * x
    return (time.perf_counter() - start) * 1e3


for between in (0, 5):
    best: dict[tuple[int, str], float] = {}
    for _ in range(5):
        for rows, path in ((1, "linear"), (3, "linear"), (4, "packed"), (4, "linear"), (1, "packed")):
            ms = one_pass(rows, path, between)
            best[(rows, path)] = min(best.get((rows, path), ms), ms)
    print("small ops between:", between, {f"{r} rows {p}": round(v, 1) for (r, p), v in best.items()})
