"""Batches run to their end, simulated (no model): the speculation gate of an older tree and of this one
choose each step's draft length for N requests of 128 tokens whose acceptance is each their own (a
chance p per draft position, p drawn per request from Beta(a, b)); a step's time is a + b * requests
per length (GPU-like, host-bound: an H100 at 64 requests plain 0.92 ms, a window of 3 drafts 1.30).
One gate lives through 3 warm batches and 5 timed ones, as `ab_trees.py` runs them (session 61: a gate
that takes `request_finished` is told of each request as it ends, as the engine does). Prints each gate's
time over plain decoding's (lower is faster) and the share of drafting choices, mean of 6 seeds.

    .venv/bin/python benchmarks/results/cpu-2026-12-07-s61/gate_batch_sim.py \
        .carry/base60/backend/dspark/spec/gate.py
"""

import importlib.util
import inspect
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
COST = {0: (0.55, 0.0058), 1: (0.62, 0.0083), 2: (0.66, 0.0092), 3: (0.70, 0.0094)}  # ms: a, b


def load(path: str, name: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def batch(gate, clock, rng, ps, tokens=128, fixed=None) -> tuple[float, int, int]:  # noqa: ANN001
    """One batch run to its end: its time (ms), drafting choices, choices."""
    left = [tokens] * len(ps)
    verified = [[0, 0, 0] for _ in ps]
    accepted = [[0, 0, 0] for _ in ps]
    start, drafting, choices = clock[0], 0, 0
    takes_draining = gate is not None and "draining" in inspect.signature(gate.draft_length).parameters
    finished = getattr(gate, "request_finished", None)
    while any(left):
        active = [r for r, n in enumerate(left) if n]
        n = len(active)
        if fixed is not None:
            length = fixed
        else:
            draining = None
            if takes_draining and n >= 2:
                draining = lambda active=active: ((left[r], verified[r], accepted[r]) for r in active)  # noqa: E731
            length = gate.draft_length(n, draining) if takes_draining else gate.draft_length(n)
            gate.start_step(length)
        choices += 1
        drafting += length > 0
        a, b = COST[length]
        clock[0] += (a + b * n) * rng.uniform(0.97, 1.03) / 1000
        committed = []
        for r in active:
            got = 0
            while got < length and rng.random() < ps[r]:
                got += 1
            for k in range(length):
                verified[r][k] += 1
            for k in range(got):
                accepted[r][k] += 1
            c = min(1 + got, left[r])
            left[r] -= c
            committed.append(c)
            if not left[r] and finished is not None:  # as the engine tells it when a request ends
                finished(verified[r], accepted[r])
        if fixed is None:
            gate.finish_step(committed)
    return (clock[0] - start) * 1000, drafting, choices


def run(module, requests: int, beta: tuple[float, float], seed: int, fixed=None) -> tuple[float, float]:  # noqa: ANN001
    rng = random.Random(seed)
    requests_rng = random.Random(seed + 1000)  # the requests' chances apart, alike for every gate
    clock = [0.0]
    gate = None if module is None else module.SpeculationGate(3, lambda: clock[0])
    total = drafting = choices = 0.0
    for i in range(8):
        ps = [requests_rng.betavariate(*beta) for _ in range(requests)]
        ms, d, c = batch(gate, clock, rng, ps, fixed=fixed)
        if i >= 3:
            total, drafting, choices = total + ms, drafting + d, choices + c
    return total, drafting / max(choices, 1)


if __name__ == "__main__":
    gates = {
        "base": load(sys.argv[1], "gate_base"),
        "this tree": load(str(ROOT / "backend/dspark/spec/gate.py"), "gate_new"),
    }
    # Session 61 adds acceptance as low as the shipped drafter's on the bench prompts (a mean chance near
    # 0.4: 1.6 tokens a step at 3 drafts), narrow and wide.
    for beta in ((6.0, 4.0), (3.0, 2.0), (1.5, 1.0), (4.0, 6.0), (2.0, 3.0)):
        for requests in (1, 8, 64, 128):
            plain = sum(run(None, requests, beta, s, fixed=0)[0] for s in range(6))
            fixed3 = sum(run(None, requests, beta, s, fixed=3)[0] for s in range(6))
            line = f"beta {beta} requests {requests:3d}: fixed 3 drafts {fixed3 / plain:5.3f}"
            for name, module in gates.items():
                results = [run(module, requests, beta, s) for s in range(6)]
                time, share = sum(t for t, _ in results) / plain, sum(d for _, d in results) / 6
                line += f"  {name} {time:5.3f} ({share:4.0%} drafting)"
            print(line, flush=True)
