"""Engine configurations side by side in one process, timed in alternation: tokens/s of each, its ratio
to the first's, tokens a step, and how many greedy outputs equal the first engine's.

    python benchmarks/side_by_side.py --device cpu --engine plain:spec_mode=off --engine default: \
        --engine no-lookup:prompt_lookup=false --prompts fresh --max-tokens 96 --rounds 2

Each `--engine NAME:FIELD=VALUE,...` is an `EngineConfig` with those fields changed (values read as the
field's type). The engines are built once; each round runs every engine over the prompt set, `--batch`
prompts at a time (1: one question at a time), in turn and in an order rotated round by round
(`e2e._time_engines`), so a slow spell of the host falls on all of them; tokens/s are medians over
rounds, tokens a step and outputs the first round's. Prompt sets: `bench` (`dspark-client bench`'s
questions), `fresh` (24 everyday questions written for session 33's comparison, never trained on),
`eval` (four a domain of `training/prompts_eval.jsonl`, held out by source, past the first eight of
each), or a file as `dspark-client bench --prompts` reads it (a .jsonl of {"prompt": ...}, or one a
line). Prompts are chat-formatted as the training prompts are.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from pathlib import Path

from e2e import _prompt_ids, _time_engines, bench_config, identical_share

from dspark import LLM, EngineConfig
from dspark_client.prompts import PROMPTS, read_prompts

ROOT = Path(__file__).resolve().parents[1]
FRESH = ROOT / "benchmarks/results/cpu-2026-12-04-s33/fresh_everyday_24.jsonl"
EVAL = ROOT / "training/prompts_eval.jsonl"


def parse_engine(spec: str) -> tuple[str, dict[str, object]]:
    """`NAME:FIELD=VALUE,...` -> (NAME, {FIELD: VALUE}) with each value read as its field's type."""
    name, _, fields = spec.partition(":")
    types = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    changes: dict[str, object] = {}
    for item in filter(None, fields.split(",")):
        key, _, text = item.partition("=")
        kind = types.get(key)
        if kind is None:
            raise SystemExit(f"--engine {spec}: EngineConfig has no field {key!r}")
        if kind in (bool, "bool"):
            changes[key] = text.lower() in ("1", "true", "yes", "on")
        elif kind in (int, "int"):
            changes[key] = int(text)
        elif kind in (float, "float"):
            changes[key] = float(text)
        else:
            changes[key] = text
    return name, changes


def prompt_set(name: str) -> list[str]:
    """The user texts of a named prompt set or a file (`dspark_client.prompts.read_prompts`)."""
    if name == "bench":
        return list(PROMPTS)
    if name == "fresh":
        return read_prompts(FRESH)
    if name == "eval":
        by_domain: dict[str, list[str]] = collections.defaultdict(list)
        for line in EVAL.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                by_domain[record["domain"]].append(record["prompt"])
        return [p for domain in sorted(by_domain) for p in by_domain[domain][8:12]]
    return read_prompts(name)


def main(argv: list[str] | None = None) -> None:
    """Build the engines, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="NAME:FIELD=VALUE,... (repeat)")
    parser.add_argument("--model", default="", help="target directory (default: the embedded SmolLM2)")
    parser.add_argument("--draft-model", default="", help="drafter directory (default: the shipped one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", default="bench", help="bench, fresh, eval or a JSON lines file")
    parser.add_argument("--batch", type=int, default=1, help="prompts run at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    specs = [parse_engine(spec) for spec in args.engine]
    texts = prompt_set(args.prompts)
    if len(texts) % args.batch:
        raise SystemExit(f"--batch {args.batch}: the {len(texts)} prompts do not split into whole batches")
    engines = {
        # An engine's own draft_model (e.g. two drafters side by side) wins over --draft-model.
        name: LLM(
            bench_config(
                args.model, changes.pop("draft_model", args.draft_model), args.device, args.batch, **changes
            )
        )
        for name, changes in specs
    }
    first = next(iter(engines))
    ids = _prompt_ids(engines[first], len(texts), texts)
    # The batches run one after another in each timed run, engines in rotated order round by round.
    results = _time_engines(engines, ids, args.max_tokens, None, args.rounds, len(ids) // args.batch)
    print(
        f"{args.prompts}: {len(ids)} prompts, batch {args.batch}, {args.max_tokens} greedy tokens, "
        f"{args.rounds} rounds, device {args.device}"
    )
    base, reference, _ = results[first]
    for name, (rate, tokens, stats) in results.items():
        same = round(identical_share(reference, tokens) * len(ids))
        print(
            f"{name:24s} {rate:7.1f} tok/s {rate / base:.3f}x {first}  "
            f"{stats['mean_committed_per_step']:.2f} tokens a step  identical {same}/{len(ids)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
