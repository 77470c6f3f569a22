"""The benchmark-client recipes of benchmarks/clients.md, end to end, against a server this starts.

A benchmark, not a test: it starts `.venv/bin/dspark serve` on free loopback ports (the OpenAI
endpoint too, where `dspark serve` has `--openai-port`), then puts the same load (the 8 prompts of
`dspark-client bench`, cycled to --requests requests, --max-tokens tokens each with EOS ignored,
greedy, --concurrency in flight) on it three ways:

1. `dspark-client bench` over the gRPC stream (the project's own client, for reference);
2. `aiperf --endpoint-type template` on HTTP `/v2/models/dspark/generate_stream`;
3. `aiperf --endpoint-type chat` on the OpenAI endpoint's `/v1/chat/completions`.

aiperf lives in its own virtual environment (default /tmp/aiperf-venv, created with
`pip install aiperf==VERSION` when missing) so that its dependencies stay out of .venv. Every command
run is written to OUT/commands.sh, each client's output to OUT/<run>/, the figures side by side to
OUT/summary.md. Exit status 1 if any run failed or any request ended in an error.

    .venv/bin/python benchmarks/aiperf_recipe.py --out benchmarks/results/aiperf-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_client.bench import PROMPTS

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
TOKENIZER = REPO / "models" / "SmolLM2-135M-Instruct"
# aiperf's template endpoint renders this Jinja2 body per request; the dspark model reads these
# top-level keys of Triton's generate JSON as its inputs and sampling parameters.
GENERATE_TEMPLATE = (
    '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": true, "ignore_eos": true}'
)
READY_TIMEOUT_S = 900.0


def free_ports(count: int) -> list[int]:
    """Ports free on the loopback interface now (held together so that they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def serve_has_openai() -> bool:
    """Whether this tree's `dspark serve` starts the OpenAI-compatible endpoint."""
    result = subprocess.run([str(BIN / "dspark"), "serve", "--help"], capture_output=True, text=True)
    return "--openai-port" in result.stdout


def ensure_aiperf(venv: Path, version: str) -> Path:
    """The aiperf executable, installed into its own virtual environment if missing."""
    aiperf = venv / "bin" / "aiperf"
    if not aiperf.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", f"aiperf=={version}"], check=True)
    return aiperf


def get_json(url: str, timeout: float = 5.0) -> Any:
    """GET a JSON document."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


class Server:
    """`dspark serve` on free loopback ports, in its own process group, stopped with SIGTERM on exit."""

    def __init__(self, log: Path, openai: bool) -> None:
        self.http, self.grpc, self.metrics, openai_port = free_ports(4)
        self.openai = openai_port if openai else 0
        self.log = log
        self.command = [str(BIN / "dspark"), "serve", "--address", "127.0.0.1"]
        self.command += ["--http-port", str(self.http), "--grpc-port", str(self.grpc)]
        self.command += ["--metrics-port", str(self.metrics)]
        if openai:
            self.command += ["--openai-port", str(self.openai)]
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"dspark serve exited with {self.process.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"dspark serve not ready after {READY_TIMEOUT_S:.0f}s; see {self.log}")
            time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # dspark serve drains and stops its server and guard
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _ready(self) -> bool:
        """Triton's model is ready and, when started, the OpenAI endpoint lists a model."""
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2).close()
            if self.openai:
                return bool(get_json(f"http://127.0.0.1:{self.openai}/v1/models").get("data"))
            return True
        except OSError:
            return False


def write_dataset(path: Path, prompts: list[str], max_tokens: int) -> None:
    """An aiperf single-turn JSONL file: one prompt per line, each with its output length."""
    lines = [json.dumps({"text": prompt, "output_length": max_tokens}) for prompt in prompts]
    path.write_text("\n".join(lines) + "\n")


def aiperf_load(args: argparse.Namespace, dataset: Path, out: Path) -> list[str]:
    """The aiperf flags every recipe shares: the load, the tokenizer, the outputs."""
    return [
        "--model", "dspark",
        "--tokenizer", str(TOKENIZER),
        "--input-file", str(dataset),
        "--custom-dataset-type", "single-turn",
        "--dataset-sampling-strategy", "sequential",
        "--request-count", str(args.requests),
        "--concurrency", str(args.concurrency),
        "--warmup-request-count", str(args.concurrency),
        "--random-seed", "0",
        "--ui", "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
        "--artifact-dir", str(out),
    ]  # fmt: skip


def run_logged(command: list[str], log: Path) -> tuple[int, float]:
    """Run a command with its output in `log`; its exit status and the host's load average before it."""
    load = os.getloadavg()[0]
    print(f"$ {shlex.join(command)}", flush=True)
    with log.open("w") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    return status, load


def recipes(args: argparse.Namespace, server: Server, aiperf: str, dataset: Path, out: Path) -> list[Recipe]:
    """Every recipe this server can take, in the order they run."""
    bench = Recipe(
        "dspark-client bench, gRPC stream",
        "dspark-client-bench",
        [
            str(BIN / "dspark-client"), "bench",
            "--url", f"127.0.0.1:{server.grpc}",
            "--concurrency", str(args.concurrency),
            "--num-prompts", str(args.requests),
            "--max-tokens", str(args.max_tokens),
            "--ignore-eos",
            "--json", str(out / "dspark-client-bench" / "bench.json"),
        ],
    )  # fmt: skip
    extra = json.dumps({"payload_template": GENERATE_TEMPLATE, "response_field": "text_output"})
    template = Recipe(
        "aiperf template, HTTP generate_stream",
        "aiperf-template",
        [
            aiperf, "profile",
            "--url", f"http://127.0.0.1:{server.http}",
            "--endpoint-type", "template",
            "--custom-endpoint", "/v2/models/dspark/generate_stream",
            "--streaming",
            "--extra-inputs", extra,
            *aiperf_load(args, dataset, out / "aiperf-template"),
        ],
    )  # fmt: skip
    chat = Recipe(
        "aiperf chat, OpenAI /v1/chat/completions",
        "aiperf-chat",
        [
            aiperf, "profile",
            "--url", f"http://127.0.0.1:{server.openai}",
            "--endpoint-type", "chat",
            "--streaming",
            "--extra-inputs", "temperature:0",
            "--extra-inputs", "ignore_eos:true",
            *aiperf_load(args, dataset, out / "aiperf-chat"),
        ],
    )  # fmt: skip
    return [bench, template, chat] if server.openai else [bench, template]


@dataclass
class Recipe:
    """One client run: its title in the summary, its folder under OUT, its command."""

    title: str
    name: str
    command: list[str]

    def row(self, out: Path, max_tokens: int) -> dict[str, Any] | None:
        """Its summary row, None when it left no results."""
        folder = out / self.name
        if (folder / "bench.json").exists():
            return bench_row(self.title, folder / "bench.json", max_tokens)
        if (folder / "profile_export_aiperf.json").exists():
            return aiperf_row(self.title, folder / "profile_export_aiperf.json")
        return None


def aiperf_row(name: str, export: Path) -> dict[str, Any]:
    """One summary row from aiperf's profile_export_aiperf.json."""
    data = json.loads(export.read_text())

    def stat(key: str, field: str) -> float:
        return float(data.get(key, {}).get(field, float("nan")))

    completed = stat("completed_request_count", "avg")
    errors = data.get("error_request_count", {}).get("avg", completed - stat("request_count", "avg"))
    return {
        "run": name,
        "requests": int(completed),
        "errors": int(errors),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p90_ms": stat("time_to_first_token", "p90"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "itl_p90_ms": stat("inter_token_latency", "p90"),
        "output_tokens_per_s": stat("output_token_throughput", "avg"),
        "mean_output_tokens": stat("output_sequence_length", "avg"),
    }


def bench_row(name: str, export: Path, max_tokens: int) -> dict[str, Any]:
    """One summary row from `dspark-client bench --json`."""
    (level,) = json.loads(export.read_text())
    return {
        "run": name,
        "requests": level["requests"],
        "errors": level["errors"],
        "ttft_p50_ms": 1000 * level["ttft_p50_s"],
        "ttft_p90_ms": 1000 * level["ttft_p90_s"],
        "itl_p50_ms": 1000 * level["itl_p50_s"],
        "itl_p90_ms": 1000 * level["itl_p90_s"],
        "output_tokens_per_s": level["output_tokens_per_s"],
        "mean_output_tokens": float(max_tokens),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The summary rows as a Markdown table."""
    columns = ["run", "requests", "errors", "TTFT p50 / p90 (ms)", "ITL p50 / p90 (ms)", "output tok/s"]
    columns += ["tokens/request", "host load (1 min) before"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append(
            f"| {row['run']} | {row['requests']} | {row['errors']} | "
            f"{row['ttft_p50_ms']:.0f} / {row['ttft_p90_ms']:.0f} | "
            f"{row['itl_p50_ms']:.1f} / {row['itl_p90_ms']:.1f} | "
            f"{row['output_tokens_per_s']:.1f} | {row['mean_output_tokens']:.1f} | {row['load_before']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Start a server, run every recipe against it, write the summary; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/dspark-aiperf"), help="%(default)s")
    parser.add_argument("--requests", type=int, default=32, help="%(default)s")
    parser.add_argument("--concurrency", type=int, default=4, help="%(default)s")
    parser.add_argument("--max-tokens", type=int, default=64, help="%(default)s")
    parser.add_argument("--aiperf-venv", type=Path, default=Path("/tmp/aiperf-venv"), help="%(default)s")
    parser.add_argument("--aiperf-version", default="0.13.0", help="%(default)s")
    args = parser.parse_args(argv)

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    aiperf = str(ensure_aiperf(args.aiperf_venv, args.aiperf_version))
    dataset = out / "prompts.jsonl"
    write_dataset(dataset, PROMPTS, args.max_tokens)
    openai = serve_has_openai()
    if not openai:
        print("dspark serve has no --openai-port in this tree: the chat recipe is skipped", flush=True)
    commands: list[str] = []
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    with Server(out / "server.log", openai) as server:
        commands.append(shlex.join(server.command) + " &")
        for recipe in recipes(args, server, aiperf, dataset, out):
            (out / recipe.name).mkdir(exist_ok=True)
            commands.append(shlex.join(recipe.command))
            status, load = run_logged(recipe.command, out / recipe.name / "run.log")
            row = recipe.row(out, args.max_tokens)
            if row is not None:
                rows.append({**row, "load_before": load})
            if status or row is None:
                failed.append(recipe.name)

    (out / "commands.sh").write_text("\n".join(commands) + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown(rows)
    (out / "summary.md").write_text(table)
    print(table, end="")
    errors = sum(row["errors"] for row in rows)
    if failed or errors:
        print(f"failed: {failed or 'none'}; requests with errors: {errors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
