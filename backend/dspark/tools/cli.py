"""The `dspark` command: generate, import-gguf, create-draft, profile-sps, serve."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dspark.config import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, EngineConfig, field_names


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dspark` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "generate": _generate,
        "import-gguf": _import_gguf,
        "create-draft": _create_draft,
        "profile-sps": _profile_sps,
        "serve": _serve,
        # Training commands (dspark.training.cli), imported only when one of them runs.
        "self-prompts": lambda a: __import__("dspark.training.cli", fromlist=["_"]).self_prompts(a),
        "distill-data": lambda a: __import__("dspark.training.cli", fromlist=["_"]).distill_data(a),
        "train-draft": lambda a: __import__("dspark.training.cli", fromlist=["_"]).train_draft(a),
        "calibrate-draft": lambda a: __import__("dspark.training.cli", fromlist=["_"]).calibrate_draft(a),
        "eval-acceptance": lambda a: __import__("dspark.training.cli", fromlist=["_"]).eval_acceptance(a),
        "draft-cost": lambda a: __import__("dspark.training.cli", fromlist=["_"]).draft_cost(a),
        "draft-vocab": lambda a: __import__("dspark.training.cli", fromlist=["_"]).draft_vocab(a),
    }
    if not argv or argv[0] not in commands:
        print(f"usage: dspark {{{','.join(commands)}}} [options]  (dspark COMMAND --help)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def _engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as --flag (dashes for underscores; --engine-NAME where the command
    already has --NAME), defaulting to EngineConfig's own."""
    taken = {opt for action in parser._actions for opt in action.option_strings}
    for name in field_names():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(
            "--engine-" + flag[2:] if flag in taken else flag, dest="engine_" + name, default=None
        )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    given = {
        n: str(getattr(args, "engine_" + n))
        for n in field_names()
        if getattr(args, "engine_" + n) is not None
    }
    return EngineConfig.from_parameters(given)


def _generate(argv: list[str]) -> int:
    from dspark.llm import LLM
    from dspark.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(prog="dspark generate", description="Generate text on this machine.")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stats", action="store_true", help="print speculation statistics and speed")
    _engine_args(parser)
    args = parser.parse_args(argv)
    llm = LLM(_engine_config(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    ids = [
        llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
        )
        if args.chat
        else llm.tokenizer.encode(p)
        for p in args.prompt
    ]
    start = time.perf_counter()
    outputs = llm.generate(params=params, prompt_token_ids=ids)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(out.text)
        if args.stats:
            print(
                json.dumps({"finish_reason": out.finish_reason, **out.spec_stats.as_dict()}), file=sys.stderr
            )
    if args.stats:
        tokens = sum(len(o.token_ids) for o in outputs)
        print(f"{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s", file=sys.stderr)
    return 0


def _import_gguf(argv: list[str]) -> int:
    from dspark.tools.convert_gguf import main_import_gguf

    return main_import_gguf(argv)


def _create_draft(argv: list[str]) -> int:
    import torch

    from dspark.runner.models.hf_config import ModelConfig
    from dspark.spec.draft_checkpoint import create_random_drafter, fresh_draft_config, save_drafter

    parser = argparse.ArgumentParser(
        prog="dspark create-draft", description="Write a randomly initialised drafter."
    )
    parser.add_argument("--target", default=str(DEFAULT_TARGET_DIR))
    parser.add_argument("--out", default=str(DEFAULT_DRAFT_DIR))
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--markov-rank", type=int, default=32)
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--if-missing", action="store_true", help="do nothing when --out already holds a drafter"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.if_missing and (out / "config.json").is_file():
        print(f"drafter already at {out}")
        return 0
    cfg = fresh_draft_config(
        ModelConfig.load(args.target), args.block_size, args.num_layers, args.markov_rank, args.mask_token_id
    )
    save_drafter(create_random_drafter(cfg, seed=args.seed), out, dtype=torch.float32)
    print(f"wrote a randomly initialised drafter to {out}")
    return 0


def _profile_sps(argv: list[str]) -> int:
    from dspark.spec.profile import profile_sps_table

    parser = argparse.ArgumentParser(
        prog="dspark profile-sps", description="Measure target steps/s by tokens."
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    _engine_args(parser)
    args = parser.parse_args(argv)
    table = profile_sps_table(_engine_config(args), max_tokens=args.max_tokens, repeats=args.repeats)
    table.save(args.out)
    print(json.dumps(table.to_dict(), indent=1))
    return 0


def _serve(argv: list[str]) -> int:
    from dspark.serving.triton_launcher import main_serve

    return main_serve(argv)


if __name__ == "__main__":
    raise SystemExit(main())
