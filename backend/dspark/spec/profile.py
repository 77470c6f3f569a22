"""Profile an SPS table: measured target steps per second by the number of tokens in a step."""

from __future__ import annotations

import statistics
import time

import torch

from dspark.config import EngineConfig
from dspark.runner.model_runner import ModelRunner, TargetStep, create_runner
from dspark.runner.models.loader import resolve_device, resolve_dtype
from dspark.spec.sps_table import SpsTable

# Each profiled step packs verify-sized windows (at most this many tokens) after this much context,
# the shape of a decode step with speculation.
WINDOW = 8
CONTEXT = 128


def profile_sps_table(config: EngineConfig, max_tokens: int = 256, repeats: int = 5) -> SpsTable:
    """Time the target's forward at 1, 2, 4, ... `max_tokens` tokens and return the table."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    runner = create_runner(config, device, dtype)
    try:
        return profile_runner(runner, config, max_tokens, repeats, str(device), str(dtype).split(".")[-1])
    finally:
        runner.close()


def profile_runner(
    runner: ModelRunner,
    config: EngineConfig,
    max_tokens: int,
    repeats: int,
    device: str,
    dtype: str,
    capture_layers: tuple[int, ...] = (),
) -> SpsTable:
    """The SPS table of an already loaded runner (its KV cache is scribbled on: call it before serving).

    Sizes are capped by what the cache can hold, so any engine configuration can profile itself.
    capture_layers: the layers an engine's steps hand its drafter, so that the profiled steps are the
    engine's own (the same captured graphs, the drafter's KV injection included)."""
    per_request = -(-(CONTEXT + WINDOW) // config.kv_page_size)
    if config.num_kv_pages < per_request:
        raise ValueError(
            f"num_kv_pages: {config.num_kv_pages} pages of {config.kv_page_size} tokens cannot hold one "
            f"{CONTEXT + WINDOW}-token profiling request; give an sps_table file or a larger cache"
        )
    max_tokens = min(max_tokens, (config.num_kv_pages // per_request) * WINDOW)
    sizes = [1 << i for i in range(max_tokens.bit_length()) if (1 << i) <= max_tokens]
    points = [(n, 1.0 / _median_step_seconds(runner, n, config, repeats, capture_layers)) for n in sizes]
    return SpsTable(points, model=str(config.model_path.name), device=device, dtype=dtype)


def startup_max_tokens(config: EngineConfig, block_size: int) -> int:
    """The largest step a decoding batch makes: every running request verifying a whole block."""
    return min(config.max_num_batched_tokens, config.max_num_seqs * (block_size + 1))


def _median_step_seconds(
    runner: ModelRunner, num_tokens: int, config: EngineConfig, repeats: int, capture_layers: tuple[int, ...]
) -> float:
    step = _synthetic_step(num_tokens, config, runner.model_config.vocab_size, capture_layers)
    runner.run(step)  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        runner.run(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synthetic_step(
    num_tokens: int, config: EngineConfig, vocab_size: int, capture_layers: tuple[int, ...]
) -> TargetStep:
    """Windows of up to WINDOW tokens, each after CONTEXT cached positions, on disjoint pages."""
    lens = [WINDOW] * (num_tokens // WINDOW) + ([num_tokens % WINDOW] if num_tokens % WINDOW else [])
    pages_per_request = -(-(CONTEXT + WINDOW) // config.kv_page_size)
    if len(lens) * pages_per_request > config.num_kv_pages:
        raise ValueError(f"num_kv_pages: {config.num_kv_pages} pages cannot hold a {num_tokens}-token step")
    pages = [list(range(r * pages_per_request, (r + 1) * pages_per_request)) for r in range(len(lens))]
    positions = [p for n in lens for p in range(CONTEXT, CONTEXT + n)]
    generator = torch.Generator().manual_seed(num_tokens)
    return TargetStep(
        token_ids=torch.randint(0, vocab_size, (num_tokens,), generator=generator),
        positions=torch.tensor(positions),
        window_starts=[CONTEXT] * len(lens),
        window_lens=lens,
        pages=pages,
        logit_rows=torch.arange(num_tokens),
        capture_layers=capture_layers,
        host_logits=False,  # as the engine's steps: the logits stay where they are computed
    )
