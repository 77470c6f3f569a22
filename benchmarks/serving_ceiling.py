"""The serving path's own ceiling: the real tritonserver and model.py, a synthetic token source in place
of the engine (benchmarks/synthetic_engine_model.py), and the multi-process load generator.

Every running request is offered `--tokens-per-step` tokens `--steps-per-s` times a second, so C
streams are offered C x S x K tokens/s; the table says what the server delivered (tokens and
responses per second, TTFT, gaps between responses) and the delivered / offered ratio. The synthetic
engine runs in its own process behind the real `EngineProcess`, as served (`--in-stub`: a thread of
the backend stub instead, without the engine process's transport).

    .venv/bin/python benchmarks/serving_ceiling.py --concurrency 1,8,64,128,256 --steps-per-s 300

The machine is shared and noisy, so each level also says what the server's processes cost, which
moves much less than throughput: CPU milliseconds per 1000 delivered tokens in the backend stub (the
adapter), the engine process (here the synthetic source and its transport) and tritonserver itself,
and the load generator's CPU cores over the whole level, its processes' start and connections included
(on 2 cores it competes with the server for them).

`--profile-levels 64,256` then runs a longer load at those levels, sampled by py-spy (as
benchmarks/serving_overhead.py does), and prints benchmarks/pyspy_top.py's tables of it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import signal
import socket
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


def render_repository(
    root: Path,
    steps_per_s: float,
    tokens_per_step: int,
    engine_process: bool = True,
    instances: int = 1,
    busy_share: float = 0.0,
) -> Path:
    """A repository holding only `dspark`, whose model.py is the synthetic-engine harness (`instances`
    backend stubs, each with a synthetic engine of its own)."""
    model = root / "model_repository" / "dspark"
    (model / "1").mkdir(parents=True)
    config = render_config_pbtxt(EngineConfig(max_num_seqs=1024), instances=instances)
    (model / "config.pbtxt").write_text(config)
    shutil.copy(HERE / "synthetic_engine_model.py", model / "1" / "model.py")
    synthetic = {
        "steps_per_s": steps_per_s,
        "tokens_per_step": tokens_per_step,
        "engine_process": engine_process,
        "busy_share": busy_share,
        "repo_root": str(HERE.parent),
    }
    (model / "1" / "synthetic.json").write_text(json.dumps(synthetic))
    return model.parent


def port_taken(port: int) -> bool:
    """Whether a socket listens on this port. The probe binds as a server does (SO_REUSEADDR): the
    connections a stopped server's clients left in TIME_WAIT (up to a minute) do not count; without it
    the harness refused the next mode's server right after stopping the last one (session 41, H100)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def stop_server(process: subprocess.Popen, ports: tuple[int, ...] | list[int], timeout: float = 120) -> None:
    """Stop a server `start_server` started (up to `timeout` seconds for it to end, then killed with
    whatever of its session outlived it) and wait up to 30 s more until nothing listens on its ports:
    a next server in the same run must find them free. Already terminated (`terminate`): waits."""
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(port_taken(port) for port in ports):
        time.sleep(0.25)


def _stop_with_harness() -> None:
    """In the launcher, before it runs: SIGTERM when the harness's thread that started it dies.

    A harness killed by `timeout` (SIGTERM) never reaches its `finally`; without this its servers (in
    their own sessions) kept serving and loading the CPU under the next run. The launcher drains and
    stops its tritonserver on SIGTERM. PR_SET_PDEATHSIG follows the starting thread: call from the
    thread that lives as long as the harness (every harness here starts servers from its main thread)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def start_server(
    repo: Path, http_port: int, grpc_port: int, metrics_port: int, log: Path
) -> subprocess.Popen:
    """`dspark serve` on the repository; returns once the model is ready. Refuses ports already taken:
    a server left over from an earlier run (one whose harness was killed by a timeout) would answer the
    readiness check and the load in this one's place."""
    for port in (http_port, grpc_port, metrics_port):
        if port_taken(port):
            raise SystemExit(f"port {port} is taken (a socket listens on it): a server from an earlier run?")
    command = [
        sys.executable, "-m", "dspark.serving.triton_launcher", "--model-repository", str(repo),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    from dspark.serving.triton_launcher import parse_args

    if hasattr(parse_args([]), "openai_port"):  # the OpenAI frontend is not measured here
        command += ["--openai-port", "0"]
    process = subprocess.Popen(
        command,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_stop_with_harness,
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


def stat_fields(stat: str) -> list[str]:
    """The fields of a /proc .../stat line after the command's parentheses (field 3 on: state, parent
    pid, ...)."""
    return stat.rpartition(")")[2].split()


def stat_cpu_seconds(fields: list[str]) -> float:
    """CPU seconds (user + system: stat's fields 14 and 15) of a process or thread, from `stat_fields`."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, CPU seconds used) of every process readable in /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            command = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat_fields(stat)
        table[int(name)] = (int(fields[1]), command, stat_cpu_seconds(fields))
    return table


def server_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes under `root` (`dspark serve`), by part: the backend
    stub (model.py), the engine process (the stub's child), tritonserver and the launcher."""
    table = _process_table()
    parts = dict.fromkeys(("stub", "engine", "tritonserver", "launcher"), 0.0)
    kinds = {root: "launcher"}
    pending = [root]
    while pending:
        parent = pending.pop()
        for pid, (ppid, command, _) in table.items():
            if ppid != parent or pid in kinds:
                continue
            if "python_backend_stub" in command:
                kinds[pid] = "stub"
            elif kinds[parent] in ("stub", "engine"):
                kinds[pid] = "engine"
            elif "tritonserver" in command:
                kinds[pid] = "tritonserver"
            else:
                kinds[pid] = kinds[parent]
            pending.append(pid)
    for pid, kind in kinds.items():
        if pid in table:
            parts[kind] += table[pid][2]
    return parts


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children: the load processes
    return usage.ru_utime + usage.ru_stime


def profile(pid: int, level: int, args: argparse.Namespace, tmp: Path, grpc_port: int) -> None:
    """A load long enough for py-spy's `--profile-s` seconds from its 3rd on, sampled; its tables."""
    from pyspy_top import summarize
    from serving_overhead import start_profile

    out = (args.profile_dir or tmp) / f"py-spy-{level}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    profiler = start_profile(pid, out, args.profile_s)
    if profiler is None:
        return
    seconds_per_request = args.max_tokens / (args.steps_per_s * args.tokens_per_step)
    per_stream = max(args.requests_per_stream, int((args.profile_s + 6) / seconds_per_request) + 1)
    run_load(f"localhost:{grpc_port}", level, level * per_stream, args.max_tokens, args.processes or None)
    profiler.wait(args.profile_s + 30)
    print(f"\n# py-spy at {level} streams: {out}\n{summarize(out, 12)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,64,128,256")
    parser.add_argument("--steps-per-s", type=float, default=300.0)
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--processes", type=int, default=0, help="load processes (default: CPU count)")
    parser.add_argument("--ports", default="18500,18501,18502", help="HTTP,gRPC,metrics")
    parser.add_argument("--in-stub", action="store_true", help="the synthetic engine as a thread of the stub")
    parser.add_argument("--instances", type=int, default=1, help="backend stubs (instance_group count)")
    parser.add_argument(
        "--busy-share", type=float, default=0.0,
        help="share of each step the synthetic loop computes holding the GIL (a host-bound GPU loop)",
    )  # fmt: skip
    parser.add_argument("--profile-levels", default="", help="concurrencies to sample with py-spy")
    parser.add_argument("--profile-s", type=float, default=8.0)
    parser.add_argument("--profile-dir", type=Path, help="keep the py-spy samples here")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from serving_overhead import intake_counters, intake_split, metrics_text

    profile_levels = [int(x) for x in args.profile_levels.split(",") if x]
    http_port, grpc_port, metrics_port = (int(p) for p in args.ports.split(","))
    results = []
    with tempfile.TemporaryDirectory(prefix="dspark-ceiling-") as tmp:
        repo = render_repository(
            Path(tmp),
            args.steps_per_s,
            args.tokens_per_step,
            not args.in_stub,
            args.instances,
            args.busy_share,
        )
        log = Path(tmp) / "server.log"
        server = start_server(repo, http_port, grpc_port, metrics_port, log)
        try:
            print(
                f"{'streams':>7} {'offered tok/s':>13} {'tok/s':>9} {'ratio':>6} {'resp/s':>9} "
                f"{'TTFT p50 ms':>11} {'gap p50 ms':>10} {'gap p90 ms':>10} {'errors':>6} | "
                f"{'CPU ms / 1k tokens: stub':>24} {'engine':>6} {'triton':>6} {'load cores':>10}",
                flush=True,
            )
            for level in (int(c) for c in args.concurrency.split(",")):
                cpu_before, load_before, started = server_cpu(server.pid), _children_cpu(), time.monotonic()
                intake_before = intake_counters(metrics_text(metrics_port))
                result = run_load(
                    f"localhost:{grpc_port}",
                    level,
                    level * args.requests_per_stream,
                    args.max_tokens,
                    args.processes or None,
                )
                cpu_after, load_after = server_cpu(server.pid), _children_cpu()
                time.sleep(0.3)  # the stub publishes its metrics every 0.1 s
                intake = intake_split(intake_before, intake_counters(metrics_text(metrics_port)))
                per_1k = {
                    k: 1e6 * (cpu_after[k] - cpu_before[k]) / max(result.output_tokens, 1) for k in cpu_after
                }
                load_cores = (load_after - load_before) / (time.monotonic() - started)  # start-up included
                offered = level * args.steps_per_s * args.tokens_per_step
                ratio = result.tokens_per_s / offered
                print(
                    f"{level:>7} {offered:>13.0f} {result.tokens_per_s:>9.0f} {ratio:>6.2f} "
                    f"{result.responses_per_s:>9.0f} {result.ttft_p50_ms:>11.1f} {result.gap_p50_ms:>10.2f} "
                    f"{result.gap_p90_ms:>10.2f} {result.errors:>6} | {per_1k['stub']:>24.1f} "
                    f"{per_1k['engine']:>6.1f} {per_1k['tritonserver']:>6.1f} {load_cores:>10.2f} | "
                    f"per request, ms: Triton's queue {intake['queue_ms']}, execute {intake['execute_ms']}, "
                    f"execute to first token {intake['to_first_token_ms']} (engine: admission "
                    f"{intake['engine_admission_ms']}, first token {intake['engine_first_token_ms']})",
                    flush=True,
                )
                cpu = {f"cpu_ms_per_1k_tokens_{k}": round(v, 2) for k, v in per_1k.items()}
                results.append(
                    {
                        **asdict(result),
                        "offered_tokens_per_s": offered,
                        **cpu,
                        "load_cores": round(load_cores, 2),
                        "intake": intake,
                    }
                )
            for level in profile_levels:
                profile(server.pid, level, args, Path(tmp), grpc_port)
        finally:
            stop_server(server, (http_port, grpc_port, metrics_port))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"config": config, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
