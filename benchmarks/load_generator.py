"""A multi-process gRPC streaming load generator, so that the client is never what limits a measurement.

`run_load(url, concurrency, ...)` spreads `concurrency` closed-loop streams over worker processes
(threads inside each, one gRPC stream per thread); each stream sends its requests one after another.
The result counts output tokens and responses over the wall time from the first send to the last
final response, with TTFT and inter-response percentiles. `run_in_processes` and `split_evenly` are the
process plumbing, shared with benchmarks/stress.py.

    python benchmarks/load_generator.py --url localhost:8001 --concurrency 64 --requests 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark_client.bench import PROMPTS  # the prompts `dspark-client bench` sends

START_TIMEOUT_S = 120.0  # a stream starts anyway when not every stream connected by then (one failed)


@dataclass
class StreamStats:
    """What the requests of one worker process measured."""

    requests: int = 0
    errors: list[str] = field(default_factory=list)
    output_tokens: int = 0
    responses: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # seconds between successive responses of a request
    # Seconds from a request's last response before its final one to the final one (its end's trip
    # through the server), and from a final response to the stream's next send (the client's own).
    final_gaps: list[float] = field(default_factory=list)
    resends: list[float] = field(default_factory=list)
    # Per stream, each response's arrival and output tokens (`steady_window`).
    arrivals: list[list[float]] = field(default_factory=list)
    arrival_tokens: list[list[int]] = field(default_factory=list)
    # Per stream that sent a request: its first send and its last request's final response (its first
    # send again when no request of it ended well).
    stream_spans: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class LoadResult:
    """One load level, summed over every worker."""

    concurrency: int
    requests: int
    errors: int
    seconds: float
    output_tokens: int
    responses: int
    tokens_per_s: float
    responses_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    gap_p50_ms: float
    gap_p90_ms: float
    final_gap_p50_ms: float = 0.0
    final_gap_p90_ms: float = 0.0
    resend_p50_ms: float = 0.0
    # Output tokens/s while every stream was running (`steady_window`), and that window's seconds.
    steady_tokens_per_s: float = 0.0
    steady_seconds: float = 0.0
    # How far apart the streams started and ended: the latest first send after the earliest, and the
    # latest last final response after the earliest (a closed loop's ragged start and end).
    start_spread_ms: float = 0.0
    end_spread_ms: float = 0.0
    first_error: str = ""


def _percentile_ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _stream_loop(
    url: str,
    count: int,
    params: dict,
    offset: int,
    stats: StreamStats,
    lock: threading.Lock,
    go: Any,
    report: Callable[[Any], None],
    prompts: list[str],
):
    from dspark_client.streaming import GrpcSession, ServerError

    # Connected before the start: at 256 streams, 256 channels opened inside the measured window cost
    # the 2-core machine's client the time of the first responses.
    session = GrpcSession(url)
    report("ready")
    # Every stream starts at the same moment, once every stream of every process is connected: a start
    # at a set clock time left the processes that were still importing to start late (a ragged start
    # the offline engine does not have).
    go.wait(START_TIMEOUT_S)
    first_sent = None
    ended = None  # when the stream's last request got its final response
    arrivals: list[float] = []
    arrival_tokens: list[int] = []
    try:
        for index in range(count):
            prompt = prompts[(offset + index) % len(prompts)]
            sent = time.monotonic()
            first_sent = sent if first_sent is None else first_sent
            if ended is not None:
                with lock:
                    stats.resends.append(sent - ended)
            last = sent
            tokens = responses = 0
            ttft = None
            gaps = []
            final_gap = None
            try:
                for chunk in session.generate(prompt, params):
                    now = time.monotonic()
                    if ttft is None and chunk.token_ids:
                        ttft = now - sent
                    elif chunk.token_ids:
                        gaps.append(now - last)
                    if chunk.final and responses:
                        final_gap = now - last
                    last = now
                    arrivals.append(now)
                    arrival_tokens.append(len(chunk.token_ids))
                    tokens += len(chunk.token_ids)
                    responses += 1
            except ServerError as exc:
                with lock:
                    stats.errors.append(str(exc))
                continue
            with lock:
                stats.requests += 1
                stats.output_tokens += tokens
                stats.responses += responses
                stats.ttft.append(ttft if ttft is not None else last - sent)
                stats.gaps.extend(gaps)
                if final_gap is not None:
                    stats.final_gaps.append(final_gap)
            ended = last
    finally:
        session.close()
        with lock:
            stats.arrivals.append(arrivals)
            stats.arrival_tokens.append(arrival_tokens)
            if first_sent is not None:
                stats.stream_spans.append((first_sent, ended if ended is not None else first_sent))


def _worker(
    url: str,
    streams: int,
    per_stream: list[int],
    params: dict,
    offset: int,
    go: Any,
    prompts: list[str],
    report: Callable[[Any], None],
) -> dict:
    stats = StreamStats()
    lock = threading.Lock()
    threads = [
        threading.Thread(
            target=_stream_loop,
            args=(url, per_stream[i], params, offset + i, stats, lock, go, report, prompts),
        )
        for i in range(streams)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # monotonic clocks are per boot, shared by the processes of one machine
    return asdict(stats)


def steady_window(arrivals: list[list[float]], tokens: list[list[int]]) -> tuple[float, float]:
    """Output tokens/s and seconds of the window in which every stream was running: from the latest
    stream's first response to the earliest stream's last one. A closed loop of N requests a stream
    starts its streams together but ends them apart (each stream's requests add up their own delays),
    and the tail where fewer streams run is the run's length, not the server's speed. (0, 0) when the
    streams never ran together."""
    spans = [times for times in arrivals if times]
    if not spans or len(spans) < len(arrivals):
        return 0.0, 0.0
    start, end = max(times[0] for times in spans), min(times[-1] for times in spans)
    if end <= start:
        return 0.0, 0.0
    count = sum(
        n
        for times, counts in zip(arrivals, tokens, strict=True)
        for t, n in zip(times, counts, strict=True)
        if start < t <= end
    )
    return count / (end - start), end - start


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` items over `parts` shares, the first `total % parts` of them one larger."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class WorkerFailed(RuntimeError):
    """A worker process raised, or died without returning."""


def _process_main(target: Callable[..., Any], index: int, args: tuple, out: Any) -> None:
    def report(payload: Any) -> None:
        out.put(("progress", index, payload))

    try:
        out.put(("done", index, target(*args, report=report)))
    except BaseException:  # the parent must hear of it rather than wait for a result forever
        out.put(("failed", index, traceback.format_exc()))


def run_in_processes(
    target: Callable[..., Any],
    args: list[tuple],
    on_progress: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Call `target(*args[i], report=...)` in one spawned process per entry and return what each call
    returned, in order (a WorkerFailed in place of one that raised or died). `report(payload)` hands
    `on_progress(i, payload)` a message in this process while the workers run. `target` and its
    arguments must pickle: a module-level function."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    workers = [
        context.Process(target=_process_main, args=(target, index, worker_args, out))
        for index, worker_args in enumerate(args)
    ]
    for worker in workers:
        worker.start()
    results: dict[int, Any] = {}
    while len(results) < len(workers):
        try:
            kind, index, payload = out.get(timeout=1.0)
        except queue.Empty:
            for index, worker in enumerate(workers):
                # A process that died without a word (killed, out of memory): its result never comes.
                if index not in results and worker.exitcode not in (None, 0):
                    results[index] = WorkerFailed(f"worker {index} exited with {worker.exitcode}")
            continue
        if kind == "progress":
            if on_progress is not None:
                on_progress(index, payload)
        elif kind == "done":
            results[index] = payload
        else:
            results[index] = WorkerFailed(payload)
    for worker in workers:
        worker.join()
    return [results[index] for index in range(len(workers))]


def run_load(
    url: str,
    concurrency: int,
    requests: int,
    max_tokens: int = 128,
    processes: int | None = None,
    params: dict | None = None,
    prompts: list[str] | None = None,
) -> LoadResult:
    """Run `requests` requests over `concurrency` streams in up to `processes` worker processes; stream
    i sends prompts i, i + 1, ... of `prompts` (None: `dspark-client bench`'s)."""
    processes = max(1, min(processes or os.cpu_count() or 1, concurrency))
    params = {"max_tokens": max_tokens, "ignore_eos": True, **(params or {})}
    per_stream = split_evenly(requests, concurrency)
    go = multiprocessing.get_context("spawn").Event()  # set once every stream is connected
    ready = [0]

    def on_progress(_: int, payload: Any) -> None:
        ready[0] += payload == "ready"
        if ready[0] == concurrency:
            go.set()

    worker_args, stream = [], 0
    for streams in split_evenly(concurrency, processes):
        worker_args.append(
            (
                url,
                streams,
                per_stream[stream : stream + streams],
                params,
                stream,
                go,
                list(prompts or PROMPTS),
            )
        )
        stream += streams
    returned = run_in_processes(_worker, worker_args, on_progress)
    for value in returned:
        if isinstance(value, WorkerFailed):
            raise value
    parts = [StreamStats(**value) for value in returned]
    spans = [span for p in parts for span in p.stream_spans]
    starts, ends = [span[0] for span in spans], [span[1] for span in spans]
    seconds = max(ends) - min(starts) if spans else 0.0
    tokens = sum(p.output_tokens for p in parts)
    responses = sum(p.responses for p in parts)
    ttft = [t for p in parts for t in p.ttft]
    gaps = [g for p in parts for g in p.gaps]
    final_gaps = [g for p in parts for g in p.final_gaps]
    steady_rate, steady_seconds = steady_window(
        [times for p in parts for times in p.arrivals], [n for p in parts for n in p.arrival_tokens]
    )
    resends = [r for p in parts for r in p.resends]
    errors = [e for p in parts for e in p.errors]
    return LoadResult(
        concurrency=concurrency,
        requests=sum(p.requests for p in parts),
        errors=len(errors),
        seconds=round(seconds, 3),
        output_tokens=tokens,
        responses=responses,
        tokens_per_s=round(tokens / seconds, 1) if seconds > 0 else 0.0,
        responses_per_s=round(responses / seconds, 1) if seconds > 0 else 0.0,
        ttft_p50_ms=round(_percentile_ms(ttft, 50), 2),
        ttft_p90_ms=round(_percentile_ms(ttft, 90), 2),
        gap_p50_ms=round(_percentile_ms(gaps, 50), 2),
        gap_p90_ms=round(_percentile_ms(gaps, 90), 2),
        final_gap_p50_ms=round(_percentile_ms(final_gaps, 50), 2),
        final_gap_p90_ms=round(_percentile_ms(final_gaps, 90), 2),
        resend_p50_ms=round(_percentile_ms(resends, 50), 2),
        steady_tokens_per_s=round(steady_rate, 1),
        steady_seconds=round(steady_seconds, 3),
        start_spread_ms=round((max(starts) - min(starts)) * 1000, 2) if spans else 0.0,
        end_spread_ms=round((max(ends) - min(ends)) * 1000, 2) if spans else 0.0,
        first_error=errors[0] if errors else "",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=0, help="per level (default: 4 per stream)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--processes", type=int, default=0, help="worker processes (default: CPU count)")
    args = parser.parse_args(argv)
    for level in (int(c) for c in args.concurrency.split(",")):
        requests = args.requests or 4 * level
        result = run_load(args.url, level, requests, args.max_tokens, args.processes or None)
        print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
