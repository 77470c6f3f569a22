"""The speculation gate of two trees driven by simulated steps (no model): one request or a batch, step
costs per draft length with +-3% noise, acceptance drawn per request from per-position chances, and
optionally a hard start (the first `hard` steps accept nothing: an answer's first tokens). Prints the
committed tokens per ms each gate reaches, mean of 10 seeds, beside the best fixed length's.

    .venv/bin/python benchmarks/results/cpu-2026-12-05-s37/gate_sim.py /tmp/base/backend/dspark/spec/gate.py
"""

import importlib.util
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load(path: str, name: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(gate_module, chances, cost, requests=1, steps=400, seed=0, hard=0) -> float:  # noqa: ANN001
    rng = random.Random(seed)
    clock = [0.0]
    gate = gate_module.SpeculationGate(3, lambda: clock[0])
    tokens = 0
    for step in range(steps):
        length = gate.draft_length(requests)
        gate.start_step(length)
        clock[0] += 0.001 * cost[length] * rng.uniform(0.97, 1.03)
        committed = []
        for _ in range(requests):
            accepted = 0
            if step >= hard:
                while accepted < 3 and rng.random() < chances[accepted]:
                    accepted += 1
            committed.append(1 + min(accepted, length))
        gate.finish_step(committed)
        tokens += sum(committed)
    return tokens / clock[0] / 1000


def best_fixed(chances, cost, requests) -> float:  # noqa: ANN001
    best = 0.0
    for length in range(4):
        tokens, survival = 1.0, 1.0
        for k in range(length):
            survival *= chances[k]
            tokens += survival
        best = max(best, tokens * requests / cost[length])
    return best


CASES = [
    ("mixed acceptance, flat cost b1", (0.5, 0.56, 0.5), (1, 1.06, 1.1, 1.12), 1),
    ("low acceptance, flat cost b1", (0.1, 0.3, 0.3), (1, 1.06, 1.1, 1.12), 1),
    ("moderate, costly windows b1", (0.5, 0.5, 0.5), (1, 1.3, 1.6, 2.0), 1),
    ("moderate, costly windows b64", (0.5, 0.5, 0.5), (1, 1.3, 1.6, 2.0), 64),
    ("good, cheap windows b64", (0.6, 0.6, 0.6), (1, 1.1, 1.15, 1.2), 64),
    ("nothing accepted b8", (0.0, 0.0, 0.0), (1, 1.05, 1.1, 1.12), 8),
    ("high acceptance b1", (0.8, 0.8, 0.8), (1, 1.1, 1.15, 1.2), 1),
]

if __name__ == "__main__":
    gates = {
        "base": load(sys.argv[1], "gate_base"),
        "this tree": load(str(ROOT / "backend/dspark/spec/gate.py"), "gate_new"),
    }
    for name, chances, cost, requests in CASES:
        for hard in (0, 10):
            rates = {
                k: sum(run(g, chances, cost, requests, seed=s, hard=hard) for s in range(10)) / 10
                for k, g in gates.items()
            }
            print(
                f"{name:32s} hard start {hard:2d}: best fixed {best_fixed(chances, cost, requests):8.3f}  "
                + "  ".join(f"{k} {v:8.3f}" for k, v in rates.items()),
                flush=True,
            )
