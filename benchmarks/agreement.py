"""Greedy agreement between engine settings: which setting changes greedy output, and where.

Every named setting runs the same prompts (the `dspark-client bench` prompts, repeated to the batch
size) greedily with ignore_eos, after one untimed run at that batch size; the report gives each
setting's tokens/s and, against a reference setting, how many sequences are identical and at which
token the others first differ. In fp32 speculation must change nothing; in bf16 a verify window's
other GEMM shape can flip a near-tie (README, "lossless"), and this measures how often.

    python3 benchmarks/agreement.py --batch-sizes 1,8,64 --max-tokens 128 --out $OUT/agreement.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from dspark import LLM, EngineConfig, SamplingParams
from dspark.outputs import STEP_PHASES, LoopTotals
from dspark.process_heap import freeze_startup_heap
from dspark_client.bench import PROMPTS

# name -> EngineConfig changes; the first is the reference. Plain decoding with every step waiting,
# then the loop settings, then speculation in each mode, then fp32 pairs.
SETTINGS: dict[str, dict] = {
    "off-waiting": {"spec_mode": "off", "launch_ahead": False, "overlap_scheduling": False},
    "off": {"spec_mode": "off"},
    "off-eager": {
        "spec_mode": "off",
        "launch_ahead": False,
        "overlap_scheduling": False,
        "cuda_graph_max_tokens": 0,
    },
    "default": {},
    "static": {"adaptive_speculation": False},
    "static-eager": {
        "adaptive_speculation": False,
        "launch_ahead": False,
        "overlap_scheduling": False,
        "cuda_graph_max_tokens": 0,
    },
    # Another draft vocabulary than the drafter's default (draft_vocab_size: --draft-vocab-size).
    "static-dv": {"adaptive_speculation": False},
    "default-dv": {},
    "off-fp32": {"spec_mode": "off", "dtype": "float32"},
    "static-fp32": {"adaptive_speculation": False, "dtype": "float32"},
    "default-fp32": {"dtype": "float32"},
}


def offline_run(
    config: EngineConfig, batch_sizes: list[int], max_tokens: int, loops: dict | None = None
) -> tuple[dict[int, float], dict[int, list[list[int]]]]:
    """dspark.LLM at each batch size: output tokens/s of one generate() of the bench prompts (after an
    untimed one at that size: the adaptive gate settles, every graph tier it uses is warm), and the
    tokens it gave (greedy, ignore_eos). `loops`, when given, receives each timed generate()'s engine
    loop totals (`loop_shares`)."""
    engine = OfflineEngine(config, max_tokens)
    rates, tokens = {}, {}
    for batch in batch_sizes:
        rates[batch], tokens[batch], loop = engine.measure(batch)
        if loops is not None:
            loops[batch] = loop
    engine.close()
    return rates, tokens


class OfflineEngine:
    """dspark.LLM, warmed up, measuring batches of the bench prompts greedily (ignore_eos)."""

    def __init__(self, config: EngineConfig, max_tokens: int) -> None:
        self.llm = LLM(config)
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))
        freeze_startup_heap()  # as the served engine process does: the two sides' collections alike

    def measure(self, batch: int, repeats: int = 1) -> tuple[float, list[list[int]], dict]:
        """`timed_generate` of `batch` prompts, `repeats` times back to back, after an untimed one (the
        adaptive gate settles, every graph tier it uses is warm)."""
        self.warm_up(batch)
        return timed_generate(self.llm, batch, self.params, repeats)

    def warm_up(self, batch: int) -> None:
        """One untimed generate() of `batch` prompts, before a measurement of that batch size."""
        self.llm.generate(bench_prompts(batch), self.params)

    def close(self) -> None:
        """Free the engine and its GPU memory."""
        self.llm.engine.close()
        del self.llm
        gc.unfreeze()  # the engine's cycles are collectable again
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_PROMPTS = list(PROMPTS)  # what bench_prompts cycles through (`use_prompts`)


def use_prompts(prompts: list[str]) -> None:
    """Cycle through these prompts from now on (default: `dspark-client bench`'s)."""
    _PROMPTS[:] = prompts


def bench_prompts(count: int, shift: int = 0) -> list[str]:
    """`count` of the bench prompts (`use_prompts`), cycled, from the `shift`-th on."""
    return [_PROMPTS[(shift + i) % len(_PROMPTS)] for i in range(count)]


def timed_generate(
    llm: LLM, batch: int, params: SamplingParams, repeats: int = 1
) -> tuple[float, list[list[int]], dict]:
    """`repeats` timed generate() calls of `batch` bench prompts, back to back: output tokens/s over
    them all, the first call's tokens, and the engine loop's shares of their time (`loop_shares`). A
    window as long as the one it is compared with: this host's speed moves within a second. Call r
    sends prompts r .. r + batch - 1 (cycled): the prompts `load_generator`'s streams send, stream i
    its request r the prompt i + r (at one stream, `repeats` calls of the first prompt alone were
    compared with the served stream's first `repeats` prompts: 1.67 tokens a step offline against
    1.38-1.51 served, the drafter's acceptance on other questions, not the server's loss)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    before = llm.engine.load().loop
    seconds, output_tokens, tokens = 0.0, 0, None
    for repeat in range(repeats):
        prompts = bench_prompts(batch, repeat)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds += time.perf_counter() - started
        output_tokens += sum(len(o.token_ids) for o in outputs)
        tokens = tokens or [list(o.token_ids) for o in outputs]
    loop = loop_shares(before, llm.engine.load().loop, seconds, output_tokens)
    return round(output_tokens / seconds, 1), tokens or [], loop


def loop_shares(before: LoopTotals, after: LoopTotals, seconds: float, output_tokens: int) -> dict:
    """What the engine loop did in a window of `seconds` that produced `output_tokens` (two
    `LoopTotals` snapshots around it): steps/s, requests and output tokens per step, the shares of the
    steps replayed from a graph, launched ahead, carrying a prefill chunk and run in bursts (and the
    bursts' mean length), the drafts
    a request verified a step (the adaptive gate's choice), the share of the window in step calls, and
    per step: wall ms (also apart for the steps that carried a prefill chunk and the others), the
    acceptance's ms (where the host waits for the device), the served loop's ms between
    steps (taking in commands, handing over deltas), the garbage collector's ms (and its full passes in
    the window) and the host's ms in each phase of the step (`host_<phase>_ms`)."""
    steps = max(after.steps - before.steps, 1)
    requests = after.step_requests - before.step_requests
    step_s = after.step_seconds - before.step_seconds
    prefill_s = after.prefill_step_seconds - before.prefill_step_seconds
    prefill_steps = after.prefill_steps - before.prefill_steps
    return {
        "steps_per_s": round((after.steps - before.steps) / seconds, 1),
        "requests_per_step": round(requests / steps, 2),
        "tokens_per_step": round(output_tokens / steps, 2),
        "graph": round((after.graph_steps - before.graph_steps) / steps, 3),
        "ahead": round((after.ahead_steps - before.ahead_steps) / steps, 3),
        "prefill": round((after.prefill_steps - before.prefill_steps) / steps, 3),
        "burst": round((after.burst_steps - before.burst_steps) / steps, 3),
        "burst_length": round(
            (after.burst_steps - before.burst_steps) / max(after.bursts - before.bursts, 1), 2
        ),
        "drafts_per_request": round((after.verify_tokens - before.verify_tokens) / max(requests, 1), 3),
        "in_steps": round(step_s / seconds, 3),
        "step_ms": round(1e3 * step_s / steps, 3),
        # Steps that carried a prefill chunk, and the others: what admitting a prompt costs a step.
        "prefill_step_ms": round(1e3 * prefill_s / max(prefill_steps, 1), 3),
        "decode_step_ms": round(1e3 * (step_s - prefill_s) / max(steps - prefill_steps, 1), 3),
        "accept_ms": round(1e3 * (after.accept_seconds - before.accept_seconds) / steps, 3),
        # The served loop between its steps (0 offline): commands taken in, deltas handed over.
        "intake_ms": round(1e3 * (after.intake_seconds - before.intake_seconds) / steps, 3),
        "handover_ms": round(1e3 * (after.handover_seconds - before.handover_seconds) / steps, 3),
        # The process's garbage collector (its passes hold the loop wherever they start): ms a step, and
        # the passes over the oldest generation in the window.
        "gc_ms": round(1e3 * (after.gc_seconds - before.gc_seconds) / steps, 3),
        "gc_full": after.gc_full_collections - before.gc_full_collections,
    } | {
        f"host_{phase}_ms": round(1e3 * (getattr(after, name) - getattr(before, name)) / steps, 3)
        for phase, name in ((phase, f"host_{phase}_seconds") for phase in STEP_PHASES)
    }


def run_setting(changes: dict, batch_sizes: list[int], max_tokens: int) -> dict:
    """tokens/s and greedy tokens per batch size of one setting."""
    config = EngineConfig(max_num_seqs=max(256, max(batch_sizes)), num_kv_pages=4096, **changes)
    rates, tokens = offline_run(config, batch_sizes, max_tokens)
    return {batch: {"tok_s": rates[batch], "tokens": tokens[batch]} for batch in batch_sizes}


def compare(reference: list[list[int]], other: list[list[int]]) -> tuple[int, list[int]]:
    """Identical sequences, and the first differing token of each other one."""
    identical, firsts = 0, []
    for a, b in zip(reference, other, strict=True):
        if a == b:
            identical += 1
        else:
            firsts.append(
                next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            )
    return identical, sorted(firsts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--draft-vocab-size", type=int, default=-1, help="of the -dv settings (-1: every token)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    names = args.settings.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    runs = {}
    for name in names:
        changes = dict(SETTINGS[name])
        if name.endswith("-dv"):
            changes["draft_vocab_size"] = args.draft_vocab_size
        runs[name] = run_setting(changes, batch_sizes, args.max_tokens)
        print(name, {b: runs[name][b]["tok_s"] for b in batch_sizes}, flush=True)
    rows = []
    for name in names:
        # fp32 settings against the first fp32 one, the others against the first setting.
        fp32 = name.endswith("-fp32")
        reference = next(n for n in names if n.endswith("-fp32") == fp32)
        for batch in batch_sizes:
            same, firsts = compare(runs[reference][batch]["tokens"], runs[name][batch]["tokens"])
            rows.append((name, reference, batch, runs[name][batch]["tok_s"], same, batch, firsts[:12]))
    print("| setting | against | batch | tok/s | identical | first divergence (tokens) |")
    print("|---|---|---:|---:|---:|---|")
    for name, reference, batch, tok_s, same, total, firsts in rows:
        print(f"| {name} | {reference} | {batch} | {tok_s} | {same} / {total} | {firsts or '-'} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": runs, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
