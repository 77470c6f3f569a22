"""oneDNN's product over packed weights against F.linear, fp32 and bf16: ms for a pass over SmolLM2's
2-D weights (the tied embedding once) at 1-16 rows, best of 4.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s38/linear_pass_dtypes.py
"""

import time

import torch
import torch.nn.functional as F

from dspark.config import EngineConfig
from dspark.runner.models.loader import load_target_model

model = load_target_model(EngineConfig().model_path, dtype=torch.float32)
weights = [p.detach() for p in model.parameters() if p.dim() == 2]
for dtype in (torch.float32, torch.bfloat16):
    pairs = []
    for w in weights:
        w = w.to(dtype).contiguous()
        pairs.append((torch.ops.mkldnn._reorder_linear_weight(w, 1), w))
    for rows in (1, 2, 4, 8, 16):
        inputs = [torch.randn(rows, w.shape[1]).to(dtype) for _, w in pairs]
        onednn = by_linear = float("inf")
        for _ in range(4):
            start = time.perf_counter()
            for (packed, _w), x in zip(pairs, inputs, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            onednn = min(onednn, time.perf_counter() - start)
            start = time.perf_counter()
            for (_packed, w), x in zip(pairs, inputs, strict=True):
                F.linear(x, w)
            by_linear = min(by_linear, time.perf_counter() - start)
        print(f"{dtype} {rows:2d} rows: oneDNN {onednn * 1e3:.1f} ms, F.linear {by_linear * 1e3:.1f} ms")
