"""What the server keeps of the engine's speed: the offline engine against the same engine behind
tritonserver (`dspark serve`, gRPC streaming, the multi-process load generator), side by side in one
run, per concurrency and speculation mode; greedy, `--max-tokens` tokens, ignore_eos.

    python benchmarks/serving_overhead.py --levels 1,8,64,128,256 --out /tmp/overhead

The offline engine lives beside the server and each level's offline figure is measured right before
its served one (`Offline`), over the same work (`--requests-per-stream` batches of `level` prompts back
to back, as the served streams run that many requests each: until session 24 one batch, a window of
~0.15 s against the served one's ~1.3 s at 8 streams): the H200 host's speed drifts within a call,
and offline levels measured minutes before the served ones gave ratios that moved with the drift.
Even side by side, one pair moves a lot: the same offline batch of 256 stepped in 5.1 ms and then
8.8 ms a step, back to back (session 22, engine_process_check.py), and single pairs gave plain at 64
streams 0.70, 0.98 and 1.07 in three calls.
So `--rounds N` (default 3) measures every level's pair N times, in turn over the levels, and the table
gives the median of the rounds' served/offline ratios with their range; the loop tables show the round
whose ratio is the median (the lower middle one for an even N).

Writes overhead.json and overhead.md under --out. `--modes` picks the engine configurations:
`off` (plain decoding), `default` (the serve default), `static` (the default without its gate: every
step drafts the block), `default-inprocess` (the default with the engine in the adapter's process:
engine_process false, the design before the engine process); `off-unpaced` / `default-unpaced` (a
response whenever the engine commits; each after its own mode, whose offline figures it shares) and
`off-paced` / `default-paced` (max_responses_per_s 500, a quarter of the default; offline figures
of their own, measured beside each served round like every other mode's).
`--user-defaults`: both sides run what `dspark serve` runs by default (max_num_seqs, the KV cache
sized at start) instead of room for exactly the largest level.
`--profile-levels 64,256` then runs a longer load at those levels (at least 10 requests a stream),
untimed, while py-spy (when installed) samples the server's Python processes: collapsed stacks in
`<out>/<mode>/py-spy-<level>.txt`.
Each side's loop (the offline engine's, the served engine process's main thread) also reports its
thread's CPU share of the window and its involuntary context switches a second (`loop_thread_*`,
from /proc): a loop descheduled by the server's other processes runs at a CPU share below the offline
one's; a loop that runs as often but slower (its caches shared with busy neighbours) does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, fields
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agreement import OfflineEngine, loop_shares, timed_generate, use_prompts  # noqa: E402
from load_generator import LoadResult, run_load  # noqa: E402
from serving_ceiling import _process_table, start_server, stat_cpu_seconds, stat_fields, stop_server  # noqa: E402

from dspark.config import EngineConfig  # noqa: E402
from dspark.outputs import STEP_PHASES, LoopTotals, gate_rows  # noqa: E402
from dspark.runner.cuda_graphs import next_pow2  # noqa: E402
from dspark.serving.triton_config import (  # noqa: E402
    DEFAULT_INSTANCES,
    DEFAULT_MODEL_REPOSITORY,
    render_config_pbtxt,
)
from dspark_client.prompts import read_prompts  # noqa: E402

MODES = {
    "off": {"spec_mode": "off"},
    "default": {},
    # A fixed draft length (no gate): does a served drafting step cost more than an offline one by itself?
    "static": {"adaptive_speculation": False},
    # The serve default without prompt lookup: the drafter drafts every block.
    "default-nolookup": {"prompt_lookup": False},
    "default-inprocess": {"engine_process": False},
    # Each step waits for its device work before the next is scheduled (on a CPU, where the device is
    # the host: does the overlap's concurrent emit cost the served plain step?).
    "off-nooverlap": {"spec_mode": "off", "overlap_scheduling": False},
    # Responses unpaced (one whenever the engine commits): the same engines, the served side only.
    "off-unpaced": {"spec_mode": "off", "max_responses_per_s": 0},
    "default-unpaced": {"max_responses_per_s": 0},
    # Fewer responses (each stub paces at a quarter of the default): does less CPU beside the engine
    # (backend stubs, tritonserver, clients) lift the served engine's step at 1-8 streams?
    "off-paced": {"spec_mode": "off", "max_responses_per_s": 500},
    "default-paced": {"max_responses_per_s": 500},
    # Decode bursts of 4 on both sides: the host schedules, accepts and emits once for four steps.
    "off-burst4": {"spec_mode": "off", "decode_burst": 4},
    "default-burst4": {"decode_burst": 4},
    # Bursts with a larger step token budget: a served load's prompts in one step between bursts rather
    # than chunked over two or three (at 256 streams a burst's arrivals outgrow 512 tokens less the windows).
    "off-burst4-mbt2048": {"spec_mode": "off", "decode_burst": 4, "max_num_batched_tokens": 2048},
    "default-burst4-mbt2048": {"decode_burst": 4, "max_num_batched_tokens": 2048},
    # A step budget of 1024 tokens replayed from graphs up to that size: at 256 streams the default's
    # windows may verify up to three drafts (two while prompts wait) instead of one (none), and a
    # burst's arrivals fit one step (session 47: 0.80 served/offline there, 0.95x plain offline).
    "off-mbt1024": {"spec_mode": "off", "max_num_batched_tokens": 1024, "cuda_graph_max_tokens": 1024},
    "default-mbt1024": {"max_num_batched_tokens": 1024, "cuda_graph_max_tokens": 1024},
}
# Modes whose engine is another mode's (only the server differs): their offline figures are that one's.
OFFLINE_OF = {"off-unpaced": "off", "default-unpaced": "default"}


def engine_config(mode: str, max_seqs: int, user_defaults: bool = False) -> EngineConfig:
    """The configuration both sides of a mode run: room for every stream at once, or (user_defaults)
    what `dspark serve` runs by default: max_num_seqs 256 and the KV cache sized at start."""
    if user_defaults:
        return EngineConfig(**MODES[mode])
    pages = max_seqs * 16  # 256 tokens of context per stream, in pages of 16
    return EngineConfig(max_num_seqs=max_seqs, num_kv_pages=pages, **MODES[mode])


class Offline(OfflineEngine):
    """The offline engine, alive beside the server so that each level's offline figure is measured right
    before its served one: this host's speed drifts within a call (offline plain at 64 streams ran 24.7k
    and 39.4k tok/s in two calls, and one call's levels moved by 2x). Keeps and prints each level's."""

    def __init__(self, config: EngineConfig, max_tokens: int, repeats: int = 1) -> None:
        super().__init__(config, max_tokens)
        self.repeats = repeats  # batches a measurement: the served side's requests a stream
        self.tokens: dict[int, list[list[int]]] = {}  # each batch size's first run

    def measure(self, batch: int) -> tuple[float, list[list[int]], dict]:
        """`OfflineEngine.measure` of `self.repeats` batches, printed, with this (the loop's) thread's
        clock (`thread_shares`); its tokens kept (the first run of each batch size)."""
        self.warm_up(batch)
        me = (os.getpid(), threading.get_native_id())
        clock, started = thread_clock(*me), time.perf_counter()
        rate, tokens, loop = timed_generate(self.llm, batch, self.params, self.repeats)
        loop |= thread_shares(clock, thread_clock(*me), time.perf_counter() - started)
        self.tokens.setdefault(batch, tokens)
        print(f"offline {batch:>4} streams: {rate:.0f} tok/s, loop {loop}", flush=True)
        return rate, tokens, loop

    def gate(self) -> list[dict]:
        """The offline engine's adaptive gate's view now (`gate_rows`; empty without a gate)."""
        gate = self.llm.engine.gate
        return gate_rows(gate.view()) if gate is not None else []


def thread_clock(pid: int, tid: int) -> tuple[float, int]:
    """CPU seconds one thread has run and the times it was descheduled while it could run (involuntary
    context switches), so far (Linux /proc; zeros where unreadable)."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except OSError:
        return 0.0, 0
    switches = re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", status)
    return stat_cpu_seconds(stat_fields(stat)), int(switches.group(1)) if switches else 0


def thread_shares(before: tuple[float, int], after: tuple[float, int], seconds: float) -> dict[str, float]:
    """A loop thread's CPU share of a window of `seconds` and its involuntary switches a second, from
    two `thread_clock` readings around it."""
    seconds = max(seconds, 1e-9)
    return {
        "loop_thread_cpu_share": round((after[0] - before[0]) / seconds, 3),
        "loop_thread_preempted_per_s": round((after[1] - before[1]) / seconds, 1),
    }


def engine_pids(server_pid: int) -> list[int]:
    """The served engine processes under `server_pid`: the spawned children of a backend stub (a
    tensor-parallel rank, spawned by an engine process, is not one). Each one's loop is its main
    thread."""
    table = _process_table()
    spawned = {pid for pid, (_, command, _) in table.items() if "spawn_main" in command}
    return [pid for pid in process_tree(server_pid, table) if pid in spawned and table[pid][0] not in spawned]


def process_tree(root: int, table: dict[int, tuple[int, str, float]]) -> list[int]:
    """`root` and every process below it, from a `_process_table`."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


def metrics_text(metrics_port: int) -> str:
    """The server's metrics now (the stub publishes its own at most 0.1 s after each step: wait a
    little after a load before reading)."""
    return urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics", timeout=10).read().decode()


GATE_GAUGES = {
    "dspark_spec_gate_step_seconds": "step_seconds",
    "dspark_spec_gate_chosen_steps": "chosen_steps",
    "dspark_spec_gate_tokens_per_request": "tokens_per_request",
}


def served_gate(text: str) -> list[dict]:
    """The served engine's adaptive gate's view, from its `dspark_spec_gate_*` gauges in `metrics_text`:
    one dict a tier and draft length (as `gate_rows`, without the measured steps)."""
    rows: dict[tuple[int, int], dict] = {}
    tokens: dict[int, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name not in GATE_GAUGES or 'model="dspark"' not in line:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].rsplit("}", 1)[0]))
        value, length = float(line.rsplit(" ", 1)[1]), int(labels["length"])
        if "tier" not in labels:
            tokens[length] = value
            continue
        key = (int(labels["tier"]), length)
        rows.setdefault(key, {"tier": key[0], "length": length})[GATE_GAUGES[name]] = value
    for row in rows.values():
        row["tokens_per_request"] = tokens.get(row["length"])
    return [rows[key] for key in sorted(rows)]


def served_loop_totals(text: str) -> LoopTotals:
    """The served engine's loop totals, from its `dspark_engine_*_total` counters in `metrics_text`."""
    values = {}
    for line in text.splitlines():
        if line.startswith("dspark_engine_"):
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            values[name.removeprefix("dspark_engine_").removesuffix("_total")] = float(value)
    return LoopTotals(**{f.name: type(f.default)(values.get(f.name, 0)) for f in fields(LoopTotals)})


# Where a request's time to its first token goes, from the server's own counters: Triton's queue
# (before the backend's execute), the backend's execute (the stub's intake: inputs, tokenization, the
# hand-over to the engine process), from execute to the first token's arrival in the stub (its TTFT
# histogram), and within that the engine's share: from the hand-over to the loop's admission (the
# engine process's intake) and to the first token's delta (the engine's queue and prefill).
INTAKE_COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
    "dspark_time_to_first_token_seconds_sum",
    "dspark_time_to_first_token_seconds_count",
    "dspark_engine_admitted_requests_total",
    "dspark_engine_intake_wait_seconds_total",
    "dspark_engine_first_token_seconds_total",
)


def intake_counters(text: str) -> dict[str, float]:
    """The INTAKE_COUNTERS of the model `dspark`, from `metrics_text`."""
    values = dict.fromkeys(INTAKE_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values and 'model="dspark"' in line:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def intake_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per request between two readings, in ms: the mean wait in Triton's queue, in the backend's
    execute, from execute to the first token (a mean of the stub's sampled histogram), and of that in
    the engine: from the hand-over to admission and to the first token's delta."""
    moved = {name: after[name] - before[name] for name in INTAKE_COUNTERS}
    requests = max(moved["nv_inference_request_success"], 1.0)
    first = max(moved["dspark_time_to_first_token_seconds_count"], 1.0)
    admitted = max(moved["dspark_engine_admitted_requests_total"], 1.0)
    return {
        "queue_ms": round(moved["nv_inference_queue_duration_us"] / requests / 1e3, 2),
        "execute_ms": round(moved["nv_inference_compute_infer_duration_us"] / requests / 1e3, 2),
        "to_first_token_ms": round(1e3 * moved["dspark_time_to_first_token_seconds_sum"] / first, 2),
        "engine_admission_ms": round(1e3 * moved["dspark_engine_intake_wait_seconds_total"] / admitted, 2),
        "engine_first_token_ms": round(1e3 * moved["dspark_engine_first_token_seconds_total"] / admitted, 2),
    }


def pin_server(server_pid: int, engine_cpus: set[int]) -> str:
    """Pin every thread of the served engine process (the spawned child of the backend stub) to
    `engine_cpus` and every other thread of the server, and this process (so the load generator's
    workers inherit it), to the remaining CPUs: does sharing cores with the server's other processes
    slow the engine's loop? Returns what was pinned."""
    table = _process_table()
    tree = process_tree(server_pid, table)
    engines = [pid for pid in tree if "spawn_main" in table.get(pid, (0, "", 0))[1]]
    others = set(os.sched_getaffinity(0)) - engine_cpus
    for pid in tree:
        cpus = engine_cpus if pid in engines else others
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass
    os.sched_setaffinity(0, others)
    return f"engine process {engines} on CPUs {sorted(engine_cpus)}, the rest on {len(others)} others"


def model_repository(root: Path, config: EngineConfig, instances: int) -> Path:
    """A model repository under `root` holding the `dspark` model with `config` and `instances` stubs."""
    repo = root / "model_repository"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(
        DEFAULT_MODEL_REPOSITORY / "dspark", repo / "dspark", ignore=shutil.ignore_patterns("__pycache__")
    )
    (repo / "dspark" / "config.pbtxt").write_text(render_config_pbtxt(config, instances=instances))
    return repo


def served_load(
    url: str,
    metrics_port: int,
    streams: int,
    requests: int,
    max_tokens: int,
    engine_pid: int = 0,
    prompts: list[str] | None = None,
    params: dict | None = None,
    client_processes: int = 0,
) -> tuple[LoadResult, dict, str, str]:
    """One load of `requests` over `streams` streams (`params`: sampling parameters over the load
    generator's; `client_processes`: its worker processes, 0: one a CPU), the load generator's result,
    the served loop's shares over it (`loop_shares`; with `engine_pid`, its loop thread's clock:
    `thread_shares`), and the server's metrics text before and after it."""
    time.sleep(0.3)  # the last load's counters published
    before = metrics_text(metrics_port)
    clock = thread_clock(engine_pid, engine_pid) if engine_pid else None
    result = run_load(
        url, streams, requests, max_tokens, client_processes or None, params=params, prompts=prompts
    )
    threads = thread_shares(clock, thread_clock(engine_pid, engine_pid), result.seconds) if clock else {}
    time.sleep(0.3)
    after = metrics_text(metrics_port)
    loop = loop_shares(
        served_loop_totals(before), served_loop_totals(after), result.seconds, result.output_tokens
    )
    return result, loop | threads, before, after


def served(
    config: EngineConfig,
    levels: list[int],
    max_tokens: int,
    root: Path,
    ports: list[int],
    profile_levels: tuple[int, ...] = (),
    profile_s: float = 6.0,
    engine_cpus: set[int] | None = None,
    requests_per_stream: int = 2,
    offline: Offline | None = None,
    instances: int = DEFAULT_INSTANCES,
    rounds: int = 1,
    prompts: list[str] | None = None,
    client_processes: int = 0,
) -> dict[int, list[dict]]:
    """The same engine behind `dspark serve`: per concurrency, each round's load generator result with
    the served loop and intake figures (and, in the last round at `profile_levels`, py-spy's samples of
    the server's Python processes while the load runs). `offline`: measured at each level right before
    each served load (`offline_tokens_per_s`, `offline_loop` in the round's figures)."""
    repo = model_repository(root, config, instances)
    started = time.monotonic()
    server = start_server(repo, *ports, root / "server.log")
    print(f"server ready in {time.monotonic() - started:.0f} s", flush=True)
    everything = os.sched_getaffinity(0)
    if engine_cpus:
        print(pin_server(server.pid, engine_cpus), flush=True)
    engines = engine_pids(server.pid)
    engine_pid = engines[0] if len(engines) == 1 else 0  # one engine process: its loop is timed
    results: dict[int, list[dict]] = {level: [] for level in levels}
    url = f"localhost:{ports[1]}"
    try:
        run_load(url, 8, 8, 16)  # warm-up
        for r, level in ((r, level) for r in range(rounds) for level in levels):
            offline_figures = {}
            if offline is not None:
                rate, _, offline_loop = offline.measure(level)
                offline_figures = {
                    "offline_tokens_per_s": rate,
                    "offline_loop": offline_loop,
                    "offline_gate": offline.gate(),
                }
            result, loop, before, after = served_load(
                url,
                ports[2],
                level,
                requests_per_stream * level,
                max_tokens,
                engine_pid,
                prompts,
                client_processes=client_processes,
            )
            intake = intake_split(intake_counters(before), intake_counters(after))
            if level in profile_levels and r == rounds - 1:  # a longer run, sampled, not timed
                profiler = start_profile(server.pid, root / f"py-spy-{level}.txt", profile_s)
                run_load(url, level, max(10 * level, 1280), max_tokens, prompts=prompts)
                if profiler is not None:
                    profiler.wait(profile_s + 30)
            figures = {"loop": loop, "intake": intake, "gate": served_gate(after)}
            results[level].append(asdict(result) | figures | offline_figures)
            print(
                f"round {r} server {level:>4} streams: {result.tokens_per_s:.0f} tok/s, "
                f"TTFT p50 {result.ttft_p50_ms:.1f} ms, {result.responses_per_s:.0f} responses/s, "
                f"errors {result.errors}, intake {intake}, loop {loop}",
                flush=True,
            )
    finally:
        os.sched_setaffinity(0, everything)
        stop_server(server, ports)
    return results


def start_profile(pid: int, out: Path, seconds: float) -> subprocess.Popen | None:
    """py-spy (when installed) sampling `pid` and its child processes (tritonserver's backend stub, the
    engine process) for `seconds`, from 3 s on (the load's start), as collapsed stacks in `out` (running
    threads only: where each process spends its CPU; benchmarks/pyspy_top.py summarizes them)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        print("py-spy not installed: no profile", flush=True)
        return None
    command = [py_spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking"]
    command += ["--rate", "200", "--duration", str(int(seconds)), "--format", "raw", "--output", str(out)]
    return subprocess.Popen(
        ["bash", "-c", 'sleep 3 && exec "$@"', "py-spy", *command],
        stdout=subprocess.DEVNULL,
        stderr=(out.parent / f"{out.stem}.log").open("wb"),
    )


def summarize(rounds: list[dict], offline_of: list[dict] | None = None) -> dict:
    """One level's rounds (`served`) in one entry: the round whose served/offline ratio is the median
    (the lower middle one for an even count; the last round without offline figures), with the medians
    of the rounds' tokens/s, served and offline, and TTFT p50, the ratios of every round (`ratios`) and
    their median (`ratio`). offline_of: another mode's rounds whose offline figures these share."""
    offline_rounds = offline_of or rounds
    ratios = [
        round(served["tokens_per_s"] / offline["offline_tokens_per_s"], 3)
        for served, offline in zip(rounds, offline_rounds, strict=False)
        if offline.get("offline_tokens_per_s")
    ]
    pick = sorted(range(len(ratios)), key=ratios.__getitem__)[(len(ratios) - 1) // 2] if ratios else -1
    entry = dict(rounds[pick])
    if offline_of:
        entry["offline_loop"] = offline_of[pick].get("offline_loop", {})
        entry["offline_gate"] = offline_of[pick].get("offline_gate", [])
    entry["tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in rounds), 1)
    entry["ttft_p50_ms"] = round(statistics.median(r["ttft_p50_ms"] for r in rounds), 2)
    offline_rates = [r["offline_tokens_per_s"] for r in offline_rounds if r.get("offline_tokens_per_s")]
    entry["offline_tokens_per_s"] = round(statistics.median(offline_rates), 1) if offline_rates else None
    entry["ratios"] = ratios
    entry["ratio"] = round(statistics.median(ratios), 3) if ratios else None
    steady = [
        round(served["steady_tokens_per_s"] / offline["offline_tokens_per_s"], 3)
        for served, offline in zip(rounds, offline_rounds, strict=False)
        if offline.get("offline_tokens_per_s") and served.get("steady_tokens_per_s")
    ]
    entry["steady_ratio"] = round(statistics.median(steady), 3) if steady else None
    return entry


def table(levels: list[int], runs: dict) -> str:
    """Markdown: per mode, the medians over the rounds of the offline and served tokens/s, the median of
    the rounds' served/offline ratios and their range, the same ratio for the served tokens/s while
    every stream ran (`load_generator.steady_window`: without the closed loop's ragged end), and the
    served TTFT p50."""
    modes = [m for m, run in runs.items() if isinstance(run, dict) and "server" in run]
    head = "| streams | " + " | ".join(
        f"{m} offline tok/s | {m} server tok/s | {m} server/offline (range) | {m} steady/offline"
        for m in modes
    )
    head += " | " + " | ".join(f"{m} TTFT p50 ms" for m in modes) + " |"
    lines = [head, "|" + "---:|" * (1 + 5 * len(modes))]
    for level in levels:
        cells = []
        for mode in modes:
            entry = runs[mode]["server"].get(level, {})
            ratios = entry.get("ratios") or []
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            ratio = f"{entry['ratio']:.2f}{spread}" if entry.get("ratio") else "-"
            steady = f"{entry['steady_ratio']:.2f}" if entry.get("steady_ratio") else "-"
            offline = entry.get("offline_tokens_per_s") or "-"
            cells += [f"{offline}", f"{entry.get('tokens_per_s', '-')}", ratio, steady]
        cells += [f"{runs[m]['server'].get(level, {}).get('ttft_p50_ms', '-')}" for m in modes]
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loop_table(levels: list[int], runs: dict) -> str:
    """Markdown: the engine loop offline and served, per mode and level (`agreement.loop_shares`)."""
    keys = ("steps_per_s", "requests_per_step", "tokens_per_step", "drafts_per_request", "graph", "ahead")
    keys += (
        "prefill",
        "burst",
        "burst_length",
        "in_steps",
        "step_ms",
        "prefill_step_ms",
        "decode_step_ms",
        "accept_ms",
    )
    keys += (
        "intake_ms",
        "handover_ms",
        "gc_ms",
        "gc_full",
        "loop_thread_cpu_share",
        "loop_thread_preempted_per_s",
    )
    loop = _loop_rows(
        levels,
        runs,
        keys,
        "Engine loop, offline / served (`agreement.loop_shares`): steps/s, requests and output tokens "
        "per step, drafts a request verified a step, the shares of steps replayed from a graph, "
        "launched ahead, with a prefill chunk and in decode bursts (and the bursts' mean length), the "
        "share of the measured window in step calls, and "
        "per step: wall ms (all steps, those with a prefill chunk, the others), the acceptance's ms "
        "(the host waiting for the device), and the served loop's ms between steps taking in commands "
        "and handing over deltas (0 offline); the garbage collector's ms a step and its full passes in the "
        "window; the loop thread's CPU share of the window and its "
        "involuntary context switches a second (`thread_shares`)",
    )
    phases = _loop_rows(
        levels,
        runs,
        tuple(f"host_{phase}_ms" for phase in STEP_PHASES),
        "The host's ms per step in each phase of the step, offline / served (they add up to about "
        "step_ms; `accept` holds the wait for the device)",
    )
    return loop + "\n\n" + phases


def gate_table(levels: list[int], runs: dict) -> str:
    """Markdown: the adaptive gate's view after each level's chosen round, offline / served, per mode
    with a gate and level, in the level's tier (its power of two of decoding requests): per draft
    length, the median ms of a step it measured, the tokens a request it expects a step and its share
    of the tier's steps so far (`SpeculationGate.view`; served: the `dspark_spec_gate_*` gauges)."""
    lines = [
        "The adaptive gate's view at the end of each level's chosen round, offline / served, in the "
        "level's tier: per draft length, the ms of a step it measured (median of its latest), the "
        "tokens a request it expects a step, and the share of the tier's steps it chose that length, "
        "since the engine started",
        "",
        "| mode | streams | tier | length | step ms | tokens a request | share of steps |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for mode, run in runs.items():
        if not isinstance(run, dict) or "server" not in run:
            continue
        for level in levels:
            entry = run["server"].get(level, {})
            tier = next_pow2(level)
            sides = [
                {r["length"]: r for r in entry.get(key, []) if r["tier"] == tier}
                for key in ("offline_gate", "gate")
            ]
            if not any(sides):
                continue
            totals = [sum(r.get("chosen_steps", 0) for r in side.values()) or 1 for side in sides]
            for length in sorted(set(sides[0]) | set(sides[1])):
                rows = [side.get(length, {}) for side in sides]
                ms = [f"{1e3 * r['step_seconds']:.3f}" if r.get("step_seconds") else "-" for r in rows]
                tokens = [
                    f"{r['tokens_per_request']:.2f}" if r.get("tokens_per_request") else "-" for r in rows
                ]
                shares = [
                    f"{r.get('chosen_steps', 0) / total:.2f}" for r, total in zip(rows, totals, strict=True)
                ]
                lines.append(
                    f"| {mode} | {level} | {tier} | {length} | {' / '.join(ms)} | {' / '.join(tokens)} "
                    f"| {' / '.join(shares)} |"
                )
    return "\n".join(lines)


# The client's figures in the intake table (load_generator.LoadResult's fields).
CLIENT_KEYS = ("ttft_p50_ms", "final_gap_p50_ms", "resend_p50_ms", "start_spread_ms", "end_spread_ms")


def intake_table(levels: list[int], runs: dict) -> str:
    """Markdown: where a served request's time before its first token went (`intake_split`), per mode
    and level, beside the client's TTFT."""
    keys = ("queue_ms", "execute_ms", "to_first_token_ms", "engine_admission_ms", "engine_first_token_ms")
    lines = [
        "Served requests' time before their first token, mean ms per request (`intake_split`): in "
        "Triton's queue, in the backend's execute, from execute to the first token; of that, in the "
        "engine process, from the hand-over to admission and to the first token; and the client's "
        "TTFT p50, the p50 gap before a request's final response (its end's trip through the server) "
        "and from a final response to the stream's next send; how far apart the streams started and "
        "ended (ms between the first and the last)",
        "",
        "| mode | streams | " + " | ".join(keys) + " | TTFT p50 ms | final gap p50 ms | resend p50 ms "
        "| start spread ms | end spread ms |",
        "|---|---:|" + "---:|" * (len(keys) + 5),
    ]
    for mode, run in runs.items():
        if not isinstance(run, dict) or "server" not in run:
            continue
        for level in levels:
            served = run["server"].get(level, {})
            intake = served.get("intake", {})
            cells = [f"{intake.get(k, '-')}" for k in keys]
            cells += [f"{served.get(k, '-')}" for k in CLIENT_KEYS]
            lines.append(f"| {mode} | {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _loop_rows(levels: list[int], runs: dict, keys: tuple[str, ...], title: str) -> str:
    """A titled table of `keys` of the loop figures, "offline / served" per mode and level."""
    lines = [title, "", "| mode | streams | " + " | ".join(keys) + " |", "|---|---:|" + "---:|" * len(keys)]
    for mode, run in runs.items():
        if not isinstance(run, dict) or "server" not in run:
            continue
        for level in levels:
            offline = run["server"].get(level, {}).get("offline_loop", {})
            server = run["server"].get(level, {}).get("loop", {})
            cells = [f"{offline.get(k, '-')} / {server.get(k, '-')}" for k in keys]
            lines.append(f"| {mode} | {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,8,64,128,256")
    parser.add_argument(
        "--modes",
        default="off,default",
        help=f"of {', '.join(MODES)} (an -unpaced mode after its own)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ports", default="18600,18601,18602")
    parser.add_argument("--out", type=Path, default=Path("/tmp/dspark-overhead"))
    parser.add_argument("--profile-levels", default="", help="concurrencies to sample with py-spy")
    parser.add_argument("--profile-s", type=float, default=6.0)
    parser.add_argument("--served-only", action="store_true", help="skip the offline engine")
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="served side: each closed-loop stream's requests, one after the other (more: the start-up "
        "burst and the last requests' tail weigh less against steady load)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="pairs (offline, then served) measured per level, in turn over the levels: the table gives "
        "the median ratio and its range",
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=DEFAULT_INSTANCES,
        help="served side: backend stubs sharing the engine (the instance_group count)",
    )
    parser.add_argument(
        "--engine-cpus",
        default="",
        help="served side: pin the engine process to these CPUs (e.g. 0,8: a core and its sibling) and "
        "the rest of the server and the load generator to the others (`pin_server`)",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='both sides\' prompts: a .jsonl file of {"prompt": ...} or one a line (default: '
        "`dspark-client bench`'s questions)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=0,
        help="served side: the load generator's worker processes (0: one a CPU, at most one a stream): "
        "fewer leave more cores idle beside the engine, as clients on other machines would",
    )
    parser.add_argument(
        "--user-defaults",
        action="store_true",
        help="both sides run the engine's defaults but the mode (max_num_seqs, the KV cache sized at "
        "start; the offline engine's cache is sized first, the server's from what is left)",
    )
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts) if args.prompts else None
    if prompts is not None:
        use_prompts(prompts)  # the offline side's (`agreement.bench_prompts`)
    profile_levels = tuple(int(x) for x in args.profile_levels.split(",") if x)
    levels = [int(x) for x in args.levels.split(",")]
    ports = [int(p) for p in args.ports.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    runs, outputs = {}, {}
    for mode in args.modes.split(","):
        config = engine_config(mode, max(levels), args.user_defaults)
        print(f"=== {mode}: {config}", flush=True)
        engine = None
        if not (mode in OFFLINE_OF and OFFLINE_OF[mode] in runs) and not mode.endswith("inprocess"):
            # The same work offline as served (a batch of `level` prompts per request a stream): the
            # two windows are then as long, and drift within a second weighs on both alike.
            engine = None if args.served_only else Offline(config, args.max_tokens, args.requests_per_stream)
        engine_cpus = {int(c) for c in args.engine_cpus.split(",") if c}
        try:
            server = served(
                config,
                levels,
                args.max_tokens,
                args.out / mode,
                ports,
                profile_levels,
                args.profile_s,
                engine_cpus,
                args.requests_per_stream,
                engine,
                args.instances,
                args.rounds,
                prompts,
                args.client_processes,
            )
        finally:
            if engine is not None:
                engine.close()
        if engine is not None:
            outputs[mode] = engine.tokens
        shared = runs.get(OFFLINE_OF.get(mode, ""), {}).get("rounds")  # the same engine's offline rounds
        summary = {level: summarize(server[level], shared.get(level) if shared else None) for level in levels}
        runs[mode] = {"server": summary, "rounds": server}
        (args.out / "overhead.json").write_text(json.dumps(runs, indent=1))
    markdown = table(levels, runs) + "\n\n" + loop_table(levels, runs) + "\n\n" + intake_table(levels, runs)
    markdown += "\n\n" + gate_table(levels, runs)
    if outputs.get("off") and outputs.get("default"):
        # Greedy with and without speculation, same prompts and batch: identical sequences (exact in
        # fp32; in bf16 the verify window's shape changes the target's rounding, and near-ties flip).
        agreement = {
            level: sum(a == b for a, b in zip(outputs["off"][level], outputs["default"][level], strict=True))
            / len(outputs["off"][level])
            for level in levels
        }
        runs["agreement_default_vs_off"] = agreement
        (args.out / "overhead.json").write_text(json.dumps(runs, indent=1))
        markdown += (
            "\n\nGreedy sequences identical with speculation (default) and without (off), offline: "
            + ", ".join(f"batch {level}: {rate:.0%}" for level, rate in agreement.items())
        )
    (args.out / "overhead.md").write_text(markdown + "\n")
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
