"""Acceptance evaluation through the real engine: tokens committed per step, per-position acceptance,
and how well the confidences predicted survival, by domain, mode and temperature.

Calibration is measured from the drafts the engine's own proposer made (a recording wrapper keeps each
block and its confidences) against the committed output. A draft survives while it equals the committed
token at its position: for greedy decoding that is exactly "would be accepted if verified", at every
position; for sampling it is exact where the draft was verified (a rejected draft is never resampled),
so sampled calibration is measured in static mode only, where every draft within the cap is verified.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from dspark.config import EngineConfig
from dspark.outputs import CompletionOutput, SpecStats
from dspark.sampling_params import SamplingParams
from dspark.sequence import Sequence
from dspark.spec.drafts import Drafts
from dspark.spec.proposer import Proposer
from dspark.training.calibration import calibration_error


@dataclass
class DraftedBlock:
    """One drafted block: the request, its length when drafted, drafts verifiable in static mode,
    the drafts and their confidences."""

    request_id: str
    num_tokens: int
    verify_cap: int
    tokens: list[int]
    confidences: list[float]


class RecordingProposer:
    """A proposer that delegates to another and keeps every block it drafts."""

    def __init__(self, inner: Proposer, block_size: int) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.target_layer_ids = inner.target_layer_ids
        self.engine_block_size = block_size
        self.blocks: list[DraftedBlock] = []

    def propose(self, seqs: Seq[Sequence], length: int | None = None) -> Drafts:
        """Draft through the inner proposer and record the blocks."""
        proposal = self.inner.propose(seqs, length)
        for r, seq in enumerate(seqs):
            self.blocks.append(
                DraftedBlock(
                    seq.request_id,
                    len(seq.token_ids),
                    max(min(self.engine_block_size, seq.remaining_tokens - 1), 0),
                    proposal.tokens[r, : self.engine_block_size].tolist(),
                    proposal.confidences[r, : self.engine_block_size].tolist(),
                )
            )
        return proposal

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Delegate KV injection."""
        self.inner.inject(features, positions, slots)


def block_survival(
    block: DraftedBlock, committed: list[int], verified_only: bool
) -> tuple[list[float], list[float]]:
    """(predicted survival, measured survival) at the block's positions whose outcome is known.

    committed: the request's prompt and output tokens. Draft j predicts committed[num_tokens - 1 + j].
    """
    predicted, measured = [], []
    survival, prod = 1.0, 1.0
    limit = block.verify_cap if verified_only else len(block.tokens)
    for j, (token, confidence) in enumerate(zip(block.tokens, block.confidences, strict=True)):
        prod *= confidence
        index = block.num_tokens + j
        if survival > 0 and (j >= limit or index >= len(committed)):
            break  # unverified or past the end, and not already known to have failed
        if survival > 0:
            survival = float(token == committed[index])
        predicted.append(prod)
        measured.append(survival)
    return predicted, measured


@dataclass
class RunTally:
    """What one run (or several, pooled) measured: speculation counters, calibration pairs, speed."""

    stats: SpecStats = field(default_factory=SpecStats)
    predicted: list[float] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)
    seconds: float = 0.0
    output_tokens: int = 0
    num_prompts: int = 0

    def add(self, other: RunTally) -> None:
        """Pool another tally into this one."""
        self.stats.merge(other.stats)
        self.predicted += other.predicted
        self.measured += other.measured
        self.seconds += other.seconds
        self.output_tokens += other.output_tokens
        self.num_prompts += other.num_prompts

    def row(self, domain: str, mode: str, temperature: float) -> dict:
        """One result row: tau, acceptance by position, calibration error, speed."""
        stats, pairs = self.stats, len(self.predicted)
        accept = [
            round(a / v, 4) if v else None
            for a, v in zip(stats.accepted_per_position, stats.verified_per_position, strict=True)
        ]
        ece = calibration_error(torch.tensor(self.predicted), torch.tensor(self.measured)) if pairs else None
        return {
            "domain": domain,
            "mode": mode,
            "temperature": temperature,
            "num_prompts": self.num_prompts,
            "steps": stats.steps,
            "tau": round(stats.mean_committed_per_step, 4),
            "acceptance_per_position": accept,
            "verified_per_step": round(stats.verified_tokens / stats.steps, 4) if stats.steps else 0.0,
            "ece": None if ece is None else round(ece, 5),
            "ece_pairs": pairs,
            "mean_predicted_survival": round(sum(self.predicted) / pairs, 4) if pairs else None,
            "mean_measured_survival": round(sum(self.measured) / pairs, 4) if pairs else None,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_s": round(self.output_tokens / self.seconds, 1) if self.seconds > 0 else None,
        }


def tally_run(
    outputs: list[CompletionOutput], blocks: list[DraftedBlock], calibrated: str, seconds: float
) -> RunTally:
    """Merge a run's counters and pair each recorded block's confidences with its measured survival.

    calibrated: "all" (greedy: every known position), "verified" (sampled, static) or "none".
    """
    tally = RunTally(seconds=seconds, num_prompts=len(outputs))
    committed = {}
    for out in outputs:
        tally.stats.merge(out.spec_stats)
        tally.output_tokens += len(out.token_ids)
        committed[out.request_id] = list(out.prompt_token_ids) + list(out.token_ids)
    if calibrated != "none":
        for block in blocks:
            predicted, measured = block_survival(block, committed[block.request_id], calibrated == "verified")
            tally.predicted += predicted
            tally.measured += measured
    return tally


def evaluate_acceptance(
    config: EngineConfig,
    prompts: dict[str, list[list[dict[str, str]]]],
    modes: Seq[str],
    temperatures: Seq[float],
    max_tokens: int,
    seed: int,
    prompt_form: str = "chat",
) -> Iterator[dict]:
    """Run every (temperature, mode, domain) through `dspark.LLM`, yielding each result row as it is
    measured, and an "all" row per (mode, temperature) pooling the domains. Temperatures are the outer
    loop, so a run cut short still has every mode at the first temperature (greedy, as listed first).
    The prompts are sent in `prompt_form` (`dspark.training.records.PROMPT_FORMS`)."""
    from dspark.llm import LLM
    from dspark.training.data import encode_prompt

    engines: dict[str, tuple[LLM, RecordingProposer]] = {}

    def engine(mode: str) -> tuple[LLM, RecordingProposer]:
        if mode not in engines:
            # Every step drafts: acceptance is measured, not whether speculation pays on this machine.
            llm = LLM(config.replace(spec_mode=mode, adaptive_speculation=False))
            if llm.engine.proposer is None:
                raise ValueError("eval: speculation is off; give a static or compact mode")
            # The engine's own proposer keeps drafting; the wrapper only watches what it returns.
            llm.engine.proposer = RecordingProposer(llm.engine.proposer, llm.engine.limits.block_size)
            engines[mode] = (llm, llm.engine.proposer)
        return engines[mode]

    try:
        for temperature in temperatures:
            for mode in modes:
                llm, recorder = engine(mode)
                encoded = {
                    d: [encode_prompt(llm.tokenizer, p, prompt_form) for p in texts]
                    for d, texts in prompts.items()
                }
                pooled = RunTally()
                # Sampled drafts' confidences can be judged where every draft is verified whatever its
                # confidence: a policy whose verify lengths are fixed before drafting.
                every_draft = llm.engine.policy.drafts_in_step
                calibrated = "all" if temperature == 0 else ("verified" if every_draft else "none")
                for domain, ids in encoded.items():
                    recorder.blocks.clear()
                    params = [
                        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
                        for i in range(len(ids))
                    ]
                    start = time.perf_counter()
                    outputs = llm.generate(params=params, prompt_token_ids=ids)
                    tally = tally_run(outputs, recorder.blocks, calibrated, time.perf_counter() - start)
                    yield tally.row(domain, mode, temperature)
                    pooled.add(tally)
                yield pooled.row("all", mode, temperature)
    finally:
        for llm, _ in engines.values():
            llm.engine.close()
        engines.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def markdown_table(rows: list[dict], block_size: int) -> str:
    """The rows as a markdown table."""
    head = [
        "domain",
        "mode",
        "T",
        "tau",
        *[f"acc@{k + 1}" for k in range(block_size)],
        "verified/step",
        "ECE",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        accept = list(row["acceptance_per_position"]) + [None] * block_size
        cells = [
            row["domain"],
            row["mode"],
            f"{row['temperature']:g}",
            f"{row['tau']:.3f}",
            *["–" if a is None else f"{a:.3f}" for a in accept[:block_size]],
            f"{row['verified_per_step']:.2f}",
            "–" if row["ece"] is None else f"{row['ece']:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
