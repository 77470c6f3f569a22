"""Where a step's host time goes: cProfile over one generate() per speculation mode at one batch size.

    python benchmarks/profile_host.py --device cuda --batch 64 --max-tokens 32 --out /tmp/profile

Mode `default`: the serve default (EngineConfig's spec mode and gate). Mode `gated-plain`: the serve
default's engine (drafter, gate) with its gate held at plain steps, to compare what a plain step costs
there with the plain engine's (`off`).

Writes <out>/<mode>-b<batch>.txt (the host's milliseconds per step in each engine phase, then the
top functions by own time and by cumulative time) and prints a line per mode with tokens/s. With
--kernels (a GPU), the table is torch.profiler's instead: the device kernels of the whole generate()
by their own device time, with launch counts, and the device's busy time per step against the wall
time per step. On a GPU, time spent in `.cpu()` / `.tolist()` / `.item()` is the host waiting for
the device; everything else at the top is Python work that a faster step must remove.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

from e2e import _prompt_ids, add_engine_arguments, bench_config

from dspark import LLM, SamplingParams

GATED_PLAIN = "gated-plain"  # a mode: the serve default's engine whose gate chooses plain steps only
SERVE_DEFAULT = "default"  # a mode: the serve default (its spec mode and gate, EngineConfig's defaults)


def main(argv: list[str] | None = None) -> None:
    """Profile each mode and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser, max_tokens=32)
    parser.add_argument(
        "--modes", default="off,static,compact", help=f"spec modes, {SERVE_DEFAULT} or {GATED_PLAIN}"
    )
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--kernels", action="store_true", help="device kernels, not cProfile")
    parser.add_argument("--decode-burst", type=int, default=1, help="decode_burst (1: no bursts)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        gated_plain = mode == GATED_PLAIN
        spec = {} if mode == SERVE_DEFAULT else {"spec_mode": "static" if gated_plain else mode}
        if mode != SERVE_DEFAULT:
            spec["adaptive_speculation"] = gated_plain
        config = bench_config(args.model, args.draft_model, args.device, args.batch, **spec)
        config = config.replace(decode_burst=args.decode_burst)
        llm = LLM(config)
        if gated_plain:
            # The serve default's engine (drafter loaded, its graphs and features) with every step plain:
            # what a plain step costs there against the plain engine's (`off`).
            llm.engine.gate.draft_length = lambda num_requests, draining=None: 0
        ids = _prompt_ids(llm, args.batch)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(params=params, prompt_token_ids=ids)  # warm-up: kernels compiled, graphs captured
        start = time.perf_counter()
        llm.generate(params=params, prompt_token_ids=ids)
        elapsed = time.perf_counter() - start
        if args.kernels:
            text = _kernel_table(llm, params, ids, args.top, elapsed)
        else:
            text = _host_phases(llm, params, ids) + _host_table(llm, params, ids, args.top)
        (args.out / f"{mode}-b{args.batch}.txt").write_text(text)
        print(f"{mode} batch {args.batch}: {args.batch * args.max_tokens / elapsed:.0f} tok/s", flush=True)
        llm.close()


def _host_phases(llm: LLM, params: SamplingParams, ids: list[list[int]]) -> str:
    """The engine's phase timer over one generate() without device synchronisation: the host's own
    milliseconds per step in each phase (the phase holding the first wait for the device absorbs it)."""
    timer = llm.engine.timer
    timer.reset()
    timer.enabled, timer.synchronize = True, False
    llm.generate(params=params, prompt_token_ids=ids)
    timer.enabled, timer.synchronize = False, True
    phases = {k: round(v, 3) for k, v in timer.summary().items()}
    return f"host ms per step by phase (no device sync): {phases}\n\n"


def _host_table(llm: LLM, params: SamplingParams, ids: list[list[int]], top: int) -> str:
    """cProfile of one generate(): the top functions by own and by cumulative time."""
    profile = cProfile.Profile()
    profile.enable()
    llm.generate(params=params, prompt_token_ids=ids)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def _kernel_table(llm: LLM, params: SamplingParams, ids: list[list[int]], top: int, wall_s: float) -> str:
    """torch.profiler over one generate(): device kernels by own device time, and the engine steps.
    The header compares the device's busy time per step with the wall time per step of the unprofiled
    run (`wall_s`): what is left is the device idle, waiting for the host."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outputs = llm.generate(params=params, prompt_token_ids=ids)
    committed = sum(len(o.token_ids) for o in outputs)
    steps = max(o.spec_stats.steps for o in outputs)
    averages = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in averages)
    header = (
        f"{len(ids)} requests, {committed} tokens committed, the longest request took {steps} steps\n"
        f"per step: device busy {busy_us / 1e3 / steps:.3f} ms, wall (unprofiled run) "
        f"{wall_s * 1e3 / steps:.3f} ms\n"
    )
    table = averages.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70)
    return header + table


if __name__ == "__main__":
    main()
