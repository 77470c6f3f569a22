"""The serving path's own ceiling: the real tritonserver and model.py, a synthetic token source in place
of the engine (benchmarks/synthetic_engine_model.py), and the multi-process load generator.

Every running request is offered `--tokens-per-step` tokens `--steps-per-s` times a second, so C
streams are offered C x S x K tokens/s; the table says what the server delivered (tokens and
responses per second, TTFT, gaps between responses) and the delivered / offered ratio.

    .venv/bin/python benchmarks/serving_ceiling.py --concurrency 1,8,64,128,256 --steps-per-s 300
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load_generator import run_load  # noqa: E402

from dspark.config import EngineConfig  # noqa: E402
from dspark.serving.triton_config import render_config_pbtxt  # noqa: E402


def render_repository(root: Path, steps_per_s: float, tokens_per_step: int) -> Path:
    """A repository holding only `dspark`, whose model.py is the synthetic-engine harness."""
    model = root / "model_repository" / "dspark"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(render_config_pbtxt(EngineConfig(max_num_seqs=1024)))
    shutil.copy(HERE / "synthetic_engine_model.py", model / "1" / "model.py")
    synthetic = {"steps_per_s": steps_per_s, "tokens_per_step": tokens_per_step}
    (model / "1" / "synthetic.json").write_text(json.dumps(synthetic))
    return model.parent


def start_server(
    repo: Path, http_port: int, grpc_port: int, metrics_port: int, log: Path
) -> subprocess.Popen:
    """`dspark serve` on the repository; returns once the model is ready."""
    command = [
        sys.executable, "-m", "dspark.serving.triton_launcher", "--model-repository", str(repo),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    from dspark.serving.triton_launcher import parse_args

    if hasattr(parse_args([]), "openai_port"):  # the OpenAI frontend is not measured here
        command += ["--openai-port", "0"]
    process = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"dspark serve exited: see {log}")
        try:
            with urllib.request.urlopen(f"http://localhost:{http_port}/v2/models/dspark/ready", timeout=2):
                return process
        except OSError:
            time.sleep(0.25)
    process.terminate()
    raise SystemExit(f"not ready after 300 s: see {log}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,64,128,256")
    parser.add_argument("--steps-per-s", type=float, default=300.0)
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--processes", type=int, default=0, help="load processes (default: CPU count)")
    parser.add_argument("--ports", default="18500,18501,18502", help="HTTP,gRPC,metrics")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    http_port, grpc_port, metrics_port = (int(p) for p in args.ports.split(","))
    results = []
    with tempfile.TemporaryDirectory(prefix="dspark-ceiling-") as tmp:
        repo = render_repository(Path(tmp), args.steps_per_s, args.tokens_per_step)
        log = Path(tmp) / "server.log"
        server = start_server(repo, http_port, grpc_port, metrics_port, log)
        try:
            print(
                f"{'streams':>7} {'offered tok/s':>13} {'tok/s':>9} {'ratio':>6} {'resp/s':>9} "
                f"{'TTFT p50 ms':>11} {'gap p50 ms':>10} {'gap p90 ms':>10} {'errors':>6}",
                flush=True,
            )
            for level in (int(c) for c in args.concurrency.split(",")):
                result = run_load(
                    f"localhost:{grpc_port}",
                    level,
                    level * args.requests_per_stream,
                    args.max_tokens,
                    args.processes or None,
                )
                offered = level * args.steps_per_s * args.tokens_per_step
                ratio = result.tokens_per_s / offered
                print(
                    f"{level:>7} {offered:>13.0f} {result.tokens_per_s:>9.0f} {ratio:>6.2f} "
                    f"{result.responses_per_s:>9.0f} {result.ttft_p50_ms:>11.1f} {result.gap_p50_ms:>10.2f} "
                    f"{result.gap_p90_ms:>10.2f} {result.errors:>6}",
                    flush=True,
                )
                results.append({**asdict(result), "offered_tokens_per_s": offered})
        finally:
            server.terminate()
            server.wait(120)
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"config": config, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
