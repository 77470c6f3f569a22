"""The training subcommands of `dspark`: self-prompts, distill-data, train-draft, calibrate-draft,
eval-acceptance, draft-cost, draft-vocab.

`dspark.tools.cli` imports this module only when one of them runs; heavy imports happen inside each command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.config import DEFAULT_TARGET_DIR
from dspark.training.records import PROMPT_FORMS

if TYPE_CHECKING:
    import torch

    from dspark.runner.models.llama import CausalLM
    from dspark.tokenizer import Tokenizer
    from dspark.training.data import DistillRecord, Prompt
    from dspark.training.feed import Deadline

# Seconds a distill-data deadline keeps, besides the last shard's write, for closing the generator and
# the process's exit.
FINISH_RESERVE_S = 2.0


def self_prompts(argv: list[str]) -> int:
    """`dspark self-prompts`: user requests the target writes itself, as a prompt set."""
    parser = argparse.ArgumentParser(
        prog="dspark self-prompts",
        description="Sample user requests from the target under its chat template.",
    )
    _target_args(parser)
    parser.add_argument("--out", required=True, help="the prompt set to write (JSON lines)")
    parser.add_argument("--count", type=int, default=10000, help="distinct requests to keep")
    parser.add_argument("--max-tokens", type=int, default=128, help="longer requests are dropped")
    parser.add_argument("--batch-size", type=int, default=256, help="sequences generated at once")
    parser.add_argument(
        "--max-minutes", type=float, default=0.0, help="stop sampling after this long (0: none)"
    )
    parser.add_argument(
        "--follow-up-share",
        type=float,
        default=0.25,
        help="share of the requests continued into a second turn: the target's answer, then a follow-up",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count: must be >= 1")
    if not 0.0 <= args.follow_up_share <= 1.0:
        parser.error("--follow-up-share: must be in [0, 1]")

    from dspark import LLM, EngineConfig
    from dspark.training.self_prompts import ANSWER_TOKENS, generate_self_prompts, write_prompt_set

    started = time.monotonic()
    # The template's prefix is a few dozen tokens; a follow-up also holds a request and an answer.
    pages = -(-(64 + 2 * args.max_tokens + ANSWER_TOKENS + 1) // EngineConfig.kv_page_size)
    config = EngineConfig(
        model=args.target,
        device=args.device,
        dtype=args.dtype,
        spec_mode="off",
        max_num_seqs=args.batch_size,
        num_kv_pages=args.batch_size * pages + 1,
        seed=args.seed,
    )
    with LLM(config) as llm:
        conversations = generate_self_prompts(
            llm,
            args.count,
            args.seed,
            max_tokens=args.max_tokens,
            batch=4 * args.batch_size,
            seconds=60.0 * args.max_minutes,
            follow_up_share=args.follow_up_share,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    write_prompt_set(args.out, conversations, args.seed)
    turns = sum(len(c) > 1 for c in conversations)
    print(
        f"self-prompts: wrote {len(conversations)} requests ({turns} after an answer) to {args.out} "
        f"in {time.monotonic() - started:.1f} s"
    )
    return 0


def distill_data(argv: list[str]) -> int:
    """`dspark distill-data`: the target's own responses to a prompt set, as token ids."""
    started = time.monotonic()
    parser = argparse.ArgumentParser(
        prog="dspark distill-data", description="Generate self-distillation data with the target."
    )
    _target_args(parser)
    parser.add_argument("--prompts", required=True, help="JSON lines with id, domain, prompt")
    parser.add_argument(
        "--out-dir",
        required=True,
        help="writes the responses as shards NAME-000.npz, NAME-001.npz, ... while generating (each file "
        "complete whenever it is there: a run killed keeps what it wrote)",
    )
    parser.add_argument(
        "--shard-name", default="distill", help="shard file prefix: unique per generation, so shards can pool"
    )
    parser.add_argument(
        "--shard-max-tokens", type=int, default=0, help="stored tokens per shard (0: the default, 4M)"
    )
    parser.add_argument(
        "--checkpoint-seconds",
        type=float,
        default=30.0,
        help="every this many seconds (when new responses came) the shard being filled is rewritten with "
        "all of them: a run killed loses about this much generation at most",
    )
    parser.add_argument("--num-prompts", type=int, default=0, help="use this many prompts (0: all)")
    parser.add_argument(
        "--val-prompts",
        type=int,
        default=64,
        help="held out for calibration: at least this many prompts, whole keys (source documents); in each "
        "domain those whose keys hash lowest until its share (at least one prompt); the same in every run; "
        "answered first, and always, whatever --max-minutes",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    parser.add_argument("--sample-fraction", type=float, default=0.5, help="share answered at temperature 1")
    parser.add_argument(
        "--raw-share",
        type=float,
        default=0.0,
        help="share of the training prompts sent as their text alone, without the chat template, as a "
        "text_input request reaches the server: the target continues them (held-out prompts stay chat)",
    )
    parser.add_argument(
        "--responses-per-prompt",
        type=int,
        default=1,
        help="answers per training prompt: the first greedy or sampled (--sample-fraction), the others "
        "sampled at temperature 1, so each is a different sequence (held-out prompts get one)",
    )
    parser.add_argument(
        "--generator",
        choices=("engine", "dense"),
        default="engine",
        help="engine: the serving engine (continuous batching, paged KV, CUDA graphs); dense: padded "
        "batches over a dense KV cache",
    )
    parser.add_argument("--batch-size", type=int, default=256, help="sequences generated at once")
    parser.add_argument(
        "--phase-answers",
        type=int,
        default=0,
        help="engine: answers per phase of one kind, greedy or sampled (a greedy phase and a sampled one "
        "split twice this by their shares; 0: 16 x --batch-size): kept apart, greedy steps overlap; a run "
        "stopped early is off each kind's share by at most this",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="the command ends within this many minutes of its start, the last shard written (no request "
        "starts that could not end in time, those still running then are dropped); 0: no limit",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.responses_per_prompt < 1:
        parser.error("--responses-per-prompt: must be >= 1")
    if args.phase_answers < 0:
        parser.error("--phase-answers: must be >= 0")
    if not 0.0 <= args.raw_share <= 1.0:
        parser.error("--raw-share: must be in [0, 1]")

    from dspark.tokenizer import Tokenizer
    from dspark.training.data import read_prompts
    from dspark.training.feed import Deadline
    from dspark.training.shards import SHARD_MAX_TOKENS, ShardWriter

    tokenizer = Tokenizer.from_dir(args.target)
    rng = random.Random(args.seed)
    prompts = read_prompts(args.prompts)
    by_id = {p.id: p for p in prompts}
    wanted = args.num_prompts or len(prompts)
    # The held-out prompts do not depend on the seed or the count: every run holds out the same ones,
    # so shards of separate runs pool without one training on another's held-out prompts. They are
    # whole keys, so no training prompt shares a source document with a held-out one, and every domain
    # holds out its share.
    val = min(args.val_prompts, wanted // 2)
    held, held_keys = _held_out_prompts(tokenizer, prompts, val, args.max_prompt_tokens)
    rng.shuffle(prompts)
    rest = [p for p in prompts if p.key not in held_keys]
    # A key may hold more prompts than asked for; the training side keeps its count.
    train_count = wanted - min(len(held), val)
    # Drawn apart from `rng`, so that a seed's other draws (order, temperatures) do not depend on the share.
    form_rng = random.Random(f"prompt-form-{args.seed}")
    forms = ["raw" if form_rng.random() < args.raw_share else "chat" for _ in rest]
    encoded = held + _encoded_prompts(tokenizer, rest, train_count, args.max_prompt_tokens, forms)
    print(f"distill: {len(held)} held-out prompts of {len(held_keys)} keys", file=sys.stderr, flush=True)
    temperatures = [1.0 if rng.random() < args.sample_fraction else 0.0 for _ in encoded]
    # The held-out prompts come first, one answer each; every training prompt's extra answers follow.
    extra = [p for p in encoded[len(held) :] for _ in range(args.responses_per_prompt - 1)]
    jobs, temperatures = encoded + extra, temperatures + [1.0] * len(extra)
    print(f"distill: {len(jobs)} answers to {len(encoded)} prompts", file=sys.stderr, flush=True)
    meta = {
        "prompts": str(args.prompts),
        "seed": args.seed,
        "generator": args.generator,
        "max_new_tokens": args.max_new_tokens,
        "sample_fraction": args.sample_fraction,
        "raw_share": args.raw_share,
        "responses_per_prompt": args.responses_per_prompt,
    }
    out = Path(args.out_dir)
    writer = ShardWriter(
        out, args.shard_name, meta, args.shard_max_tokens or SHARD_MAX_TOKENS, args.checkpoint_seconds
    )
    # The deadline keeps what follows generation: the last shard's write and closing the generator.
    deadline = (
        Deadline(started + 60.0 * args.max_minutes, lambda: 1.5 * writer.close_seconds() + FINISH_RESERVE_S)
        if args.max_minutes > 0
        else None
    )
    sides: Counter[str] = Counter()

    def keep(_: int, record: DistillRecord) -> None:
        prompt = by_id[record.id]
        record.source, record.key = prompt.source, prompt.key
        held_out = record.key in held_keys
        writer.add(record, held_out)
        sides["held_out" if held_out else "train"] += 1
        sides["tokens"] += len(record.response_ids)

    try:
        _generate(args, jobs, temperatures, tokenizer.eos_token_ids, keep, deadline, len(held))
    finally:
        # Also when generation failed: what was answered is written.
        shards = writer.close()
    print(
        f"distill: wrote {sides['train']} training and {sides['held_out']} held-out responses "
        f"({sides['tokens']} tokens) to {out}: {', '.join(p.name for p in shards)}, "
        f"{time.monotonic() - started:.1f} s in all"
    )
    return 0


def _stable_hash(text: str) -> int:
    """A hash of `text` that is the same in every process (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


def _held_out_prompts(
    tokenizer: Tokenizer, prompts: list[Prompt], wanted: int, max_tokens: int
) -> tuple[list[tuple[str, str, list[int]]], set[str]]:
    """The held-out prompts, (id, domain, token ids) of at most `max_tokens` tokens, and their keys: whole
    keys, in each domain those whose keys hash lowest until it holds at least its share of `wanted`
    (proportional to its prompts, at least one); the same whatever the seed, count or file order."""
    if wanted <= 0 or not prompts:
        return [], set()
    by_key: dict[str, list[Prompt]] = {}
    for prompt in sorted(prompts, key=lambda p: p.id):
        by_key.setdefault(prompt.key, []).append(prompt)
    order = sorted(by_key, key=lambda k: (_stable_hash(k), k))
    sizes = Counter(p.domain for p in prompts)
    held_by_key: dict[str, list[tuple[str, str, list[int]]]] = {}
    held_per_domain: Counter[str] = Counter()
    for domain in sorted(sizes):
        share = max(1, -(-wanted * sizes[domain] // len(prompts)))
        # A key counts toward every domain its prompts are in; a key larger than the share still goes whole.
        for key in order:
            if held_per_domain[domain] >= share:
                break
            if key in held_by_key or all(p.domain != domain for p in by_key[key]):
                continue
            held_by_key[key] = _encoded_prompts(tokenizer, by_key[key], len(by_key[key]), max_tokens)
            held_per_domain.update(d for _, d, _ in held_by_key[key])
    held = [encoded for key in order if key in held_by_key for encoded in held_by_key[key]]
    return held, set(held_by_key)


def _encoded_prompts(
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    wanted: int,
    max_tokens: int,
    forms: list[str] | None = None,
) -> list[tuple[str, str, list[int]]]:
    """(id, domain, token ids) of the first `wanted` prompts of at most `max_tokens` tokens, each in its
    form of `forms` (`dspark.training.records.PROMPT_FORMS`; default: every one chat)."""
    from dspark.training.data import encode_prompt

    encoded: list[tuple[str, str, list[int]]] = []
    if wanted <= 0:
        return encoded
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt.conversation, forms[i] if forms else "chat")
        if len(ids) <= max_tokens:
            encoded.append((prompt.id, prompt.domain, ids))
        if len(encoded) == wanted:
            break
    return encoded


def _generate(
    args: argparse.Namespace,
    jobs: list[tuple[str, str, list[int]]],
    temperatures: list[float],
    eos_token_ids: list[int],
    on_record: Callable[[int, DistillRecord], None],
    deadline: Deadline | None,
    held_out: int,
) -> None:
    """The target's answers to `jobs` (the first `held_out` of them always), each handed to `on_record`
    as it ends, by the generator `args` names."""
    from dspark.training.feed import answer_dense, answer_with_engine

    if args.generator == "dense":
        target, device = _load_target(args)
        print(f"distill: dense batches on {device}", file=sys.stderr, flush=True)
        answer_dense(
            target,
            jobs,
            temperatures,
            eos_token_ids,
            args.max_new_tokens,
            args.batch_size,
            on_record,
            args.seed,
            deadline,
            held_out,
        )
        return
    from dspark import LLM, EngineConfig

    concurrent = max(1, min(args.batch_size, len(jobs)))
    page_size = EngineConfig.kv_page_size
    pages_per_answer = -(-(args.max_prompt_tokens + args.max_new_tokens + 1) // page_size)
    config = EngineConfig(
        model=args.target,
        device=args.device,
        dtype=args.dtype,
        spec_mode="off",
        max_num_seqs=concurrent,
        num_kv_pages=concurrent * pages_per_answer + 1,
        max_model_len=args.max_prompt_tokens + args.max_new_tokens + 1,
        max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens, args.max_prompt_tokens),
        seed=args.seed,
    )
    with LLM(config) as llm:
        print(f"distill: the engine on {llm.engine.limits.device}", file=sys.stderr, flush=True)
        answer_with_engine(
            llm,
            jobs,
            temperatures,
            args.max_new_tokens,
            on_record,
            args.phase_answers,
            args.seed,
            deadline,
            held_out,
        )


def train_draft(argv: list[str]) -> int:
    """`dspark train-draft`: train a DSpark drafter on self-distillation data."""
    from dspark.training.losses import CE_TARGETS, LossWeights
    from dspark.training.trainer import TrainConfig

    defaults, weights = TrainConfig(), LossWeights()
    parser = argparse.ArgumentParser(
        prog="dspark train-draft", description="Train a DSpark drafter by self-distillation."
    )
    _target_args(parser)
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="shards, folders of shards or distill_train.jsonl files from `dspark distill-data`: trains on "
        "their union (identical responses once, never a prompt any of them holds out)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="drafter directory to write (DSpark format, bf16) with train_log.jsonl: --init-draft's log, "
        "then this run's",
    )
    parser.add_argument("--work-dir", default=None, help="resumable state and log (default: OUT.work)")
    parser.add_argument("--restart", action="store_true", help="ignore a saved state in the work dir")
    parser.add_argument(
        "--init-draft",
        default=None,
        help="start from this drafter checkpoint's weights instead of a fresh drafter initialised from "
        "the target (its layers, Markov rank and features; --block-size still sets the block trained): a "
        "warm restart, with fresh optimizer moments, a new warmup and this run's schedule",
    )
    parser.add_argument(
        "--run-index",
        type=int,
        default=-1,
        help="which run of a series this is (logged; sets the data order and the peak LR); -1: one after "
        "the last run in --init-draft's train_log.jsonl, else 0",
    )
    parser.add_argument(
        "--lr-run-decay",
        type=float,
        default=1.0,
        help="the peak learning rate of run k is --lr times this to the power k",
    )
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument(
        "--num-layers",
        type=int,
        default=0,
        help="drafter layers (0: 1 for a fresh drafter, --init-draft's own; more than its own grows it)",
    )
    parser.add_argument("--markov-rank", type=int, default=32)
    parser.add_argument("--num-target-features", type=int, default=3, help="target layers, evenly spread")
    parser.add_argument(
        "--target-layers",
        default="",
        help="comma-separated target layer ids (overrides --num-target-features)",
    )
    parser.add_argument(
        "--anchor-feature",
        action="store_true",
        help="add the anchor's context row to every block input (DraftConfig.anchor_feature; with "
        "--init-draft, grown at zero: a warm start)",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--max-minutes", type=float, default=defaults.max_minutes, help="0: no time limit")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=defaults.anchors_per_sequence, help="per sequence")
    parser.add_argument("--max-length", type=int, default=defaults.max_length)
    parser.add_argument(
        "--length-group",
        type=int,
        default=defaults.length_group,
        help="batches per pool of sequences sorted by length before batching (less padding; 1: random)",
    )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--l1-weight", type=float, default=weights.l1)
    parser.add_argument("--confidence-weight", type=float, default=weights.confidence)
    parser.add_argument("--decay", type=float, default=weights.decay, help="position weight exp(-k/decay)")
    parser.add_argument(
        "--ce-target",
        choices=CE_TARGETS,
        default=weights.ce_target,
        help="the cross-entropy's label: the data's next token, the target's distribution, or its argmax",
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=-1,
        help="train over the draft vocabulary the drafter will be served with (as EngineConfig's "
        "draft_vocab_size: K > 0 its K most frequent tokens, 0 the size --draft-vocab-from's file names, "
        "-1 every token); the order is --draft-vocab-from's, and --out gets it with K as its default size",
    )
    parser.add_argument(
        "--draft-vocab-from",
        default="",
        help="drafter directory whose draft_vocab.safetensors orders the tokens (default: --init-draft's; "
        "without one, the training data's own token frequencies)",
    )
    parser.add_argument("--log-every", type=int, default=defaults.log_every)
    parser.add_argument("--save-every", type=int, default=defaults.save_every)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)

    import torch

    from dspark.spec.draft_checkpoint import save_drafter
    from dspark.training.shards import read_data
    from dspark.training.trainer import (
        LOG_FILE,
        STATE_FILE,
        Trainer,
        deepened,
        init_from_target,
        new_drafter,
        next_run_index,
        trainable_from_checkpoint,
        with_anchor_feature,
    )

    torch.manual_seed(args.seed)
    target, device = _load_target(args)
    out = Path(args.out)
    work_dir = Path(args.work_dir) if args.work_dir else out.with_name(out.name + ".work")
    if args.restart and (work_dir / STATE_FILE).is_file():
        (work_dir / STATE_FILE).unlink()
    history = Path(args.init_draft) / LOG_FILE if args.init_draft else None
    run_index = args.run_index if args.run_index >= 0 else next_run_index(history)
    config = TrainConfig(
        steps=args.steps,
        max_minutes=args.max_minutes,
        batch_size=args.batch_size,
        anchors_per_sequence=args.anchors,
        max_length=args.max_length,
        length_group=args.length_group,
        lr=args.lr * args.lr_run_decay**run_index,
        run_index=run_index,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        seed=args.seed,
        log_every=args.log_every,
        save_every=args.save_every,
        weights=LossWeights(args.l1_weight, args.confidence_weight, args.decay, args.ce_target),
    )
    if args.init_draft:
        # --num-layers above the checkpoint's grows it (`deepened`); the other shape flags are its own.
        drafter = trainable_from_checkpoint(args.init_draft, args.block_size)
        drafter = deepened(drafter, args.num_layers or drafter.config.num_hidden_layers)
        if args.anchor_feature:
            drafter = with_anchor_feature(drafter)
    else:
        layer_ids = [int(i) for i in args.target_layers.split(",")] if args.target_layers else None
        drafter = new_drafter(
            target.config,
            args.block_size,
            args.num_layers or 1,
            args.markov_rank,
            args.num_target_features,
            args.seed,
            target_layer_ids=layer_ids,
            anchor_feature=args.anchor_feature,
        )
        init_from_target(drafter, target)
    records = read_data(args.data).train
    cfg = drafter.config
    order, vocab = _training_vocab(args, records, target.config.vocab_size)
    drafted = "every token" if vocab is None else f"{vocab.numel()} tokens"
    print(
        f"train: run {run_index} (peak lr {config.lr:.2e}), {len(records)} sequences, drafter "
        f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, {cfg.num_hidden_layers} "
        f"layer(s), target layers {cfg.target_layer_ids}, Markov rank {cfg.markov_rank}, "
        f"block size {cfg.block_size}, draft vocabulary {drafted}, "
        f"on {device}",
        file=sys.stderr,
        flush=True,
    )
    trained = Trainer(target, drafter, records, config, work_dir, device, vocab).run()
    save_drafter(trained, out, dtype=torch.bfloat16)
    if vocab is not None:
        # Served as trained: the engine's draft_vocab_size 0 takes this size.
        from dspark.spec.draft_vocab import save_draft_vocab

        save_draft_vocab(order, out, vocab.numel())
    # The drafter carries its whole training history: the log it started from, then this run's lines.
    earlier = history.read_text() if history is not None and history.is_file() else ""
    (out / LOG_FILE).write_text(earlier + (work_dir / LOG_FILE).read_text())
    print(f"train: wrote the drafter and its log to {out} (state in {work_dir})")
    return 0


def calibrate_draft(argv: list[str]) -> int:
    """`dspark calibrate-draft`: fit per-position confidence temperatures on held-out data."""
    parser = argparse.ArgumentParser(
        prog="dspark calibrate-draft",
        description="Fit the drafter's confidence temperatures, left to right, on held-out data.",
    )
    _target_args(parser)
    parser.add_argument("--draft", required=True, help="drafter directory; its config.json is updated")
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="held-out records: shards or folders of them (their held-out side), distill_val.jsonl files",
    )
    parser.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--survival", choices=("record", "greedy", "sampled"), default="record")
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=0,
        help="draft from this many tokens, as the engine's draft_vocab_size (0: the drafter's own size, "
        "-1: every token): the drafts are measured as they are served",
    )
    parser.add_argument("--report", default=None, help="write the calibration report (JSON) here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from dspark.runner.models.loader import resolve_dtype
    from dspark.spec.draft_checkpoint import load_drafter
    from dspark.spec.draft_vocab import load_draft_vocab
    from dspark.training.calibration import (
        calibration_report,
        collect_calibration_data,
        fit_temperatures,
        write_temperatures,
    )
    from dspark.training.shards import read_data

    target, device = _load_target(args)
    drafter = load_drafter(args.draft, resolve_dtype(args.dtype, device), device)
    vocab = load_draft_vocab(args.draft, args.draft_vocab_size, target.config.vocab_size)
    data = collect_calibration_data(
        target,
        drafter,
        read_data(args.data, jsonl_side="held_out").held_out,
        args.anchors,
        args.batch_size,
        args.max_length,
        args.seed,
        args.survival,
        vocab,
    )
    before = list(drafter.config.confidence_temperatures)
    after = fit_temperatures(data)
    report = calibration_report(data, before, after) | {"survival": args.survival}
    write_temperatures(args.draft, after)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"calibrate: {report['num_blocks']} blocks; "
        f"ECE {report['ece_before']:.4f} -> {report['ece_after']:.4f}; "
        f"temperatures {[round(t, 3) for t in after]} written to {Path(args.draft) / 'config.json'}"
    )
    print(f"calibrate: measured survival {report['measured_survival']} (tau {report['tau_teacher_forced']})")
    print(f"calibrate: predicted before  {report['predicted_survival_before']}")
    print(f"calibrate: predicted after   {report['predicted_survival_after']}")
    return 0


def _training_vocab(
    args: argparse.Namespace, records: list[DistillRecord], vocab_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The token order and the draft vocabulary's sorted ids `train-draft` trains over
    (`--draft-vocab-size`, `--draft-vocab-from`): (None, None) for every token."""
    from dspark.spec.draft_vocab import (
        DRAFT_VOCAB_FILE,
        frequency_order,
        leading_tokens,
        read_draft_vocab_order,
    )

    if args.draft_vocab_size < 0:
        return None, None
    source = args.draft_vocab_from or args.init_draft or ""
    if source and (Path(source) / DRAFT_VOCAB_FILE).is_file():
        order, default = read_draft_vocab_order(source, vocab_size)
    elif args.draft_vocab_from:
        raise SystemExit(f"--draft-vocab-from: {source} holds no {DRAFT_VOCAB_FILE}")
    else:  # the data's own frequencies, the target's end-of-sequence tokens first (as `draft-vocab`)
        from dspark.tokenizer import Tokenizer

        eos = Tokenizer.from_dir(args.target).eos_token_ids
        order, default = frequency_order((r.token_ids for r in records), vocab_size, eos), 0
    vocab = leading_tokens(order, args.draft_vocab_size or default)
    return (None, None) if vocab is None else (order, vocab)


def draft_vocab(argv: list[str]) -> int:
    """`dspark draft-vocab`: a drafter's draft vocabulary order (`spec.draft_vocab`) from training text."""
    parser = argparse.ArgumentParser(
        prog="dspark draft-vocab",
        description="Order the target's tokens by frequency in training prompts (and distilled answers) "
        "and write draft_vocab.safetensors into a drafter directory (draft_vocab_size takes its first K).",
    )
    parser.add_argument("--model", default=str(DEFAULT_TARGET_DIR), help="target directory (its tokenizer)")
    parser.add_argument("--draft-model", required=True, help="drafter directory to write into")
    parser.add_argument("--prompts", required=True, help="training prompts (JSON lines), never held-out ones")
    parser.add_argument(
        "--data", nargs="*", default=[], help="distill shards or folders: their answers count"
    )
    parser.add_argument(
        "--default-size", type=int, default=0, help="the size the drafter drafts from by default (0: all)"
    )
    args = parser.parse_args(argv)

    from dspark.spec.draft_vocab import frequency_order, save_draft_vocab
    from dspark.tokenizer import Tokenizer
    from dspark.training.data import encode_prompt, read_prompts
    from dspark.training.shards import read_data

    tokenizer = Tokenizer.from_dir(args.model)
    token_lists = [encode_prompt(tokenizer, p.conversation) for p in read_prompts(args.prompts)]
    if args.data:
        token_lists += [r.response_ids for r in read_data(args.data).train]
    order = frequency_order(token_lists, tokenizer.vocab_size, tokenizer.eos_token_ids)
    path = save_draft_vocab(order, args.draft_model, args.default_size)
    seen = len({i for ids in token_lists for i in ids})
    total = sum(len(ids) for ids in token_lists)
    print(f"wrote {path}: {total} tokens of {len(token_lists)} texts, {seen} distinct", flush=True)
    return 0


def eval_acceptance(argv: list[str]) -> int:
    """`dspark eval-acceptance`: tau, per-position acceptance and calibration through the real engine."""
    parser = argparse.ArgumentParser(
        prog="dspark eval-acceptance",
        description="Measure acceptance of a drafter with the engine, by domain, mode and temperature.",
    )
    parser.add_argument("--model", default=str(DEFAULT_TARGET_DIR), help="target directory")
    parser.add_argument("--draft-model", required=True, help="drafter directory")
    parser.add_argument("--prompts", required=True, help="evaluation prompts (JSON lines with a domain)")
    parser.add_argument("--per-domain", type=int, default=32, help="prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--block-size", type=int, default=0, help="drafts verified per step (0: the drafter's)"
    )
    parser.add_argument("--modes", default="static,compact")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--sps-table", default="", help="SPS table for compact planning (empty: flat)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-kv-pages", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=0,
        help="draft from the K most frequent tokens (0: the drafter's own, -1: all)",
    )
    parser.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="copy drafts where a request's last tokens occurred before (the serve default); off: every "
        "block is the drafter's, so tau and calibration measure the drafter",
    )
    parser.add_argument(
        "--prompt-form",
        default="chat",
        choices=PROMPT_FORMS,
        help="chat: under the model's chat template; raw: the text alone, as a text_input request reaches "
        "the server (the target continues it)",
    )
    parser.add_argument("--out", default=None, help="write the results (JSON) here")
    parser.add_argument("--markdown", default=None, help="write the table (markdown) here")
    args = parser.parse_args(argv)

    from dspark.config import EngineConfig
    from dspark.spec.draft_config import DraftConfig
    from dspark.training.acceptance import evaluate_acceptance, markdown_table
    from dspark.training.data import read_prompts

    draft_config = DraftConfig.load(args.draft_model)
    block_size = args.block_size or draft_config.block_size
    by_domain: dict[str, list[list[dict[str, str]]]] = {}
    for prompt in read_prompts(args.prompts):
        conversations = by_domain.setdefault(prompt.domain, [])
        if len(conversations) < args.per_domain:
            conversations.append(prompt.conversation)
    config = EngineConfig(
        model=args.model,
        draft_model=args.draft_model,
        device=args.device,
        dtype=args.dtype,
        block_size=block_size,
        sps_table=args.sps_table,
        max_num_seqs=args.max_num_seqs,
        num_kv_pages=args.num_kv_pages,
        max_num_batched_tokens=max(2048, args.max_num_seqs * (block_size + 1)),
        seed=args.seed,
        draft_vocab_size=args.draft_vocab_size,
        prompt_lookup=args.prompt_lookup,
    )
    modes = [m for m in args.modes.split(",") if m]
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    result = {
        "model": args.model,
        "draft_model": args.draft_model,
        "confidence_temperatures": draft_config.confidence_temperatures,
        "block_size": block_size,
        "max_tokens": args.max_tokens,
        "sps_table": args.sps_table or "flat",
        "device": args.device,
        "prompt_form": args.prompt_form,
        "rows": [],
    }
    rows = evaluate_acceptance(
        config, by_domain, modes, temperatures, args.max_tokens, args.seed, args.prompt_form
    )
    for row in rows:
        result["rows"].append(row)
        print(
            f"eval: {row['domain']} {row['mode']} T={row['temperature']:g}: tau {row['tau']:.3f}, "
            f"ECE {row['ece']}, {row['steps']} steps, {row['seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        # Written after every row, so a run stopped early still leaves what it measured.
        table = markdown_table(result["rows"], block_size)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(table)
    print(markdown_table(result["rows"], block_size))
    return 0


def draft_cost(argv: list[str]) -> int:
    """`dspark draft-cost`: the drafter's work per decoding step (KV injection and one greedy block)."""
    parser = argparse.ArgumentParser(
        prog="dspark draft-cost", description="Time a drafter's work per decoding step, by batch size."
    )
    _target_args(parser)
    parser.add_argument("--draft-model", required=True, help="drafter directory")
    parser.add_argument("--batches", default="1,64", help="comma-separated request counts")
    parser.add_argument("--context", type=int, default=256, help="cached positions before each block")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-graphs", action="store_true", help="draft eagerly on a GPU too")
    parser.add_argument("--out", default=None, help="write the result (JSON) here")
    args = parser.parse_args(argv)

    from dspark.runner.models.loader import resolve_dtype
    from dspark.spec.draft_checkpoint import load_drafter
    from dspark.training.draft_cost import drafter_step_seconds

    target, device = _load_target(args)
    drafter = load_drafter(args.draft_model, resolve_dtype(args.dtype, device), device)
    use_graphs = device.type == "cuda" and not args.no_graphs
    weights = Path(args.draft_model) / "model.safetensors"
    result = {
        "draft_model": args.draft_model,
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "megabytes": round(weights.stat().st_size / 1e6, 2) if weights.is_file() else None,
        "block_size": drafter.config.block_size,
        "context": args.context,
        "device": str(device),
        "graphs": use_graphs,
        "ms_per_step": {},
    }
    embedding, lm_head = target.embed_tokens.weight, target.lm_head.weight
    for batch in (int(b) for b in args.batches.split(",") if b):
        seconds = drafter_step_seconds(
            drafter, embedding, lm_head, batch, args.context, args.repeats, use_graphs
        )
        result["ms_per_step"][str(batch)] = round(1000 * seconds, 4)
        print(f"draft-cost: batch {batch}: {1000 * seconds:.3f} ms a step", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def _target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_TARGET_DIR), help="target model directory")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))


def _load_target(args: argparse.Namespace) -> tuple[CausalLM, torch.device]:
    from dspark.runner.models.loader import load_target_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    target = load_target_model(args.target, dtype=resolve_dtype(args.dtype, device), device=device)
    return target.requires_grad_(False), device
