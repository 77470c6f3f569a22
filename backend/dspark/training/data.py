"""Self-distillation data: prompts, the target's own responses to them, and training batches of anchors.

The drafter learns to predict what the target itself writes, so the data is the target's answers to a
prompt set under its own chat template, stored as token ids (JSON lines, one sequence a line).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dspark.runner.models.llama import CausalLM
from dspark.sampling_params import SamplingParams
from dspark.tokenizer import Tokenizer
from dspark.training.generate import generate_batch

if TYPE_CHECKING:
    from dspark.llm import LLM


@dataclass
class Prompt:
    """One prompt of a prompt set (training/prompts_*.jsonl)."""

    id: str
    domain: str
    prompt: str
    source: str = ""
    # A multi-turn prompt's whole conversation (user and assistant turns, a user turn last); `prompt` is
    # then its last user turn.
    messages: list[dict[str, str]] | None = None
    # The unit the prompt set holds out whole (its source document, file, word); the id when none is given.
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or self.id

    @property
    def conversation(self) -> list[dict[str, str]]:
        """The chat messages the prompt stands for: its conversation, or `prompt` as one user turn."""
        return self.messages or [{"role": "user", "content": self.prompt}]


@dataclass
class DistillRecord:
    """The target's response to one prompt: prompt_ids then response_ids (EOS included when produced)."""

    id: str
    domain: str
    temperature: float
    prompt_ids: list[int]
    response_ids: list[int]
    # The prompt's source (document, module, word list), carried into shards for provenance.
    source: str = ""
    # The prompt's key (`Prompt.key`: the unit held out whole); the id when none is known.
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or self.id

    @property
    def token_ids(self) -> list[int]:
        """Prompt and response as one sequence."""
        return self.prompt_ids + self.response_ids


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSON-lines file with keys id, domain, prompt (and source, messages, key; other keys,
    such as the prompt set's kind, are ignored)."""
    names = {f.name for f in fields(Prompt)}
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(**{k: v for k, v in row.items() if k in names}) for row in rows]


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of `prompt`, a user message's text or a whole conversation (a user turn last), under the
    model's chat template, exactly as `dspark generate --chat` and the evaluation send it; without a
    template, the turns' texts joined by blank lines."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not tokenizer.chat_template:
        return tokenizer.encode("\n\n".join(m["content"] for m in messages))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def write_records(path: str | Path, records: Sequence[DistillRecord]) -> None:
    """Write records as JSON lines."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")


def read_records(path: str | Path) -> list[DistillRecord]:
    """Read records written by `write_records`."""
    with open(path, encoding="utf-8") as f:
        return [DistillRecord(**json.loads(line)) for line in f if line.strip()]


def distill(
    model: CausalLM,
    prompts: Sequence[tuple[str, str, list[int]]],
    temperatures: Sequence[float],
    eos_token_ids: Sequence[int],
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    max_seconds: float = 0.0,
) -> list[DistillRecord]:
    """The target's responses to `prompts` (id, domain, prompt ids), each at its own temperature, in
    padded batches over a dense KV cache.

    Prompts are batched by length so little of a batch is padding. With `max_seconds`, no new batch
    starts after that much time, and the prompts left unanswered are dropped.
    """
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)

    def answer(rows: list[int]) -> list[list[int]]:
        ids, temps = [prompts[i][2] for i in rows], [temperatures[i] for i in rows]
        return generate_batch(model, ids, max_new_tokens, temps, eos_token_ids, generator)

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][2]))
    return _answer_in_batches(prompts, temperatures, order, batch_size, max_seconds, answer)


def distill_with_engine(
    llm: LLM,
    prompts: Sequence[tuple[str, str, list[int]]],
    temperatures: Sequence[float],
    max_new_tokens: int,
    chunk_size: int,
    seed: int,
    max_seconds: float = 0.0,
) -> list[DistillRecord]:
    """`distill` through the serving engine (paged KV cache, continuous batching, CUDA graphs on a
    GPU), which answers faster than the dense batches: the same responses, greedy or sampled from the
    same distribution (each sampled request with its own seed).

    Prompts go to the engine `chunk_size` at a time; with `max_seconds`, no chunk starts after that
    much time, and the prompts left unanswered are dropped. llm: a plain-decoding engine of the target.
    """
    rng = random.Random(seed)
    seeds = [rng.randrange(2**31) for _ in prompts]

    def answer(rows: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=max_new_tokens, temperature=float(temperatures[i]), seed=seeds[i])
            for i in rows
        ]
        outs = llm.generate(params=params, prompt_token_ids=[prompts[i][2] for i in rows])
        return [list(out.token_ids) for out in outs]

    order = list(range(len(prompts)))
    return _answer_in_batches(prompts, temperatures, order, chunk_size, max_seconds, answer)


def _answer_in_batches(
    prompts: Sequence[tuple[str, str, list[int]]],
    temperatures: Sequence[float],
    order: list[int],
    batch_size: int,
    max_seconds: float,
    answer: Callable[[list[int]], list[list[int]]],
) -> list[DistillRecord]:
    """Records of the prompts `answer` gives responses to, `batch_size` of `order` at a time (no batch
    starts after `max_seconds`, 0: none), in the prompts' order; progress on stderr."""
    records: list[DistillRecord | None] = [None] * len(prompts)
    start, done_tokens = time.perf_counter(), 0
    for first in range(0, len(order), batch_size):
        if max_seconds and time.perf_counter() - start > max_seconds:
            print(f"distill: time is up after {first} prompts", file=sys.stderr, flush=True)
            break
        rows = order[first : first + batch_size]
        for i, response in zip(rows, answer(rows), strict=True):
            pid, domain, ids = prompts[i]
            records[i] = DistillRecord(pid, domain, float(temperatures[i]), list(ids), response)
            done_tokens += len(response)
        elapsed = time.perf_counter() - start
        print(
            f"distill: {first + len(rows)}/{len(order)} answers, {done_tokens} tokens, "
            f"{done_tokens / max(elapsed, 1e-9):.0f} tokens/s",
            file=sys.stderr,
            flush=True,
        )
    return [r for r in records if r is not None]


@dataclass
class TrainBatch:
    """Sequences and the anchors drafted from them.

    token_ids: [B, T] right-padded; lengths: [B]; anchors: [B, A] anchor positions (a block covers
    anchor .. anchor + block_size - 1); anchor_valid: [B, A] False for filler anchors of short sequences.
    """

    token_ids: torch.Tensor
    lengths: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor

    def to(self, device: torch.device | str) -> TrainBatch:
        """The batch on `device`."""
        return TrainBatch(
            *(t.to(device) for t in (self.token_ids, self.lengths, self.anchors, self.anchor_valid))
        )


class AnchorSampler:
    """Batches of sequences with random anchors. Anchors are drawn uniformly among the response positions
    followed by at least `min_following` tokens (inference anchors only after the prompt): training needs
    one next token, calibration a whole block."""

    def __init__(
        self,
        records: Sequence[DistillRecord],
        batch_size: int,
        anchors_per_sequence: int,
        max_length: int,
        seed: int,
        min_following: int = 1,
    ) -> None:
        # (tokens, prompt length, decoding temperature) of every sequence long enough for one anchor.
        self.sequences = [
            (r.token_ids[:max_length], len(r.prompt_ids), r.temperature)
            for r in records
            if len(r.prompt_ids) + min_following < min(len(r.token_ids), max_length)
        ]
        if not self.sequences:
            raise ValueError(f"data: no sequence has a response of more than {min_following} tokens")
        self.batch_size = batch_size
        self.anchors_per_sequence = anchors_per_sequence
        self.min_following = min_following
        self.rng = random.Random(seed)
        self._order: list[int] = []

    def state(self) -> dict:
        """What a resumed run needs to continue the same stream."""
        return {"rng": self.rng.getstate(), "order": list(self._order)}

    def load_state(self, state: dict) -> None:
        """Continue from `state()`."""
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._order = list(state["order"])

    def __iter__(self) -> Iterator[TrainBatch]:
        return self

    def __next__(self) -> TrainBatch:
        """The next random batch; sequences are drawn without replacement within an epoch."""
        return self.batch([self._next_index() for _ in range(self.batch_size)])

    def one_pass(self) -> Iterator[tuple[list[int], TrainBatch]]:
        """Every sequence once, in order: (sequence indices, batch)."""
        for first in range(0, len(self.sequences), self.batch_size):
            picks = list(range(first, min(first + self.batch_size, len(self.sequences))))
            yield picks, self.batch(picks)

    def batch(self, picks: Sequence[int]) -> TrainBatch:
        """A batch of the sequences `picks`, with fresh random anchors."""
        longest = max(len(self.sequences[i][0]) for i in picks)
        count = self.anchors_per_sequence
        ids = torch.zeros(len(picks), longest, dtype=torch.long)
        lengths = torch.zeros(len(picks), dtype=torch.long)
        anchors = torch.zeros(len(picks), count, dtype=torch.long)
        valid = torch.zeros(len(picks), count, dtype=torch.bool)
        for row, i in enumerate(picks):
            tokens, prompt_len, _ = self.sequences[i]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            lengths[row] = len(tokens)
            candidates = range(prompt_len, len(tokens) - self.min_following)
            chosen = sorted(self.rng.sample(candidates, min(count, len(candidates))))
            anchors[row, : len(chosen)] = torch.tensor(chosen)
            anchors[row, len(chosen) :] = prompt_len
            valid[row, : len(chosen)] = True
        return TrainBatch(ids, lengths, anchors, valid)

    def _next_index(self) -> int:
        if not self._order:
            self._order = list(range(len(self.sequences)))
            self.rng.shuffle(self._order)
        return self._order.pop()
