"""`dspark-client`: stream a completion (`generate`) or run a concurrency sweep (`bench`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

from dspark_client.bench import Streamer, format_table, run_level
from dspark_client.prompts import PROMPTS, read_prompts
from dspark_client.streaming import (
    DEFAULT_GRPC_URL,
    DEFAULT_HTTP_URL,
    DEFAULT_MODEL,
    GrpcSession,
    ServerError,
    stream_http,
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dspark-client` console script."""
    parser = argparse.ArgumentParser(prog="dspark-client", description="Client for a dspark Triton server.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="stream one completion to the terminal")
    generate.add_argument("--prompt", required=True)
    generate.add_argument(
        "--stats", action="store_true", help="print finish reason, speed and speculation stats"
    )
    bench = commands.add_parser("bench", help="concurrency sweep: TTFT, inter-token latency, tokens/s")
    bench.add_argument(
        "--concurrency", default="1,2,4,8", help="comma-separated levels (default %(default)s)"
    )
    bench.add_argument("--num-prompts", type=int, default=16, help="requests per level (default %(default)s)")
    bench.add_argument("--json", dest="json_out", help="also write the results to this JSON file")
    bench.add_argument(
        "--prompts",
        help='send these prompts in turn: a .jsonl file of {"prompt": ...} objects or a text file, one '
        "a line (default: eight everyday questions)",
    )
    for sub in (generate, bench):
        sub.add_argument(
            "--raw",
            action="store_true",
            help="send the prompt as raw text (default: as one user turn through the model's chat template, "
            "which the server applies: its apply_chat_template input)",
        )
        _connection_args(sub)
        _sampling_args(sub, max_tokens=64 if sub is generate else 32)
    args = parser.parse_args(argv)
    try:
        return _generate(args) if args.command == "generate" else _bench(args)
    except ServerError as exc:
        hint = " (a model without a chat template: send --raw)" if "apply_chat_template" in str(exc) else ""
        print(f"dspark-client: server error: {exc}{hint}", file=sys.stderr)
        return 1
    except ConnectionError as exc:
        print(f"dspark-client: cannot reach the server: {exc}", file=sys.stderr)
        return 1


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http", action="store_true", help="use HTTP /generate_stream (SSE) instead of gRPC")
    parser.add_argument(
        "--url", help=f"server address (default {DEFAULT_GRPC_URL} for gRPC, {DEFAULT_HTTP_URL} with --http)"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name (default %(default)s)")


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy (the server's default)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="cap this request's verify window")


def _params(args: argparse.Namespace) -> dict:
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "num_draft_tokens")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _url(args: argparse.Namespace) -> str:
    return args.url or (DEFAULT_HTTP_URL if args.http else DEFAULT_GRPC_URL)


def _generate(args: argparse.Namespace) -> int:
    params = _params(args)
    started = time.perf_counter()
    if args.http:
        chunks = stream_http(
            args.prompt, params, url=_url(args), model=args.model, spec_stats=args.stats, chat=not args.raw
        )
        session = None
    else:
        session = GrpcSession(_url(args), args.model)
        chunks = session.generate(args.prompt, params, spec_stats=args.stats, chat=not args.raw)
    tokens, reason, stats = 0, "", None
    try:
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            tokens += len(chunk.token_ids)
            reason, stats = chunk.finish_reason or reason, chunk.spec_stats or stats
    finally:
        if session is not None:
            session.close()
    sys.stdout.write("\n")
    if args.stats:
        elapsed = time.perf_counter() - started
        summary = {"finish_reason": reason, "tokens": tokens, "seconds": round(elapsed, 3)}
        summary["tokens_per_s"] = round(tokens / elapsed, 2) if elapsed else 0.0
        print(json.dumps({**summary, "spec_stats": stats}), file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    levels = [int(level) for level in args.concurrency.split(",") if level.strip()]
    make_streamer = partial(Streamer, args.http, _url(args), args.model, _params(args), chat=not args.raw)
    try:
        prompts = read_prompts(args.prompts) if args.prompts else PROMPTS
    except (OSError, ValueError) as exc:
        print(f"dspark-client: --prompts: {exc}", file=sys.stderr)
        return 2
    rows = []
    for concurrency in levels:
        result = run_level(concurrency, args.num_prompts, make_streamer, prompts)
        rows.append(result.summary())
        for error in result.errors[:3]:
            print(f"error at concurrency {concurrency}: {error}", file=sys.stderr)
    print(format_table(rows))
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(rows, out, indent=1)
    return 1 if any(row["errors"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
