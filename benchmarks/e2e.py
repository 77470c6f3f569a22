"""End-to-end decoding speed, side by side in one run: dspark with speculation off / static / compact
(drafting every step), the serve default (`spec_mode` behind the adaptive gate, `adaptive_speculation`),
and Hugging Face transformers `generate()` on the same checkpoint (the peer a user reaches for first).

    python benchmarks/e2e.py --batch-sizes 1,4 --max-tokens 64 --out benchmarks/results/e2e-cpu.json

Greedy decoding, chat-formatted prompts; every engine run's tokens are checked against plain decoding
(speculation must not change them) and the table reports output tokens/s and the ratio to plain.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from dspark import LLM, EngineConfig, SamplingParams
from dspark.outputs import gate_rows
from dspark.runner.cuda_graphs import next_pow2
from dspark.training.data import encode_prompt, read_prompts

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works.",
    "Write a Python function that checks whether a number is prime.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for learning a new language.",
    "Describe the water cycle in simple terms.",
    "Write a haiku about autumn.",
    "How do I reverse a list in Python?",
]


def add_engine_arguments(
    parser: argparse.ArgumentParser, device: str = "auto", batch: int = 64, max_tokens: int = 64
) -> None:
    """The one-batch benchmarks' engine options: --model, --draft-model (empty: the embedded defaults),
    --device, --batch and --max-tokens (`bench_config` takes the first four)."""
    parser.add_argument("--model", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--device", default=device)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)


def bench_config(model: str, draft_model: str, device: str, max_batch: int, **fields: object) -> EngineConfig:
    """The benchmarks' engine: these checkpoints on `device`, with cache pages and request slots for
    `max_batch` requests at once, and `fields` (e.g. spec_mode, or other cache sizes) set."""
    sized: dict[str, object] = {"num_kv_pages": max(1024, 16 * max_batch), "max_num_seqs": max(32, max_batch)}
    return EngineConfig(model=model, draft_model=draft_model, device=device, **(sized | fields))


def _prompt_ids(
    llm: LLM, count: int, prompts: list[str | list[dict[str, str]]] | None = None
) -> list[list[int]]:
    """`count` chat-formatted prompts, cycling through `prompts` (user texts or whole conversations;
    default: PROMPTS)."""
    pool = prompts or PROMPTS
    return [encode_prompt(llm.tokenizer, pool[i % len(pool)]) for i in range(count)]


def _time_engine(
    llm: LLM, ids: list[list[int]], max_tokens: int, phases: dict | None = None, repeats: int = 1
) -> tuple[float, list[list[int]], dict]:
    """Output tokens/s of the median of `repeats` timed runs (after a warm-up on the same batch), the
    tokens and spec stats of the first. With `phases` (a dict), one more run records where each step's
    time goes into it (the engine's StepTimer synchronises the device per phase, so it does not count
    for tokens/s)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # Warm-up on the same batch: compiles kernels and captures the CUDA graphs of the step sizes it meets.
    llm.generate(params=SamplingParams(max_tokens=min(32, max_tokens), ignore_eos=True), prompt_token_ids=ids)
    times, outs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        run = llm.generate(params=params, prompt_token_ids=ids)
        times.append(time.perf_counter() - start)
        outs = outs or run
    elapsed = statistics.median(times)
    if phases is not None:
        timer = llm.engine.timer
        timer.reset()
        timer.enabled = True
        llm.generate(params=params, prompt_token_ids=ids)
        timer.enabled = False
        phases.update({k: round(v, 3) for k, v in timer.summary().items()})
    stats = outs[0].spec_stats
    for out in outs[1:]:
        stats.merge(out.spec_stats)
    return sum(len(o.token_ids) for o in outs) / elapsed, [o.token_ids for o in outs], stats.as_dict()


def _in_groups(ids: list[list[int]], groups: int) -> list[list[list[int]]]:
    """`ids` as `groups` equal batches, in order (the batches a figure runs one after another)."""
    size = len(ids) // groups
    return [ids[g * size : (g + 1) * size] for g in range(groups)]


def _time_engines(
    engines: dict[str, LLM],
    ids: list[list[int]],
    max_tokens: int,
    phases: dict | None,
    repeats: int,
    groups: int = 1,
) -> dict[str, tuple[float, list[list[int]], dict]]:
    """`_time_engine` for several engines with their timed runs interleaved: repeat k runs each engine
    once, in an order rotated by k, so that a slow spell of the machine (whose host speed drifts by
    tens of percent within minutes) falls on every engine alike rather than on whichever came last.
    groups: `ids` holds that many batches, run one after another in each timed run (so that a figure
    at a small batch covers more prompts than the batch holds).
    Per engine: (median tokens/s, tokens and spec stats of its first run); `phases` as there."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=min(32, max_tokens), ignore_eos=True)
    batches = _in_groups(ids, groups)
    for llm in engines.values():
        llm.generate(params=warm, prompt_token_ids=batches[0])
    names = list(engines)
    times: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, list] = {}
    for k in range(repeats):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            start = time.perf_counter()
            run = [
                out
                for batch in batches
                for out in engines[name].generate(params=params, prompt_token_ids=batch)
            ]
            times[name].append(time.perf_counter() - start)
            first.setdefault(name, run)
    results = {}
    for name in names:
        outs = first[name]
        stats = outs[0].spec_stats
        for out in outs[1:]:
            stats.merge(out.spec_stats)
        tps = sum(len(o.token_ids) for o in outs) / statistics.median(times[name])
        results[name] = (tps, [o.token_ids for o in outs], stats.as_dict())
        if phases is not None:
            timer = engines[name].engine.timer
            timer.reset()
            timer.enabled = True
            engines[name].generate(params=params, prompt_token_ids=batches[0])
            timer.enabled = False
            phases[name] = {k: round(v, 3) for k, v in timer.summary().items()}
    return results


def _time_sustained_once(
    llm: LLM, ids: list[list[int]], concurrency: int, lengths: list[int]
) -> tuple[float, float, dict]:
    """Output tokens/s with `concurrency` requests in flight until every prompt of `ids` is done: a
    finished request's slot takes the next prompt at once, as a server under steady load does (a
    batch that starts together instead runs until its slowest request is done). `lengths`: each
    prompt's answer length (`answer_lengths`).

    Returns the whole run's tokens/s, its steady window's (from the first finished request to the
    admission of the last prompt: no ramp-up, no drain; NaN when no prompt waits for a slot), and
    the run's spec stats."""
    from dspark.outputs import SpecStats

    engine = llm.engine
    pending = list(enumerate(ids))
    in_flight = 0
    produced = 0
    # (time, tokens produced) when the first request finished and when the last prompt was admitted.
    window_start: tuple[float, int] | None = None
    window_end: tuple[float, int] | None = None
    stats = SpecStats()
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            params = SamplingParams(max_tokens=lengths[i], ignore_eos=True)
            engine.add_request(f"sustained-{i}-{time.perf_counter_ns()}", prompt, params)
            in_flight += 1
            if not pending and window_start is not None:
                window_end = (time.perf_counter(), produced)
        for delta in engine.step():
            produced += len(delta.new_token_ids)
            if delta.finished:
                in_flight -= 1
                stats.merge(delta.spec_stats)
                if window_start is None:
                    window_start = (time.perf_counter(), produced)
    whole = produced / (time.perf_counter() - start)
    steady = float("nan")
    if window_start is not None and window_end is not None and window_end[0] > window_start[0]:
        steady = (window_end[1] - window_start[1]) / (window_end[0] - window_start[0])
    return whole, steady, stats.as_dict()


def answer_lengths(count: int, max_tokens: int, spread: float, seed: int = 0) -> list[int]:
    """Each of `count` requests' answer length: `max_tokens` for all when `spread` is 0, else drawn
    uniformly from max_tokens * (1 -/+ spread) (seeded: every engine gets the same lengths). With one
    length for all and ignore_eos, plain decoding's requests finish on the same step and their slots
    refill in one prompt-taking step, while a drafting engine's finish steps apart and take prompts in
    nearly every step; a server's answers have many lengths, which staggers plain's finishes too."""
    if spread <= 0:
        return [max_tokens] * count
    rng = random.Random(seed)
    low, high = max(1, round(max_tokens * (1 - spread))), max(1, round(max_tokens * (1 + spread)))
    return [rng.randint(low, high) for _ in range(count)]


def _ratio(tps: float, off: float) -> float:
    """tps / off; NaN when off is 0 (a steady window too short to commit anything, in a tiny run)."""
    return tps / off if off > 0 else float("nan")


def steady_load_table(rows: list[dict], window: str = "") -> list[str]:
    """Markdown lines of the --sustained runs: per batch size in flight, tok/s (τ, ratio to off) of
    the whole runs, or (window="_steady") of their steady windows."""
    lines = ["| in flight | off | static | compact | default |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        off = r[f"sustained_off{window}"]
        cells = [
            f"{r[f'sustained_{m}{window}']:.1f} ({r[f'sustained_{m}_tau']:.2f}, "
            f"{_ratio(r[f'sustained_{m}{window}'], off):.2f}x)"
            for m in ("static", "compact", "default")
        ]
        lines.append(f"| {r['batch']} | {off:.1f} | " + " | ".join(cells) + " |")
    return lines


def identical_share(expected: list[list[int]], got: list[list[int]]) -> float:
    """The share of sequences whose greedy tokens are identical. In fp32 speculation never changes
    them (tests prove it); in bf16 a verify window and a one-token step round differently, so near-tied
    argmaxes can flip and a continuation diverge: reported, not hidden."""
    return sum(a == b for a, b in zip(expected, got, strict=True)) / max(len(expected), 1)


def _time_transformers(
    model_dir: str, ids: list[list[int]], max_tokens: int, device: str, dtype, groups: int = 1
) -> float:
    """Output tokens/s of transformers' greedy `generate()` over `ids`, as `groups` batches in turn."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id or 0

    def padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        return input_ids, mask

    batches = [padded(batch) for batch in _in_groups(ids, groups)]
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        input_ids, mask = batches[0]
        model.generate(
            input_ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False, pad_token_id=pad
        )
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for input_ids, mask in batches:
            model.generate(input_ids, attention_mask=mask, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
    return len(ids) * max_tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    """Run the sweep and print a markdown table (and write JSON with --out)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sps-table", default="")
    parser.add_argument(
        "--block-size", type=int, default=0, help="every engine's block_size (0: the drafter's)"
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=0,
        help="every engine's draft_vocab_size (0: the drafter's default, -1: every token)",
    )
    parser.add_argument(
        "--default-mode",
        default=EngineConfig.spec_mode,
        help="the spec_mode of the gated 'default' engine (the serve default unless told otherwise)",
    )
    parser.add_argument(
        "--prompts",
        default="",
        help="a prompt set (JSON lines with id, domain, prompt; e.g. training/prompts_eval.jsonl); "
        "default: the 8 built in",
    )
    parser.add_argument(
        "--min-prompts",
        type=int,
        default=1,
        help="each figure covers at least this many prompts: batches of B distinct prompts run one after "
        "another (ceil(N / B) of them), so a batch-1 figure is not one prompt's",
    )
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--phases", action="store_true", help="also record per-phase step times")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per figure (the median counts), interleaved across the engines",
    )
    parser.add_argument(
        "--sustained",
        type=int,
        default=0,
        help="also run each batch size B as a steady load: B requests in flight, K*B in all (K = this)",
    )
    parser.add_argument(
        "--sustained-spread",
        type=float,
        default=0.0,
        help="steady load's answer lengths drawn from --max-tokens * (1 -/+ this), the same for every "
        "engine (0: --max-tokens for all; see answer_lengths)",
    )
    args = parser.parse_args(argv)
    if args.sps_table == "profile":
        # The engine logs the table it measured (INFO): the planner's plans are read against it.
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    texts = [p.conversation for p in read_prompts(args.prompts)] if args.prompts else None
    base = bench_config(
        args.model,
        args.draft_model,
        args.device,
        max(batch_sizes),
        sps_table=args.sps_table,
        block_size=args.block_size,
        draft_vocab_size=args.draft_vocab_size,
    )
    rows = []
    # static and compact draft on every step (what speculation itself does); "default" is the serve
    # default (--default-mode: EngineConfig's spec_mode unless told) behind the adaptive gate that drafts
    # only while drafting pays.
    engines = {
        mode: LLM(base.replace(spec_mode=mode, adaptive_speculation=False))
        for mode in ("off", "static", "compact")
    }
    engines["default"] = LLM(base.replace(spec_mode=args.default_mode, adaptive_speculation=True))
    device = engines["off"].engine.limits.device.type
    dtype = engines["off"].engine.limits.dtype
    for batch in batch_sizes:
        groups = max(1, -(-args.min_prompts // batch))
        ids = _prompt_ids(engines["off"], batch * groups, texts)
        phases: dict[str, dict] | None = {} if args.phases else None
        timed = _time_engines(engines, ids, args.max_tokens, phases, args.repeats, groups)
        plain_tps, plain_tokens, _ = timed["off"]
        row = {"batch": batch, "prompts": len(ids), "off": plain_tps}
        if phases is not None:
            row["phases_ms"] = phases
        for mode in ("static", "compact", "default"):
            tps, tokens, stats = timed[mode]
            row[f"{mode}_identical"] = identical_share(plain_tokens, tokens)
            if tokens != plain_tokens and dtype == torch.float32:
                raise SystemExit(f"{mode}: speculation changed greedy output at batch {batch}")
            row[mode] = tps
            row[f"{mode}_tau"] = stats["mean_committed_per_step"]
        if args.sustained:
            pool = _prompt_ids(engines["off"], batch * args.sustained, texts)
            lengths = answer_lengths(len(pool), args.max_tokens, args.sustained_spread)
            runs: dict[str, list] = {mode: [] for mode in engines}
            names = list(engines)
            for k in range(args.repeats):  # interleaved as in _time_engines
                for mode in names[k % len(names) :] + names[: k % len(names)]:
                    runs[mode].append(_time_sustained_once(engines[mode], pool, batch, lengths))
            for mode, mode_runs in runs.items():
                row[f"sustained_{mode}"] = statistics.median(r[0] for r in mode_runs)
                row[f"sustained_{mode}_steady"] = statistics.median(r[1] for r in mode_runs)
                row[f"sustained_{mode}_tau"] = mode_runs[0][2]["mean_committed_per_step"]
        # What the gated engine measured and chose in this batch's tier (its gate lives on across the
        # batch sizes and runs): where the default trails plain or static, whether the gate's step times
        # or its tokens a request were off.
        gate = engines["default"].engine.gate
        if gate is not None:
            row["default_gate"] = [g for g in gate_rows(gate.view()) if g["tier"] == next_pow2(batch)]
        if not args.no_peer:
            try:
                row["transformers"] = _time_transformers(
                    str(base.model_path), ids, args.max_tokens, device, dtype, groups
                )
            except ImportError as error:  # e.g. transformers beside the numpy 1.26 the serving stub needs
                print(f"transformers column left out: {error}", flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "| batch | off tok/s | static tok/s (τ) | compact tok/s (τ) | default (gated) tok/s (τ) "
        "| transformers tok/s | static / off | compact / off | default / off | static / transformers |"
    )
    print("|" + "---|" * 10)
    for r in rows:
        peer = r.get("transformers")
        off = r["off"]
        print(
            f"| {r['batch']} | {off:.1f} | {r['static']:.1f} ({r['static_tau']:.2f}) | "
            f"{r['compact']:.1f} ({r['compact_tau']:.2f}) | {r['default']:.1f} ({r['default_tau']:.2f}) | "
            f"{peer or float('nan'):.1f} | {r['static'] / off:.2f} | {r['compact'] / off:.2f} | "
            f"{r['default'] / off:.2f} | {(r['static'] / peer) if peer else float('nan'):.2f} |"
        )
    gated = [r for r in rows if r.get("default_gate")]
    if gated:
        print("\nThe gated engine's view in each batch's tier after its runs: per draft length, its median")
        print("step ms, steps measured / chosen, and tokens a request it expects")
        lengths = sorted({g["length"] for r in gated for g in r["default_gate"]})
        print("| batch | " + " | ".join(f"length {n}" for n in lengths) + " |")
        print("|---:|" + "---|" * len(lengths))
        for r in gated:
            by_length = {g["length"]: g for g in r["default_gate"]}
            cells = [
                (
                    f"{1e3 * g['step_seconds']:.3f} ms, {g['measured_steps']} / {g['chosen_steps']}, "
                    f"{g['tokens_per_request']:.2f}"
                )
                if (g := by_length.get(n))
                else "-"
                for n in lengths
            ]
            print(f"| {r['batch']} | " + " | ".join(cells) + " |")
    if args.sustained:
        print(
            f"\nSteady load ({args.sustained}x the batch size in requests, the batch size in flight"
            + (
                f", answer lengths {args.max_tokens} -/+ {args.sustained_spread:.0%}"
                if args.sustained_spread
                else ""
            )
            + "): tok/s (τ) and ratio to off"
        )
        print("\n".join(steady_load_table(rows)))
        print("\nThe same runs' steady windows (first finished request to last admitted prompt):")
        print("\n".join(steady_load_table(rows, "_steady")))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "date": date.today().isoformat(),
                    "machine": platform.platform(),
                    "device": device,
                    "cpu_count": torch.get_num_threads(),
                    "max_tokens": args.max_tokens,
                    "sps_table": args.sps_table,
                    "block_size": args.block_size,
                    "draft_vocab_size": args.draft_vocab_size,
                    "default_mode": args.default_mode,
                    "repeats": args.repeats,
                    "prompts": args.prompts or "built in",
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
