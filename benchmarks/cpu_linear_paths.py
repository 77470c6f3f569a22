"""A CPU linear's paths side by side, per row count: ms for a whole pass over a model's weights.

    python benchmarks/cpu_linear_paths.py [--model DIR] [--rounds 3]

For each row count 1..CPU_FEW_ROWS and MANY_ROWS (a prefill chunk's), every path `layers.linear` may
take (F.linear, the weight first, one row as two, oneDNN's and MKL's products over packed copies where
torch has them, the CPU kernel where it builds here) is timed over every 2-D weight of the target,
in order (so the weights come from memory as in a decode step), rounds alternated, best of the
rounds; then the choice `measure_cpu_linear_paths` makes when a model loads, and how long it took.
What this is for: which path wins differs by row count and by host (its BLAS and caches); a verify
window of a block of b drafts is b + 1 rows per request.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import torch

from dspark.config import EngineConfig
from dspark.kernels.cpu import linear as cpu_linear
from dspark.runner.models import layers
from dspark.runner.models.loader import load_target_model
from dspark.runner.models.measured_paths import MeasuredPaths


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(EngineConfig().model_path), help="%(default)s")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = load_target_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
    weights = [p for p in model.parameters() if p.dim() == 2]
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    kernel = f"kernel built for {cpu_linear.isa()}" if cpu_linear.available() else "no kernel"
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {kernel}")
    print(f"{args.model}: {len(weights)} weights, {megabytes:.0f} MB fp32; ms a pass, best of {args.rounds}")
    with torch.inference_mode():
        packed = tuple(path for path in layers.COPY_ATTRIBUTE if layers.pack_cpu_weights(weights, path))
        # The CPU kernel, where it runs here (fp32 only): timed at every row count.
        kernel = (layers.KERNEL,) if weights[0].dtype == torch.float32 and layers.kernel_here() else ()
        paths = (layers.BY_LINEAR, layers.WEIGHT_FIRST, layers.AS_TWO_ROWS) + packed + kernel
        print(f"{'rows':>4} " + " ".join(f"{p:>13}" for p in paths) + "  fastest / F.linear")
        for rows in (*range(1, layers.CPU_FEW_ROWS + 1), layers.MANY_ROWS):
            best = {p: math.inf for p in layers.candidates(rows, packed + kernel)}
            inputs = layers.pass_inputs(weights, rows)
            for _ in range(args.rounds):
                for path in best:
                    best[path] = min(best[path], layers.pass_seconds(weights, inputs, path) * 1e3)
            cells = " ".join(f"{best[p]:13.1f}" if p in best else f"{'':>13}" for p in paths)
            print(f"{rows:4d} {cells}  {min(best.values()) / best[layers.BY_LINEAR]:.2f}")
        layers.MEASURED = MeasuredPaths()  # measured afresh, the machine's file neither read nor written
        started = time.perf_counter()
        chosen = layers.measure_cpu_linear_paths(model)
        took = time.perf_counter() - started
    print(f"measured at load ({took:.1f} s): {chosen.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
