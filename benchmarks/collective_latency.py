"""Latency of one all-reduce between the GPUs of this host, the floor under a tensor-parallel step.

    python3 benchmarks/collective_latency.py --out /tmp/collectives        # NCCL on 2+ GPUs
    python3 benchmarks/collective_latency.py --out /tmp/collectives --cpu  # gloo, any machine

A tensor-parallel decode step of a Qwen3-8B-shaped model does two all-reduces a layer (73 in all
with the embedding's), each of [tokens, hidden] bf16. If one costs tens of microseconds a step pays a
few milliseconds; if the host gives NCCL no peer-to-peer path between its GPUs and it falls back to
copies through host memory, it costs far more, and no engine change helps. This measures it: for
each message size, the mean wall time of back-to-back all-reduces (`torch.distributed`, one process
per rank, spawned), and, on CUDA, the same inside a CUDA graph (what a captured TP step would pay).
Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (4096, 4096 * 8, 4096 * 64, 4096 * 512)  # elements: hidden x tokens of 1, 8, 64, 512 tokens
REPEATS = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, repeats: int, cuda: bool) -> float:
    """Mean seconds of fn() over `repeats` calls, after a warm-up."""
    for _ in range(10):
        fn()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def _rank(rank: int, size: int, port: int, cpu: bool, results: dict) -> None:
    cuda = not cpu
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    rows = []
    for elements in SIZES:
        x = torch.ones(elements, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
        eager = _timed(lambda x=x: dist.all_reduce(x), REPEATS, cuda)
        row = {"elements": elements, "bytes": x.numel() * x.element_size(), "eager_us": eager * 1e6}
        if cuda:
            try:
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    dist.all_reduce(x)
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph):
                    for _ in range(10):
                        dist.all_reduce(x)
                row["graph_us"] = _timed(graph.replay, REPEATS // 10, cuda) / 10 * 1e6
                # A graph holding NCCL work pins the communicator: destroying the group would hang.
                torch.cuda.synchronize()
                del graph
            except Exception as exc:  # capture unsupported here: say so, keep the eager figures
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        results["rows"] = rows
    dist.destroy_process_group()


def _topology() -> str:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    """Measure and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="gloo between CPU processes")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} GPUs, sees {torch.cuda.device_count()} (or pass --cpu)")
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank, args=(args.ranks, _free_port(), args.cpu, shared), nprocs=args.ranks, join=True)
        rows = list(shared["rows"])
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    report = {
        "date": date.today().isoformat(),
        "backend": "gloo" if args.cpu else "nccl",
        "ranks": args.ranks,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "nccl_env": env,
        "topology": "" if args.cpu else _topology(),
        "rows": rows,
    }
    lines = [
        f"# All-reduce latency, {report['ranks']} ranks, {report['backend']} on {report['device']} "
        f"({report['date']})",
        "",
        "| elements | bytes | eager µs | in a CUDA graph µs |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        graph = f"{r['graph_us']:.1f}" if "graph_us" in r else r.get("graph_error", "-")
        lines.append(f"| {r['elements']} | {r['bytes']} | {r['eager_us']:.1f} | {graph} |")
    if env:
        lines += ["", f"NCCL environment: {env}"]
    if report["topology"]:
        lines += ["", "```", report["topology"].rstrip(), "```"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
