"""Stress a running dspark server: many concurrent gRPC streams of random lengths, a share cancelled
mid-way by their clients, repeated; every finished stream must equal its solo greedy text and every
cancelled one must be a prefix of it. The heavier twin of tests/test_serving_load.py.

    make serve &                                  # or any dspark serve / docker compose deployment
    .venv/bin/python benchmarks/stress_serving.py --url localhost:8001 --streams 512 --rounds 5

Prints one line per round (finished, cancelled, errors, mismatches, seconds, output tokens/s) and
exits 1 if any stream erred (a stream that ends without a final response, or waits too long, is one) or
differed from its solo text.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dspark_client.streaming import GrpcSession, ServerError

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "What is the capital of France?",
    "List three uses of copper.",
    "Tell me about rivers.",
    "Explain recursion to a child.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
]


@dataclass
class StreamResult:
    """What one client saw."""

    prompt: str
    ids: list[int]
    error: str | None
    finished: bool
    cancelled: bool


def run_stream(
    url: str, prompt: str, max_tokens: int, cancel_after: int | None, timeout: float
) -> StreamResult:
    """One client on its own stream; it closes the stream (cancelling) after `cancel_after` tokens."""
    session = GrpcSession(url)
    ids: list[int] = []
    try:
        for chunk in session.generate(
            prompt, {"max_tokens": max_tokens, "ignore_eos": True}, timeout=timeout
        ):
            ids.extend(chunk.token_ids)
            if chunk.final:
                return StreamResult(prompt, ids, None, True, False)
            if cancel_after is not None and len(ids) >= cancel_after:
                return StreamResult(prompt, ids, None, False, True)  # close() below cancels it
        return StreamResult(prompt, ids, "the stream ended without a final response", False, False)
    except ServerError as exc:
        return StreamResult(prompt, ids, str(exc), False, False)
    finally:
        session.close()


def solo_ids(url: str, max_tokens: int, timeout: float) -> dict[str, list[int]]:
    """Each prompt's greedy ids, decoded alone."""
    references = {}
    for prompt in PROMPTS:
        result = run_stream(url, prompt, max_tokens, None, timeout)
        if result.error is not None:
            raise SystemExit(f"solo request failed: {result.error}")
        references[prompt] = result.ids
    return references


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="localhost:8001", help="gRPC address (%(default)s)")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams per round (%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="%(default)s")
    parser.add_argument(
        "--cancel-share", type=float, default=0.2, help="share cancelled mid-way (%(default)s)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="longest stream (%(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a stream may wait (%(default)s)"
    )
    args = parser.parse_args(argv)

    references = solo_ids(args.url, args.max_tokens, args.timeout)
    rng = random.Random()
    failures = 0
    for round_ in range(args.rounds):
        plans = []
        for index in range(args.streams):
            max_tokens = rng.randint(2, args.max_tokens)
            cancel = rng.random() < args.cancel_share
            plans.append(
                (
                    PROMPTS[index % len(PROMPTS)],
                    max_tokens,
                    rng.randint(1, max_tokens - 1) if cancel else None,
                )
            )
        started = time.monotonic()
        with ThreadPoolExecutor(args.streams) as pool:
            results = list(pool.map(lambda plan: run_stream(args.url, *plan, args.timeout), plans))
        seconds = time.monotonic() - started
        errors = sum(r.error is not None for r in results)
        mismatches = sum(
            r.ids != references[r.prompt][: len(r.ids)] or (r.finished and len(r.ids) != plan[1])
            for r, plan in zip(results, plans, strict=True)
        )
        tokens = sum(len(r.ids) for r in results)
        finished, cancelled = sum(r.finished for r in results), sum(r.cancelled for r in results)
        print(
            f"round {round_}: {finished} finished, {cancelled} cancelled, {errors} errors, "
            f"{mismatches} mismatches, {seconds:.1f} s, "
            f"{tokens / seconds:.0f} output tokens/s",
            flush=True,
        )
        for r in results:
            if r.error is not None:
                print(f"  error: {r.error}", file=sys.stderr)
        failures += errors + mismatches
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
