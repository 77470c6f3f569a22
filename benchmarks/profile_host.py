"""Where a step's host time goes: cProfile over one generate() per speculation mode at one batch size.

    python benchmarks/profile_host.py --device cuda --batch 64 --max-tokens 32 --out /tmp/profile

Writes <out>/<mode>-b<batch>.txt (the top functions by own time and by cumulative time) and prints a
line per mode with tokens/s. On a GPU, time spent in `.cpu()` / `.tolist()` / `.item()` is the host
waiting for the device; everything else at the top is Python work that a faster step must remove.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

from e2e import _prompt_ids

from dspark import LLM, EngineConfig, SamplingParams


def main(argv: list[str] | None = None) -> None:
    """Profile each mode and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="off,static,compact")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        config = EngineConfig(
            model=args.model,
            draft_model=args.draft_model,
            device=args.device,
            spec_mode=mode,
            adaptive_speculation=False,
            num_kv_pages=max(1024, 16 * args.batch),
            max_num_seqs=max(32, args.batch),
        )
        llm = LLM(config)
        ids = _prompt_ids(llm, args.batch)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(params=params, prompt_token_ids=ids)  # warm-up: kernels compiled, graphs captured
        start = time.perf_counter()
        llm.generate(params=params, prompt_token_ids=ids)
        elapsed = time.perf_counter() - start
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(params=params, prompt_token_ids=ids)
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        (args.out / f"{mode}-b{args.batch}.txt").write_text(text.getvalue())
        print(f"{mode} batch {args.batch}: {args.batch * args.max_tokens / elapsed:.0f} tok/s", flush=True)
        llm.close()


if __name__ == "__main__":
    main()
