"""Engine configurations through the real server, side by side: one `dspark serve` per configuration,
all up at once, the same closed-loop load sent to each in turn, in an order rotated round by round.

    python benchmarks/served_side_by_side.py --engine plain:spec_mode=off --engine default: \
        --streams 1 --prompts benchmarks/results/cpu-2026-12-04-s33/fresh_everyday_24.jsonl --rounds 3

Why: `serving_overhead.py` serves one mode after another (a server each, minutes apart), so on a host
whose speed drifts by tens of percent within minutes its served ratio between modes moved from 1.19x
to 1.34x between runs, while engines timed in alternation (`side_by_side.py`) keep their ratios. Here
every server is up for the whole run and each round loads each of them once, so a slow spell falls on
all. Per server: median output tokens/s over the rounds, the ratio to the first server's, TTFT and
inter-token gap p50 (medians of the rounds'), tokens a step (the served engine's own counters,
`serving_overhead.served_load`) and
errors. `--engine NAME:FIELD=VALUE,...` as in `side_by_side.py` (an `EngineConfig` with those fields
changed, sized for `--streams`); prompts: `dspark-client bench`'s questions or a file's
(`dspark_client.prompts.read_prompts`), every stream sending each prompt once a round; every request
`--max-tokens` long (ignore_eos), or ended by the target's EOS with `--eos` (as `dspark-client bench`
sends them). `--client-bench ARGS`: each load is instead a run of the client users run, `dspark-client
bench --url URL ARGS`, and its own figures are reported.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_ceiling import start_server, stop_server  # noqa: E402
from serving_overhead import DEFAULT_INSTANCES, model_repository, served_load  # noqa: E402
from side_by_side import parse_engine  # noqa: E402

from dspark.config import EngineConfig  # noqa: E402
from dspark_client.prompts import PROMPTS, read_prompts  # noqa: E402


def summarize(rounds: dict[str, list[dict]]) -> list[dict]:
    """Per server (in the given order): medians over its rounds, and its tokens/s over the first's."""
    rows = []
    first = None
    for name, runs in rounds.items():
        rate = statistics.median(r["tokens_per_s"] for r in runs)
        first = rate if first is None else first
        rows.append(
            {
                "name": name,
                "tokens_per_s": round(rate, 1),
                "ratio": round(rate / first, 3) if first else 0.0,
                "range": [
                    round(min(r["tokens_per_s"] for r in runs), 1),
                    round(max(r["tokens_per_s"] for r in runs), 1),
                ],
                "ttft_p50_ms": round(statistics.median(r["ttft_p50_ms"] for r in runs), 2),
                "gap_p50_ms": round(statistics.median(r["gap_p50_ms"] for r in runs), 2),
                "tokens_per_step": round(statistics.median(r["tokens_per_step"] for r in runs), 3),
                "errors": sum(r["errors"] for r in runs),
            }
        )
        if all("step_ms" in r for r in runs):  # the served engine's own counters (not --client-bench)
            rows[-1]["step_ms"] = round(statistics.median(r["step_ms"] for r in runs), 2)
    return rows


def client_bench_load(url: str, client_args: str, out: Path) -> dict:
    """One run of `dspark-client bench` against `url` with `client_args` (one concurrency level): its
    figures in this tool's terms (tokens a step: the client's acceptance length, 1 without drafts)."""
    client = Path(sys.executable).with_name("dspark-client")
    command = [str(client), "bench", "--url", url, "--json", str(out), *shlex.split(client_args)]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = json.loads(out.read_text())
    if len(rows) != 1:
        raise SystemExit("--client-bench: give one --concurrency level")
    row = rows[0]
    return {
        "tokens_per_s": round(row["output_tokens_per_s"], 1),
        "ttft_p50_ms": round(1e3 * row["ttft_p50_s"], 2),
        "gap_p50_ms": round(1e3 * row["itl_p50_s"], 2),
        "errors": row["errors"],
        "tokens_per_step": round(row["acceptance_length"] or 1.0, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="NAME:FIELD=VALUE,... (repeat)")
    parser.add_argument("--streams", type=int, default=1, help="closed-loop streams per load")
    parser.add_argument("--prompts", type=Path, default=None, help="a .jsonl of {prompt} or one a line")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--client-bench",
        default=None,
        metavar="ARGS",
        help="each load is a run of the client users run, `dspark-client bench --url URL ARGS` (e.g. "
        '"--concurrency 1 --num-prompts 16 --max-tokens 32"): its own tokens/s, TTFT, inter-token '
        "latency and acceptance length; --prompts, --max-tokens and --eos then do not apply (--streams still "
        "sizes the servers: give the client's concurrency)",
    )
    parser.add_argument(
        "--eos",
        action="store_true",
        help="requests end at the target's EOS, as `dspark-client bench` sends them (default: ignore_eos, "
        "every request --max-tokens long)",
    )
    parser.add_argument("--first-port", type=int, default=18700, help="three ports a server from here")
    parser.add_argument("--out", type=Path, default=Path("/tmp/dspark-served-side-by-side"))
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts) if args.prompts else list(PROMPTS)
    params = {"ignore_eos": not args.eos}
    specs = [parse_engine(spec) for spec in args.engine]
    servers, urls = {}, {}
    try:
        for index, (name, changes) in enumerate(specs):
            # Room for every stream at once; a cache of 256 tokens of context a stream.
            config = EngineConfig(max_num_seqs=args.streams, num_kv_pages=16 * args.streams).replace(
                **changes
            )
            root = args.out / name
            root.mkdir(parents=True, exist_ok=True)
            http, grpc, metrics = (args.first_port + 3 * index + k for k in range(3))
            servers[name] = (
                start_server(
                    model_repository(root, config, DEFAULT_INSTANCES),
                    http,
                    grpc,
                    metrics,
                    root / "server.log",
                ),
                metrics,
                (http, grpc, metrics),
            )
            urls[name] = f"localhost:{grpc}"
            print(f"{name}: serving on {urls[name]}", flush=True)

        def load(name: str) -> dict:
            """One load of a server: a run of the client, or the load generator's between two readings
            of the server's counters (`served_load`)."""
            if args.client_bench:
                return client_bench_load(urls[name], args.client_bench, args.out / name / "client.json")
            result, loop, _, _ = served_load(
                urls[name],
                servers[name][1],
                args.streams,
                args.streams * len(prompts),
                args.max_tokens,
                prompts=prompts,
                params=params,
            )
            return {
                "tokens_per_s": result.tokens_per_s,
                "ttft_p50_ms": result.ttft_p50_ms,
                "gap_p50_ms": result.gap_p50_ms,
                "errors": result.errors,
                "tokens_per_step": loop["tokens_per_step"],
                "step_ms": loop["step_ms"],
            }

        for name in servers:  # warm-up: kernels, the gate's first lengths
            load(name)
        names = list(servers)
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                figures = load(name)
                rounds[name].append(figures)
                print(f"round {r} {name}: {json.dumps(figures)}", flush=True)
    finally:
        for server, _, _ in servers.values():
            server.terminate()  # all at once; then each waited for, its ports freed
        for server, _, ports in servers.values():
            stop_server(server, ports)
    rows = summarize(rounds)
    (args.out / "served_side_by_side.json").write_text(
        json.dumps({"rounds": rounds, "summary": rows}, indent=1)
    )
    if args.client_bench:
        print(f"dspark-client bench {args.client_bench}, {args.rounds} rounds")
    else:
        print(
            f"{len(prompts)} prompts, {args.streams} stream(s), up to {args.max_tokens} greedy tokens "
            f"({'to EOS' if args.eos else 'ignore_eos'}), {args.rounds} rounds"
        )
    for row in rows:
        print(
            f"{row['name']:20s} {row['tokens_per_s']:8.1f} tok/s ({row['range'][0]}-{row['range'][1]}) "
            f"{row['ratio']:.3f}x {rows[0]['name']}  TTFT p50 {row['ttft_p50_ms']:.1f} ms  gap p50 "
            f"{row['gap_p50_ms']:.1f} ms  {row['tokens_per_step']:.2f} tokens a step"
            + (f" ({row['step_ms']:.1f} ms a step)" if "step_ms" in row else "")
            + f"  errors {row['errors']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
