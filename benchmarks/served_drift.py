"""Does a served engine step slower after a burst of load, and does it stay slower? (issue 18)

Through tritonserver the engine's host phases have run 1.0x to 1.6x their offline time from one run to
the next, at the same level, on the same machine (`benchmarks/RESULTS.md`, sessions 23-30). This keeps
one server up through a schedule of windows and measures, in each window, the offline engine (beside
the server, the same work) right before the served one:

    quiet:  `--windows` windows at `--streams` streams
    burst:  one window at `--burst` streams (the load that came before the slow rounds of session 30)
    after:  `--windows` windows at `--streams` streams
    rested: a pause of `--pause-s`, then `--windows` windows at `--streams` streams

Per window: served / offline tokens/s, the step's wall ms and the host's ms in each phase, served and
offline. A served slowdown that appears after the burst and stays points at the server's processes'
state (the offline engine, in this process, shows the host's own drift beside it); one that comes and
goes in the offline figures too is the host.

    python benchmarks/served_drift.py --out /tmp/drift              # SmolLM2, plain, the user defaults
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load_generator import run_load  # noqa: E402
from serving_ceiling import start_server, stop_server  # noqa: E402
from serving_overhead import MODES, Offline, engine_config, model_repository, served_load  # noqa: E402

from dspark.outputs import STEP_PHASES  # noqa: E402
from dspark.serving.triton_config import DEFAULT_INSTANCES  # noqa: E402

PHASES = tuple(f"host_{phase}_ms" for phase in STEP_PHASES)


def schedule(windows: int, streams: int, burst: int) -> list[tuple[str, int]]:
    """The windows in order: (label, streams); the pause comes before the first "rested" window."""
    return (
        [("quiet", streams)] * windows
        + [("burst", burst)]
        + [("after", streams)] * windows
        + [("rested", streams)] * windows
    )


def served_window(url: str, metrics_port: int, streams: int, requests: int, max_tokens: int) -> dict:
    """One load at `streams` streams: the load generator's figures and the served loop's shares."""
    result, loop, _, _ = served_load(url, metrics_port, streams, requests, max_tokens)
    return asdict(result) | {"loop": loop}


def table(rows: list[dict]) -> str:
    """One line a window: served / offline, step ms and every host phase, offline / served."""
    head = ["window", "label", "streams", "served/offline", "step_ms off / srv", *(p for p in PHASES)]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|---:|---:|---:|" + "---:|" * len(PHASES)]
    for row in rows:
        offline, served = row["offline_loop"], row["loop"]
        cells = [
            str(row["window"]),
            row["label"],
            str(row["streams"]),
            f"{row['tokens_per_s'] / row['offline_tokens_per_s']:.2f}",
            f"{offline['step_ms']} / {served['step_ms']}",
            *(f"{offline.get(p, 0)} / {served.get(p, 0)}" for p in PHASES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="off", choices=sorted(MODES))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--windows", type=int, default=4, help="windows in each of quiet, after, rested")
    parser.add_argument("--pause-s", type=float, default=30.0, help="idle before the rested windows")
    parser.add_argument("--requests-per-stream", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--instances", type=int, default=DEFAULT_INSTANCES)
    parser.add_argument("--ports", default="18610,18611,18612")
    parser.add_argument("--out", type=Path, default=Path("/tmp/dspark-drift"))
    args = parser.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    # What `dspark serve` runs by default on both sides (max_num_seqs 256, the KV cache sized at start).
    config = engine_config(args.mode, max(args.streams, args.burst), user_defaults=True)
    offline = Offline(config, args.max_tokens, args.requests_per_stream)
    repo = model_repository(args.out, config, args.instances)
    server = start_server(repo, *ports, args.out / "server.log")
    url = f"localhost:{ports[1]}"
    rows: list[dict] = []
    try:
        run_load(url, 8, 8, 16)  # warm-up
        for window, (label, streams) in enumerate(schedule(args.windows, args.streams, args.burst)):
            if label == "rested" and rows[-1]["label"] != "rested":
                time.sleep(args.pause_s)
            rate, _, offline_loop = offline.measure(streams)
            requests = args.requests_per_stream * streams
            row = served_window(url, ports[2], streams, requests, args.max_tokens)
            row |= {"window": window, "label": label, "streams": streams}
            row |= {"offline_tokens_per_s": rate, "offline_loop": offline_loop}
            rows.append(row)
            print(
                f"window {window} {label} {streams} streams: served {row['tokens_per_s']:.0f} tok/s, "
                f"offline {rate:.0f}, step ms {offline_loop['step_ms']} / {row['loop']['step_ms']}",
                flush=True,
            )
    finally:
        stop_server(server, ports)
        offline.close()
    markdown = table(rows)
    print(markdown)
    (args.out / "drift.md").write_text(markdown + "\n")
    meta = vars(args) | {"out": str(args.out)}
    (args.out / "drift.json").write_text(json.dumps({"args": meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
