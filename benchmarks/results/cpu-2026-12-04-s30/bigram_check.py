"""Session 30, issue 19: is the token after the anchor predictable from the anchor alone, where the
drafter's first draft misses it? A count bigram (anchor -> the target's next token) built from the
target's own greedy answers to 256 training prompts, checked against the first drafts of
`first_draft_misses.py` on 16 held-out chat prompts and the bench's 8 questions (never in the table).

    .venv/bin/python benchmarks/results/cpu-2026-12-04-s30/bigram_check.py
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_draft_misses import PROMPTS, ROOT, drafted_blocks, token_class  # noqa: E402

from dspark import LLM, EngineConfig, SamplingParams  # noqa: E402
from dspark.training.acceptance import RecordingProposer  # noqa: E402
from dspark.training.data import encode_prompt  # noqa: E402


def conversations(path: Path, domain: str | None, count: int, stride: int = 1) -> list:
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        record = json.loads(line)
        if (domain is None or record["domain"] == domain) and i % stride == 0:
            out.append(record.get("messages") or [{"role": "user", "content": record["prompt"]}])
        if len(out) == count:
            break
    return out


def main() -> None:
    config = EngineConfig(device="cpu", dtype="float32", spec_mode="static", adaptive_speculation=False)
    llm = LLM(config)
    llm.engine.proposer = RecordingProposer(llm.engine.proposer, llm.engine.limits.block_size)
    params = SamplingParams(max_tokens=128)
    # The table: the target's answers to training prompts (every 100th line: all domains).
    train = conversations(ROOT / "training" / "prompts_train.jsonl", None, 256, stride=100)
    follows: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for start in range(0, len(train), 32):
        ids = [encode_prompt(llm.tokenizer, c) for c in train[start : start + 32]]
        for prompt, out in zip(ids, llm.generate(params=params, prompt_token_ids=ids), strict=True):
            answer = prompt[-1:] + list(out.token_ids)
            for a, b in zip(answer, answer[1:], strict=False):
                follows[a][b] += 1
    print(f"bigram table: {len(follows)} anchors from {len(train)} answers")
    sets = {
        "the bench's 8 questions": [[{"role": "user", "content": p}] for p in PROMPTS],
        "16 held-out chat prompts": conversations(ROOT / "training" / "prompts_eval.jsonl", "chat", 16),
    }
    for name, prompts in sets.items():
        tally: collections.Counter = collections.Counter()
        for block, tokens in drafted_blocks(llm, prompts, 160):
            anchor, target = tokens[block.num_tokens - 1], tokens[block.num_tokens]
            kind = token_class(llm.tokenizer.decode([target]))
            seen = follows.get(anchor)
            guess = seen.most_common(1)[0][0] if seen else None
            tally[(kind, "n")] += 1
            tally[(kind, "draft")] += block.tokens[0] == target
            tally[(kind, "bigram")] += guess == target
            tally[(kind, "known")] += seen is not None
            tally[(kind, "either")] += block.tokens[0] == target or guess == target
        print(f"\n### {name}\n")
        print("| target token | blocks | anchor in table | draft 1 | bigram | either |")
        print("|---|---:|---:|---:|---:|---:|")
        for kind in sorted({k for k, _ in tally}, key=lambda k: -tally[(k, "n")]):
            n = tally[(kind, "n")]
            cells = [f"{tally[(kind, c)] / n:.1%}" for c in ("known", "draft", "bigram", "either")]
            print(f"| {kind} | {n} | " + " | ".join(cells) + " |")
        n = sum(tally[(k, "n")] for k, _ in tally if _ == "n")
        cells = [
            f"{sum(tally[(k, c)] for k, x in tally if x == 'n') / n:.1%}"
            for c in ("known", "draft", "bigram", "either")
        ]
        print(f"| all | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
