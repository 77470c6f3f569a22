"""Session 30, issue 19: where the shipped drafter's first draft misses, on the bench's everyday prompts
against the held-out chat prompts (CPU, fp32, blocks of 7 drafted, greedy, the chat template).

For every drafted block, draft 1 is compared with the token the target committed there; the target's
token is put in a class by its text (a word start, a word's continuation, punctuation, a newline or
other whitespace, a digit, markdown) and the table gives, per class, how often it came and how often
draft 1 matched it.

    .venv/bin/python benchmarks/results/cpu-2026-12-04-s30/first_draft_misses.py [PER_DOMAIN [MAX_TOKENS]]

PER_DOMAIN held-out prompts of each domain (default 8, chat only when 8), MAX_TOKENS a answer (default 96).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client"))
from bench import PROMPTS  # noqa: E402

from dspark import LLM, EngineConfig, SamplingParams  # noqa: E402
from dspark.training.acceptance import RecordingProposer  # noqa: E402
from dspark.training.data import encode_prompt  # noqa: E402


def token_class(text: str) -> str:
    """The class of a token by its text."""
    if "\n" in text:
        return "newline"
    stripped = text.strip()
    if not stripped:
        return "space"
    if stripped[0] in "*#-`>|":
        return "markdown"
    if stripped[0].isdigit():
        return "digit"
    if not stripped[0].isalnum():
        return "punctuation"
    return "word start" if text[0] == " " else "word continuation"


def drafted_blocks(llm: LLM, prompts: list[list[dict[str, str]]], max_tokens: int) -> Iterator[tuple]:
    """(block, its request's prompt and answer tokens) for every block drafted while answering the
    prompts greedily, whose first draft's position the answer reaches."""
    recorder = llm.engine.proposer
    recorder.blocks.clear()
    ids = [encode_prompt(llm.tokenizer, p) for p in prompts]
    outputs = llm.generate(params=SamplingParams(max_tokens=max_tokens), prompt_token_ids=ids)
    committed = {o.request_id: list(ids[i]) + list(o.token_ids) for i, o in enumerate(outputs)}
    for block in recorder.blocks:
        tokens = committed[block.request_id]
        if block.num_tokens < len(tokens):
            yield block, tokens


def measure(llm: LLM, prompts: list[list[dict[str, str]]], max_tokens: int) -> collections.Counter:
    """(class, matched) counts of draft 1 over every block of the prompts' greedy answers."""
    counts: collections.Counter = collections.Counter()
    for block, tokens in drafted_blocks(llm, prompts, max_tokens):
        target = tokens[block.num_tokens]
        kind = token_class(llm.tokenizer.decode([target]))
        counts[(kind, block.tokens[0] == target)] += 1
    return counts


def table(name: str, counts: collections.Counter) -> str:
    kinds = sorted({k for k, _ in counts}, key=lambda k: -(counts[(k, True)] + counts[(k, False)]))
    total = sum(counts.values())
    matched = sum(v for (_, m), v in counts.items() if m)
    lines = [
        f"### {name}: {total} blocks, draft 1 matched {matched / total:.1%}",
        "",
        "| target token | share of blocks | draft 1 matched |",
        "|---|---:|---:|",
    ]
    for kind in kinds:
        n = counts[(kind, True)] + counts[(kind, False)]
        lines.append(f"| {kind} | {n / total:.1%} | {counts[(kind, True)] / n:.1%} |")
    return "\n".join(lines)


def main() -> None:
    per_domain = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    domains = ("chat",) if per_domain == 8 else ("chat", "code", "prose", "math")
    config = EngineConfig(device="cpu", dtype="float32", spec_mode="static", adaptive_speculation=False)
    llm = LLM(config)
    llm.engine.proposer = RecordingProposer(llm.engine.proposer, llm.engine.limits.block_size)
    bench = [[{"role": "user", "content": p}] for p in PROMPTS]
    held: dict[str, list] = {d: [] for d in domains}
    for line in (ROOT / "training" / "prompts_eval.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["domain"] in held and len(held[record["domain"]]) < per_domain:
            conversation = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
            held[record["domain"]].append(conversation)
    print(table("the bench's 8 everyday prompts", measure(llm, bench, max_tokens)))
    for domain, prompts in held.items():
        print()
        print(table(f"{len(prompts)} held-out {domain} prompts", measure(llm, prompts, max_tokens)))


if __name__ == "__main__":
    main()
