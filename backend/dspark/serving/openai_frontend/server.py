"""The frontend process: uvicorn serving the app, stopped by SIGTERM / Ctrl-C or, under `dspark serve`,
when the launcher goes away (its standard input, a pipe the launcher holds, closes)."""

from __future__ import annotations

import argparse
import sys
import threading

import uvicorn

from dspark.serving.openai_frontend.app import create_app

GRACEFUL_SHUTDOWN_S = 10  # open streams get this long to end after a stop before they are cut


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m dspark.serving.openai_frontend",
        description="OpenAI-compatible HTTP endpoint for a model served by Triton (gRPC).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address; default %(default)s")
    parser.add_argument("--port", type=int, default=9000, help="%(default)s")
    parser.add_argument("--grpc-url", default="localhost:8001", help="Triton's gRPC endpoint; %(default)s")
    parser.add_argument("--model", default="dspark", help="Triton model served as this name; %(default)s")
    parser.add_argument(
        "--exit-with-stdin",
        action="store_true",
        help="stop when standard input closes (dspark serve holds it: the frontend never outlives it)",
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn's; default %(default)s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serve until stopped; the exit status."""
    args = parse_args(argv)
    config = uvicorn.Config(
        create_app(args.grpc_url, args.model),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    if args.exit_with_stdin:
        threading.Thread(target=_stop_at_stdin_eof, args=(server,), daemon=True).start()
    print(
        f"dspark openai frontend: http://{args.host}:{args.port}/v1 -> model {args.model} at {args.grpc_url}",
        flush=True,
    )
    server.run()
    return 0 if server.started else 1


def _stop_at_stdin_eof(server: uvicorn.Server) -> None:
    """Ask the server to stop once standard input reaches its end."""
    sys.stdin.buffer.read()
    server.should_exit = True
