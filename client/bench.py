"""A concurrency sweep: TTFT, inter-token latency, output tokens/s and acceptance length per level."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from dspark_client.prompts import PROMPTS
from dspark_client.streaming import Chunk, GrpcSession, stream_http


@dataclass
class RequestTiming:
    """What one streamed request measured."""

    ttft: float
    inter_token: list[float]  # one per token after the first chunk: the chunk's gap / its tokens
    output_tokens: int
    accepted_tokens: int = 0
    steps: int = 0


@dataclass
class LevelResult:
    """One concurrency level of the sweep."""

    concurrency: int
    num_requests: int
    elapsed: float
    timings: list[RequestTiming] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """Percentiles and rates, JSON-ready."""
        ttft = [t.ttft for t in self.timings]
        itl = [gap for t in self.timings for gap in t.inter_token]
        tokens = sum(t.output_tokens for t in self.timings)
        steps = sum(t.steps for t in self.timings)
        return {
            "concurrency": self.concurrency,
            "requests": self.num_requests,
            "errors": len(self.errors),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "itl_p50_s": percentile(itl, 50),
            "itl_p90_s": percentile(itl, 90),
            "output_tokens_per_s": tokens / self.elapsed if self.elapsed else 0.0,
            "acceptance_length": (sum(t.accepted_tokens for t in self.timings) + steps) / steps
            if steps
            else 0.0,
        }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation); 0 for no values."""
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def measure(chunks: Iterator[Chunk], sent_at: float) -> RequestTiming:
    """Consume one request's chunks and time them."""
    ttft: float | None = None
    last = sent_at
    gaps: list[float] = []
    tokens = 0
    stats: dict | None = None
    for chunk in chunks:
        now = time.perf_counter()
        count = len(chunk.token_ids)
        if count:
            if ttft is None:
                ttft = now - sent_at
            else:
                gaps.extend([(now - last) / count] * count)
            last = now
            tokens += count
        stats = chunk.spec_stats or stats
    timing = RequestTiming(ttft if ttft is not None else last - sent_at, gaps, tokens)
    if stats:
        timing.accepted_tokens, timing.steps = stats["accepted_tokens"], stats["steps"]
    return timing


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self._lock = threading.Lock()
        self._enabled = sys.stderr.isatty()
        self._draw()

    def advance(self) -> None:
        with self._lock:
            self.done += 1
            self._draw()

    def close(self) -> None:
        if self._enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _draw(self) -> None:
        if not self._enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
        sys.stderr.flush()


class Streamer:
    """One worker's connection: streams a prompt (a user turn, or raw text) over its own gRPC stream, or
    over HTTP."""

    def __init__(self, http: bool, url: str, model: str, params: dict, chat: bool = True) -> None:
        self.http, self.url, self.model, self.params, self.chat = http, url, model, params, chat
        self._session = None if http else GrpcSession(url, model)

    def __call__(self, prompt: str) -> Iterator[Chunk]:
        if self._session is None:
            return stream_http(
                prompt, self.params, url=self.url, model=self.model, spec_stats=True, chat=self.chat
            )
        return self._session.generate(prompt, self.params, spec_stats=True, chat=self.chat)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()


def run_level(
    concurrency: int,
    num_requests: int,
    make_streamer: Callable[[], Streamer],
    prompts: Sequence[str] = PROMPTS,
) -> LevelResult:
    """Run num_requests prompts (`prompts` in turn) with `concurrency` workers, each owning one
    connection."""
    result = LevelResult(concurrency, num_requests, 0.0)
    work = iter(range(num_requests))
    lock = threading.Lock()
    progress = ProgressBar(num_requests, f"concurrency {concurrency:>3}")

    def worker() -> None:
        stream = make_streamer()
        while True:
            with lock:
                index = next(work, None)
            if index is None:
                stream.close()
                return
            sent = time.perf_counter()
            try:
                timing = measure(stream(prompts[index % len(prompts)]), sent)
                with lock:
                    result.timings.append(timing)
            except Exception as exc:  # report and go on: one failure must not hide the others
                with lock:
                    result.errors.append(str(exc))
            progress.advance()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.elapsed = time.perf_counter() - started
    progress.close()
    return result


def format_table(rows: list[dict]) -> str:
    """The sweep as an aligned text table."""
    header = ["conc", "reqs", "err", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "out tok/s", "accept len"]
    lines = ["  ".join(f"{h:>10}" for h in header)]
    for r in rows:
        cells = [
            f"{r['concurrency']:>10}",
            f"{r['requests']:>10}",
            f"{r['errors']:>10}",
            f"{r['ttft_p50_s'] * 1000:>8.1f}ms",
            f"{r['ttft_p90_s'] * 1000:>8.1f}ms",
            f"{r['itl_p50_s'] * 1000:>8.1f}ms",
            f"{r['itl_p90_s'] * 1000:>8.1f}ms",
            f"{r['output_tokens_per_s']:>10.1f}",
            f"{r['acceptance_length']:>10.2f}",
        ]
        lines.append("  ".join(cells))
    return "\n".join(lines)
