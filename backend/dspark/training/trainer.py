"""The training loop: target features on the fly, the drafter's packed block forward, the DSpark loss.

bf16 autocast on CUDA (fp32 master weights), AdamW with warmup and cosine decay, resumable state,
a progress line with loss and throughput. The schedule runs over `steps`, or over `max_minutes` of
wall-clock when that comes first, so a run fits a fixed machine budget on any GPU.

A series of runs continues one drafter by warm restarts: each run starts from the last run's weights
(`trainable_from_checkpoint`) with fresh AdamW moments, re-warms over `warmup_steps` and decays over its
own schedule, at a peak the caller lowers run by run; `run_index` is logged and sets the data order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspark.runner.models.hf_config import ModelConfig
from dspark.runner.models.llama import CausalLM
from dspark.spec.draft_checkpoint import create_random_drafter, fresh_draft_config, load_drafter
from dspark.spec.draft_config import DraftConfig
from dspark.spec.drafter import Drafter
from dspark.training.data import AnchorSampler, DistillRecord, TrainBatch
from dspark.training.dense import target_pass
from dspark.training.draft_forward import block_hidden
from dspark.training.losses import BlockTargets, LossParts, LossWeights, dspark_loss

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass
class TrainConfig:
    """Optimisation settings of one run (saved with its state, so a resume continues the same run)."""

    steps: int = 2000
    max_minutes: float = 0.0
    batch_size: int = 32
    anchors_per_sequence: int = 32
    max_length: int = 1024
    # Batches per pool of sequences sorted by length before batching (`AnchorSampler`; 1: random
    # batches, about half padding on the distilled answers).
    length_group: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # Which run of a series continuing one drafter this is: logged, and it sets the data order.
    run_index: int = 0
    log_every: int = 20
    save_every: int = 250
    weights: LossWeights = field(default_factory=LossWeights)


def new_drafter(
    target: ModelConfig,
    block_size: int,
    num_layers: int,
    markov_rank: int,
    num_target_features: int,
    seed: int,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    anchor_feature: bool = False,
) -> Drafter:
    """A fresh trainable drafter: small random weights, the Markov correction and confidence start at zero.

    target_layer_ids: the target layers it reads (None: `num_target_features` of them, evenly spread)."""
    cfg = fresh_draft_config(target, block_size, num_layers, markov_rank, mask_token_id, num_target_features)
    if target_layer_ids is not None:
        if not target_layer_ids or not all(0 <= i < target.num_layers for i in target_layer_ids):
            raise ValueError(
                f"target_layer_ids: need ids in [0, {target.num_layers}), got {target_layer_ids}"
            )
        cfg = dataclasses.replace(cfg, target_layer_ids=list(target_layer_ids))
    cfg = dataclasses.replace(cfg, anchor_feature=anchor_feature)
    drafter = create_random_drafter(cfg, seed=seed, std=0.02)
    # W2 = 0 makes the Markov head start as a no-op (the low-rank update grows from there); a zero
    # confidence head starts every confidence at 1/2.
    if drafter.markov_w2 is not None:
        drafter.markov_w2.weight.data.zero_()
    if drafter.confidence is not None:
        drafter.confidence.weight.data.zero_()
        drafter.confidence.bias.data.zero_()
    if drafter.anchor_fc is not None:  # starts as a drafter without it
        drafter.anchor_fc.weight.data.zero_()
    return drafter.train().requires_grad_(True)


def next_run_index(log_path: str | Path | None) -> int:
    """The run index after the last one in a drafter's train_log.jsonl: 0 without a log to continue, 1
    for a drafter with no log (it was trained once before logs travelled with drafters)."""
    if log_path is None:
        return 0
    path = Path(log_path)
    if not path.is_file():
        return 1
    runs = [json.loads(line).get("run", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(runs, default=-1) + 1


def trainable_from_checkpoint(draft_dir: str | Path, block_size: int) -> Drafter:
    """A drafter to train further on blocks of `block_size` positions, from a DSpark draft checkpoint
    (no weight depends on the block's length): fp32 weights, confidence temperatures 1 as a fresh
    drafter's are (training ignores them; calibration refits them)."""
    drafter = load_drafter(draft_dir, torch.float32, "cpu")
    drafter.config = dataclasses.replace(
        drafter.config, block_size=block_size, confidence_temperatures=[1.0] * block_size
    )
    drafter.confidence_temperatures = torch.ones(block_size)
    return drafter.train().requires_grad_(True)


@torch.no_grad()
def deepened(drafter: Drafter, num_layers: int) -> Drafter:
    """The same drafter with `num_layers` layers, computing exactly what it did: each new layer copies
    the last one with its attention and MLP output projections zeroed, so it adds nothing to the
    residual stream until training moves them (a warm start for a deeper drafter)."""
    have = drafter.config.num_hidden_layers
    if num_layers < have:
        raise ValueError(f"num_layers: {num_layers} is fewer than the drafter's {have} layers")
    if num_layers == have:
        return drafter
    grown, missing = _grown(drafter, num_hidden_layers=num_layers)
    assert all(name.startswith("layers.") for name in missing), missing
    last = drafter.layers[-1].state_dict()
    for layer in grown.layers[have:]:
        layer.load_state_dict(last)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return grown.train().requires_grad_(True)


@torch.no_grad()
def with_anchor_feature(drafter: Drafter) -> Drafter:
    """The same drafter with an anchor feature (`DraftConfig.anchor_feature`) whose projection starts at
    zero, computing exactly what it did until training moves it (a warm start; a drafter that has one
    comes back as it is)."""
    if drafter.anchor_fc is not None:
        return drafter
    grown, missing = _grown(drafter, anchor_feature=True)
    assert missing == ["anchor_fc.weight"], missing
    grown.anchor_fc.weight.zero_()
    return grown.train().requires_grad_(True)


def _grown(drafter: Drafter, **changes: object) -> tuple[Drafter, list[str]]:
    """A drafter of `drafter`'s config with `changes`, holding its weights (same dtype and device), and
    the names of the parameters it has that `drafter` had not (still to be set)."""
    grown = Drafter(dataclasses.replace(drafter.config, **changes))
    grown.to(dtype=drafter.fc.weight.dtype, device=drafter.fc.weight.device)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected, unexpected
    return grown, missing


@torch.no_grad()
def init_from_target(drafter: Drafter, target: CausalLM) -> None:
    """Start the drafter where the target ends: its layers copy the target's last layers, its final
    norm the target's (calibrated for the shared LM head), and `fc` passes the deepest captured feature
    through to keys/values normalised like the last layer's input.

    A random start makes the tied LM head score the drafter's own input token at ~25x the embedding
    norm, which thousands of steps must first unlearn.
    """

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))

    first_copied = len(target.layers) - len(drafter.layers)
    for index, layer in enumerate(drafter.layers):
        source = dict(target.layers[first_copied + index].named_parameters())
        for name, param in layer.named_parameters():
            if name in source and source[name].shape == param.shape:
                copy(param, source[name])
    copy(drafter.norm.weight, target.norm.weight)
    copy(drafter.hidden_norm.weight, target.layers[-1].input_layernorm.weight)
    hidden = drafter.config.hidden_size
    drafter.fc.weight.mul_(0.1)
    drafter.fc.weight[:, -hidden:] += torch.eye(hidden, device=drafter.fc.weight.device)


def block_targets(
    target: CausalLM,
    batch: TrainBatch,
    block_size: int,
    capture_layers: list[int],
    vocab: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BlockTargets]:
    """Target features of every position [B, T, F] and, per block slot, the training targets; with
    `vocab` (the draft vocabulary's sorted token ids, on the batch's device) the target's logits of those
    tokens only, with the log-sum-exp and argmax over every token (`BlockTargets`)."""
    with torch.no_grad():
        hidden, features = target_pass(target, batch.token_ids, capture_layers)
        b, t = batch.token_ids.shape
        slots = batch.anchors[..., None] + torch.arange(
            block_size, device=batch.anchors.device
        )  # [B, A, block_size]
        valid = (slots + 1 < batch.lengths[:, None, None]) & batch.anchor_valid[..., None]
        slots = slots.clamp(max=t - 2).flatten(1)
        previous = batch.token_ids.gather(1, slots)
        labels = batch.token_ids.gather(1, slots + 1)
        at_slots = hidden.gather(1, slots[..., None].expand(-1, -1, hidden.shape[-1])).flatten(0, 1)
        n = b * batch.anchors.shape[1]
        if vocab is None:
            target_logits = target.compute_logits(at_slots)
            choice, lse = target_logits.argmax(-1), None
        else:
            target_logits, choice, lse = _vocab_logits(target, at_slots, vocab)
            lse = lse.view(n, block_size)
    return features, BlockTargets(
        previous.view(n, block_size),
        labels.view(n, block_size),
        target_logits.view(n, block_size, -1),
        valid.view(n, block_size),
        choice.view(n, block_size),
        vocab,
        lse,
    )


VOCAB_CHUNK_ROWS = 2048  # rows of full-vocabulary target logits alive at once (`_vocab_logits`)


def _vocab_logits(
    target: CausalLM, hidden: torch.Tensor, vocab: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's logits of the draft vocabulary's tokens [rows, K], its argmax [rows] and fp32
    log-sum-exp [rows] over every token, the full-vocabulary logits made a chunk of rows at a time (at
    ~10k block slots a batch they would take gigabytes at once)."""
    picked, choices, lses = [], [], []
    for rows in hidden.split(VOCAB_CHUNK_ROWS):
        logits = target.compute_logits(rows)
        picked.append(logits[:, vocab])
        choices.append(logits.argmax(-1))
        lses.append(torch.logsumexp(logits.float(), dim=-1))
    return torch.cat(picked), torch.cat(choices), torch.cat(lses)


def drafter_loss(
    target: CausalLM,
    drafter: Drafter,
    batch: TrainBatch,
    weights: LossWeights,
    autocast: bool,
    vocab: torch.Tensor | None = None,
) -> LossParts:
    """The DSpark loss of one batch (target pass without gradients, drafter pass with); `autocast` runs
    it in bf16 mixed precision on the batch's device; `vocab`: the draft vocabulary's sorted token ids
    (on that device) the loss is over (None: every token)."""
    cfg = drafter.config
    device_type = batch.token_ids.device.type
    amp = torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        features, targets = block_targets(target, batch, cfg.block_size, list(cfg.target_layer_ids), vocab)
        hidden = block_hidden(
            drafter, target.embed_tokens.weight, features, batch.token_ids, batch.anchors
        ).flatten(0, 1)
        return dspark_loss(drafter, hidden, target.lm_head.weight, targets, weights)


class Trainer:
    """Trains `drafter` on self-distillation records; writes its state and log into `work_dir`. `vocab`:
    the draft vocabulary (sorted token ids) the drafter will be served with, which the loss is over
    (None: every token)."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter,
        records: list[DistillRecord],
        config: TrainConfig,
        work_dir: str | Path,
        device: torch.device,
        vocab: torch.Tensor | None = None,
    ) -> None:
        self.target = target.requires_grad_(False)
        self.drafter = drafter.to(device)
        self.vocab = None if vocab is None else vocab.to(device=device, dtype=torch.int64)
        self.config = config
        self.work_dir = Path(work_dir)
        self.device = device
        self.autocast = device.type == "cuda"
        # Each run of a series draws the data in its own order (run 0 in the seed's).
        self.sampler = AnchorSampler(
            records,
            config.batch_size,
            config.anchors_per_sequence,
            config.max_length,
            config.seed + 7919 * config.run_index,
            length_group=config.length_group,
        )
        decay, keep = [], []
        for name, param in self.drafter.named_parameters():
            (keep if param.ndim < 2 or "norm" in name else decay).append(param)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": keep, "weight_decay": 0.0}],
            lr=config.lr,
            betas=(0.9, 0.95),
            fused=device.type == "cuda",
        )
        self.step = 0
        self.elapsed = 0.0

    def progress(self) -> float:
        """How far through the schedule: steps done, or wall-clock used, whichever is further."""
        by_steps = self.step / max(self.config.steps, 1)
        by_time = self.elapsed / (60.0 * self.config.max_minutes) if self.config.max_minutes > 0 else 0.0
        return min(max(by_steps, by_time), 1.0)

    def learning_rate(self) -> float:
        """Linear warmup over `warmup_steps`, then cosine decay to min_lr_ratio * lr over the progress."""
        cfg = self.config
        warm = min(1.0, (self.step + 1) / max(cfg.warmup_steps, 1))
        cosine = 0.5 * (1.0 + math.cos(math.pi * self.progress()))
        return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)

    def train_step(self) -> LossParts:
        """One optimiser step on the next batch."""
        batch = next(self.sampler).to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        parts = drafter_loss(self.target, self.drafter, batch, self.config.weights, self.autocast, self.vocab)
        self.optimizer.zero_grad(set_to_none=True)
        parts.total.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.step += 1
        return parts

    def run(self) -> Drafter:
        """Train until the schedule ends; resumes from the state in work_dir when there is one."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.load_state()
        cfg = self.config
        log = open(self.work_dir / LOG_FILE, "a", encoding="utf-8")  # noqa: SIM115 - closed below
        window_start, window_tokens, window_seqs = time.perf_counter(), 0, 0
        last = time.perf_counter()
        try:
            while self.progress() < 1.0:
                parts = self.train_step()
                now = time.perf_counter()
                self.elapsed += now - last
                last = now
                window_tokens += cfg.batch_size * cfg.anchors_per_sequence * self.drafter.config.block_size
                window_seqs += cfg.batch_size
                if self.step % cfg.log_every == 0 or self.progress() >= 1.0:
                    seconds = max(now - window_start, 1e-9)
                    entry = self._log_entry(parts, window_tokens / seconds, window_seqs / seconds)
                    log.write(json.dumps(entry) + "\n")
                    log.flush()
                    _print_progress(entry, self.progress(), self.elapsed)
                    window_start, window_tokens, window_seqs = time.perf_counter(), 0, 0
                if self.step % cfg.save_every == 0:
                    self.save_state()
        finally:
            log.close()
        self.save_state()
        return self.drafter.eval()

    def _log_entry(self, parts: LossParts, tokens_per_s: float, seqs_per_s: float) -> dict:
        survival = parts.survival.float().cpu()
        return {
            "run": self.config.run_index,
            "step": self.step,
            "elapsed_s": round(self.elapsed, 1),
            "lr": self.learning_rate(),
            "loss": round(float(parts.total.detach()), 4),
            "ce": round(float(parts.ce), 4),
            "l1": round(float(parts.l1), 4),
            "confidence_bce": round(float(parts.confidence), 4),
            "tau_teacher_forced": round(1.0 + float(survival.sum()), 3),
            "survival": [round(float(s), 3) for s in survival],
            "block_tokens_per_s": round(tokens_per_s, 1),
            "sequences_per_s": round(seqs_per_s, 2),
        }

    def save_state(self) -> None:
        """Write everything a resume needs (atomically: a killed run never leaves half a file)."""
        state = {
            "step": self.step,
            "elapsed": self.elapsed,
            "drafter_config": self.drafter.config.to_dict(),
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state(),
            "train_config": asdict(self.config),
            "vocab": None if self.vocab is None else self.vocab.cpu(),
        }
        self.work_dir.mkdir(parents=True, exist_ok=True)
        path = self.work_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load_state(self) -> None:
        """Continue a run from work_dir's state file, if any (the drafter architecture must match)."""
        path = self.work_dir / STATE_FILE
        if not path.is_file():
            return
        state = torch.load(path, map_location=self.device, weights_only=False)
        if DraftConfig.from_dict(state["drafter_config"]) != self.drafter.config:
            raise ValueError(f"resume: {path} holds a drafter of another architecture")
        saved = state.get("vocab")
        if (saved is None) != (self.vocab is None) or (
            saved is not None and not torch.equal(saved, self.vocab.cpu())
        ):
            raise ValueError(f"resume: {path} was trained over another draft vocabulary")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state(state["sampler"])
        self.step = state["step"]
        self.elapsed = state["elapsed"]
        print(
            f"train: resumed at step {self.step} ({self.elapsed:.0f} s trained)", file=sys.stderr, flush=True
        )


def _print_progress(entry: dict, progress: float, elapsed: float) -> None:
    width = 24
    filled = int(progress * width)
    eta = elapsed / progress - elapsed if progress > 0 else 0.0
    print(
        f"train [{'#' * filled}{'.' * (width - filled)}] {100 * progress:5.1f}% step {entry['step']} "
        f"loss {entry['loss']:.3f} (ce {entry['ce']:.3f} l1 {entry['l1']:.3f} "
        f"conf {entry['confidence_bce']:.3f}) "
        f"tau_tf {entry['tau_teacher_forced']:.2f} lr {entry['lr']:.2e} | "
        f"{entry['block_tokens_per_s'] / 1000:.1f}k block tok/s {entry['sequences_per_s']:.1f} seq/s | "
        f"{_clock(elapsed)} elapsed, eta {_clock(eta)}",
        file=sys.stderr,
        flush=True,
    )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"
