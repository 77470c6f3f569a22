"""Host microseconds per step in each piece of the engine, per speculation mode, at one batch size.

    python benchmarks/host_costs.py --device cuda --batch 64 --max-tokens 64

Wraps the engine's step pieces (scheduling, the layout fill, graph replays, host-to-device copies,
drafting, acceptance, emission, ...) with wall-clock timers, adding no device synchronisation, and
prints for each one its inclusive microseconds per step, calls per step and microseconds per call,
next to the wall time per step. Pieces nest (a replay is inside CudaGraphs.replay, inside the runner);
one that waits for the device (greedy acceptance's copy to the host) includes the wait. Then one
target graph replay and two small operations are timed alone. What this is for: a step of a small
model at a large batch is bound by the host, and these are the host's costs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from collections.abc import Callable

import torch
from e2e import _prompt_ids, add_engine_arguments, bench_config

import dspark.engine.llm_engine as engine
import dspark.engine.output_processor as output_processor
import dspark.engine.scheduler as scheduler
import dspark.engine.step as step
import dspark.kernels.ops as ops
import dspark.runner.cuda_graphs as cuda_graphs
import dspark.runner.host_to_device as host_to_device
import dspark.runner.model_runner as model_runner
import dspark.runner.models.llama as llama
import dspark.spec.accept as accept
import dspark.spec.draft_graphs as draft_graphs
import dspark.spec.drafts as drafts
import dspark.spec.proposer as proposer
import dspark.spec.step_draft as step_draft
from dspark import LLM, SamplingParams

NANOSECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()

# (owner, attribute names): what is timed. Module-level functions are wrapped where they are looked
# up (the importing module), so that every call is seen.
TIMED = [
    (cuda_graphs.Captured, ["replay"]),
    (cuda_graphs.StaticLayout, ["fill"]),
    (cuda_graphs.CudaGraphs, ["fill", "replay"]),
    (draft_graphs.DraftGraphs, ["run", "run_in_step"]),
    (proposer.DSparkProposer, ["propose", "propose_in_step"]),
    (model_runner.ModelRunner, ["run", "forward"]),
    (engine.LLMEngine, ["step", "_launch", "_complete", "_draft", "_adjust_logits", "_commit"]),
    (engine.LLMEngine, ["_commit_tokens"]),
    (output_processor.PendingDelta, ["make"]),
    (engine, ["pack_step", "accept", "to_device"]),
    (step, ["queue_greedy"]),
    (step._Windows, ["to_step"]),
    (scheduler.Scheduler, ["schedule"]),
    (llama.CausalLM, ["compute_logits"]),
    (cuda_graphs, ["copy_to_device", "write_page_rows"]),
    (drafts, ["write_verify_tokens"]),
    (step_draft, ["write_verify_tokens"]),
    (model_runner, ["to_device"]),
    (accept, ["to_device"]),
    (ops, ["greedy_accept", "pack_verify_tokens"]),
]


def _timed(fn: Callable, label: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN202 - any timed function
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            NANOSECONDS[label] += time.perf_counter_ns() - start
            CALLS[label] += 1

    return wrapper


def _wrap_all() -> None:
    for owner, names in TIMED:
        prefix = owner.__name__.split(".")[-1]
        for name in names:
            setattr(owner, name, _timed(getattr(owner, name), f"{prefix}.{name}"))


def _report(mode: str, batch: int, wall_s: float) -> None:
    steps = CALLS["LLMEngine.step"]
    print(f"== {mode} b{batch}: {steps} steps, wall {wall_s / steps * 1e3:.3f} ms/step")
    for label, ns in sorted(NANOSECONDS.items(), key=lambda kv: -kv[1]):
        print(
            f"  {label:40s} {ns / steps / 1e3:8.1f} us/step  {CALLS[label] / steps:5.2f} calls/step  "
            f"{ns / CALLS[label] / 1e3:7.1f} us/call"
        )


def _alone(llm: LLM, device: torch.device) -> None:
    """One captured target replay, a clone and a pinned host-to-device copy, each timed alone."""
    graphs = llm.engine.runner.graphs
    if graphs is None or not graphs.captured:
        return
    key = max(graphs.captured)
    captured = graphs.captured[key]
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for _ in range(20):
        captured.replay()
    launched = time.perf_counter_ns()
    torch.cuda.synchronize()
    done = time.perf_counter_ns()
    print(
        f"  target graph {key[:2]} replay: {(launched - start) / 20e3:.1f} us host, "
        f"{(done - start) / 20e3:.1f} us device each"
    )
    x = torch.zeros(64, device=device)
    start = time.perf_counter_ns()
    for _ in range(200):
        x.clone()
    print(f"  clone of 64 floats: {(time.perf_counter_ns() - start) / 200e3:.1f} us host")
    host = torch.arange(200)
    start = time.perf_counter_ns()
    for _ in range(200):
        host_to_device.to_device(host, device)
    print(f"  pinned to_device of 200 ints: {(time.perf_counter_ns() - start) / 200e3:.1f} us host")


def _tiny_llm(mode: str, batch: int) -> LLM:
    """A 2-layer random target (vocabulary 512) and drafter on the CPU whose steps replay emulated CUDA
    graphs (`static` drafting inside the target step), so the pieces timed are the GPU path's host
    work plus a small model's CPU forward."""
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import use_emulated_graphs, write_tiny_drafter, write_tiny_target

    from dspark.config import EngineConfig

    work = Path(tempfile.mkdtemp(prefix="host-costs-"))
    target = write_tiny_target(work / "target", vocab_size=512, hidden=64)
    drafter = write_tiny_drafter(target, work / "drafter", block_size=3)
    config = EngineConfig(
        model=str(target),
        draft_model=str(drafter) if mode != "off" else "",
        spec_mode=mode,
        device="cpu",
        num_kv_pages=8192,
        kv_page_size=16,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * 8),
        adaptive_speculation=False,
    )
    llm = LLM(config)
    use_emulated_graphs(llm.engine, tokens=4 * batch + 64, requests=batch)
    return llm


def main(argv: list[str] | None = None) -> None:
    """Time each mode's pieces and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser, device="cuda")
    parser.add_argument("--modes", default="off,static")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random target and drafter on the CPU, through emulated CUDA graphs: the host's "
        "share of a GPU step (layout fills, in-step drafts, acceptance, emission) on any machine",
    )
    args = parser.parse_args(argv)
    _wrap_all()
    for mode in args.modes.split(","):
        if args.tiny:
            llm = _tiny_llm(mode, args.batch)
            ids = [[(7 * i + j) % 500 + 1 for j in range(24)] for i in range(args.batch)]
        else:
            config = bench_config(
                args.model,
                args.draft_model,
                args.device,
                args.batch,
                spec_mode=mode,
                adaptive_speculation=False,
            )
            llm = LLM(config)
            ids = _prompt_ids(llm, args.batch)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(params=params, prompt_token_ids=ids)  # warm-up
        NANOSECONDS.clear()
        CALLS.clear()
        device = llm.engine.limits.device
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(params=params, prompt_token_ids=ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
        _report(mode, args.batch, time.perf_counter() - start)
        if device.type == "cuda":
            _alone(llm, device)
        llm.close()


if __name__ == "__main__":
    main()
