"""GPU stress and regression run through a real tritonserver (issue 21): CUDA-graph captures from fresh
starts, minutes of mixed gRPC streaming traffic against several server configurations at once, checks
after the phase, and compute-sanitizer over a short engine run.

    python3 benchmarks/stress.py --out $OUT/stress             # the whole GPU run, about 540 s
    .venv/bin/python benchmarks/stress.py --tiny --out /tmp/s  # CPU smoke run, about a minute

Phases of the default run (one H200 device call, killed at 600 s; `--deadline-s` 540 keeps it inside):

1. **servers** (about 60-90 s, beside 2): one `dspark serve` per configuration, CONCURRENTLY on the one
   GPU, each on its own free ports with a modest KV budget, fp32 (so that "greedy equals its solo
   answer" is exact; bf16 batch-shape rounding flips near-ties), drafting on every step
   (`adaptive_speculation` false: the speculative path under load, not the gate's choice):
   `main-static`, `main-compact` (graphs on), `control-no-graphs` (compact, `cuda_graph_max_tokens` 0)
   and `control-spec-off` (`spec_mode` off, graphs on). Each failed check is attributed by
   `attribute()` to the features of exactly the servers that failed it: graphs, speculation, both, or
   neither; tokens/s stand side by side in the report for a slowdown.
2. **capture** (in the background from the start): `--capture-runs` (5) fresh processes, each builds
   the engine with `main-static`'s or `main-compact`'s EngineConfig (alternating) and so captures
   every tier; the token tiers asked for are `--token-tiers` (60, 96, 112 and the largest among them)
   when the engine has `cuda_graph_token_tiers`, else its default ladder (the report says which).
   Each capture is logged with its size and seconds (`CudaGraphs.capture_log`, else the engine's log
   lines); a failed capture is named by its size. On an idle H200 a 30-layer checkpoint's 74 target
   graphs took 48 s from a cold Triton cache, 8 s from a warm one.
3. **warm-up** (a few s): one burst at the top concurrency with short outputs, then the idle GPU
   memory (the `dspark_gpu_memory_*_bytes` gauges) as the baseline.
4. **replay** (`--replay-s` 300, shortened to fit `--deadline-s` and flagged if the start ran long):
   the same seeded schedule for every server, from `--client-procs` (2) processes per server
   (threads, one gRPC stream per request, through load_generator's process plumbing). Concurrency
   cycles through `--concurrency-cycle` (1,60,96,112,128,256), each level for replay_s / 6 seconds.
   Each request (`plan_request`): a random `input_ids` prompt of 1..`--max-len` ids (80%) or text,
   max_tokens 1..`--max-len`, greedy or temperature 0.8 with a seed (half each), ignore_eos for half,
   `num_draft_tokens` 0 for 10%, and 20% closed by the client after a random number of tokens.
   Every `--malformed-every-s` (60) each server gets a malformed request (`malformed_cases`, in turn): the
   stream's error and the `dspark_generate` wrapper's INVALID_ARGUMENT must name the field, and the
   server must stay ready. Compute-sanitizer runs beside the replay (6).
5. **checks** (about 90 s): per server, ready (HTTP /v2/health/ready), KV pages used, running and
   waiting back to 0 (bounded wait), no `CUDA error` / `illegal memory access` / `device-side assert` /
   `Traceback` line and no restart in its log, no stream error, GPU memory allocated after the phase
   within `--mem-tolerance-mib` of the baseline (reserved within `--reserved-tolerance-mib`), and the
   solo check: `--solo-sample` (32) random finished or cancelled greedy streams re-run alone with
   logprobs, within `--solo-s`; a finished stream must equal its solo answer and a cancelled one be a
   prefix of it. A difference whose first divergent position has a top-2 margin below
   `--near-tie-nats` (1e-4) in the solo answer counts as `near_tie` (reported, not failing), any other
   as `mismatch` (failing).
6. **sanitizer** (two runs of at most `--sanitizer-s` (120) s, beside the replay; about 40 and 70 s on
   an idle H200 with a 30-layer checkpoint): `compute-sanitizer --tool memcheck` over `stress.py
   sanitizer-target` (a short offline engine run per speculation mode, static and compact: ragged
   prompts, greedy and sampled requests, one without drafts, CUDA graphs of tiers 1-16) and `--tool
   racecheck` over `sanitizer-target --no-graphs` with only the Triton kernels checked (`--kernel-name
   regex=`: every launch of dspark.kernels on its own; racecheck over every kernel of a 30-layer run did not
   finish in 150 s). Zero errors in the summary pass; no compute-sanitizer, a device it refuses or a run
   past its time box leaves the phase unavailable or incomplete, never passed.

Results: `stress.json` (every figure and check), `stress.md` (tables), `server-logs.txt` (each
server's flagged lines and log tail), `capture.log`, `sanitizer.log` under `--out` (default
`$OUT/stress`, else /tmp/dspark-stress); rendered repositories and whole logs under `--work-dir`. Exit
status: 0 every check passed, 1 a check failed, 2 none failed but a required phase did not run
(unavailable, timed out, or the replay was shortened below `--replay-s`).

The servers run the serving tests' launcher wrapper (tests/server_fixtures.TritonServer: `dspark
serve` on a rendered repository, free ports, readiness wait) and their gRPC client (`GrpcStream`,
which sends any input: `input_ids`, `return_logprobs`, a wrong datatype); dspark_client's
`GrpcSession` sends text prompts only.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import itertools
import json
import logging
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

from load_generator import WorkerFailed, run_in_processes  # noqa: E402
from server_fixtures import GrpcStream, TritonServer, free_ports, grpc_inputs  # noqa: E402
from server_fixtures import render_model_repository as render_repository  # noqa: E402

from dspark.config import EngineConfig  # noqa: E402

# Server configurations: EngineConfig changes over the common base, and the features each runs (what
# `attribute` blames). The mains run the shipped speculation modes with graphs; each control drops one.
VARIANTS: dict[str, dict[str, Any]] = {
    "main-static": {"spec_mode": "static"},
    "main-compact": {"spec_mode": "compact"},
    "control-no-graphs": {"spec_mode": "compact", "cuda_graph_max_tokens": 0},
    "control-spec-off": {"spec_mode": "off"},
}
DEFAULT_TOKEN_TIERS = "1,2,4,8,16,32,60,64,96,112,128,256,512"
LOG_FAULT_PATTERNS = ("CUDA error", "illegal memory access", "device-side assert", "Traceback")
RESTART_PATTERN = "restarting"  # dspark serve's line when it restarts a crashed tritonserver
LOAD_GAUGES = ("dspark_kv_pages_used", "dspark_num_requests_running", "dspark_num_requests_waiting")
MEMORY_GAUGES = ("dspark_gpu_memory_allocated_bytes", "dspark_gpu_memory_reserved_bytes")
WORDS = (
    "river stone light quick paper garden north copper window seven "
    "music winter bread engine silver forest ocean letter market candle"
).split()
MIB = 1 << 20
# Phases whose checks are per server configuration, so that `attribute` can blame a feature.
ATTRIBUTED_PHASES = ("start", "warm-up", "replay", "stop")
WARMUP_LEVEL = 9999  # the level index of warm-up requests (their keys stay apart from the replay's)

# Traffic mix (shares of requests).
TEXT_SHARE = 0.2
GREEDY_SHARE = 0.5
IGNORE_EOS_SHARE = 0.5
NO_DRAFT_SHARE = 0.1
CANCEL_SHARE = 0.2
SAMPLED_TEMPERATURE = 0.8


# Traffic ----------------------------------------------------------------------------------------


@dataclass
class RequestPlan:
    """One request of the seeded schedule: its prompt (ids or text), sampling parameters, and after how
    many tokens its client closes the stream (None: it reads to the end)."""

    key: str
    prompt_ids: list[int] | None
    prompt_text: str | None
    params: dict
    cancel_after: int | None

    @property
    def greedy(self) -> bool:
        return self.params.get("temperature", 0.0) == 0.0


def plan_request(seed: int, level: int, stream: int, n: int, vocab: int, max_len: int) -> RequestPlan:
    """The n-th request of `stream` at concurrency level `level`: the same for every server and process
    (a string seed hashes the same everywhere)."""
    rng = random.Random(f"{seed}/{level}/{stream}/{n}")
    prompt_ids = prompt_text = None
    if rng.random() < TEXT_SHARE:
        prompt_text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max(1, max_len // 2))))
    else:
        prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
    max_tokens = rng.randint(1, max_len)
    params: dict[str, Any] = {"max_tokens": max_tokens}
    if rng.random() < GREEDY_SHARE:
        params["temperature"] = 0.0
    else:
        params["temperature"] = SAMPLED_TEMPERATURE
        params["seed"] = rng.randrange(2**31)
    if rng.random() < IGNORE_EOS_SHARE:
        params["ignore_eos"] = True
    if rng.random() < NO_DRAFT_SHARE:
        params["num_draft_tokens"] = 0
    cancel_after = None
    if rng.random() < CANCEL_SHARE and max_tokens > 1:
        cancel_after = rng.randint(1, max_tokens - 1)
    return RequestPlan(f"{level}-{stream}-{n}", prompt_ids, prompt_text, params, cancel_after)


def parse_key(key: str) -> tuple[int, int, int]:
    """(level, stream, n) of a plan key."""
    level, stream, n = (int(part) for part in key.split("-"))
    return level, stream, n


@dataclass(frozen=True)
class Endpoint:
    """What GrpcStream needs of a server: its gRPC address (a TritonServer does not cross processes)."""

    grpc_url: str


@dataclass
class RequestRecord:
    """What the client of one request saw. `ids` are kept for greedy requests only (the solo check)."""

    key: str
    greedy: bool
    finished: bool
    cancelled: bool
    error: str | None
    num_tokens: int
    finish_reason: str
    seconds: float
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None


def run_request(url: str, plan: RequestPlan, timeout: float, logprobs: int = 0) -> RequestRecord:
    """Stream one request on a stream of its own; close the stream (cancelling it in the server) after
    `plan.cancel_after` tokens. logprobs > 0: ask for that many top logprobs per token."""
    values: dict[str, Any] = {"stream": True, "return_finish_reason": True}
    if plan.prompt_ids is not None:
        values["input_ids"] = plan.prompt_ids
    else:
        values["text_input"] = plan.prompt_text
    params = dict(plan.params)
    if logprobs:
        params["logprobs"] = logprobs
        values["return_logprobs"] = True
    values["sampling_parameters"] = params
    started = time.monotonic()
    ids: list[int] = []
    entries: list[dict] | None = [] if logprobs else None

    def record(finished: bool, cancelled: bool, error: str | None, reason: str = "") -> RequestRecord:
        return RequestRecord(
            plan.key,
            plan.greedy,
            finished,
            cancelled,
            error,
            len(ids),
            reason,
            round(time.monotonic() - started, 3),
            ids if plan.greedy else [],
            entries,
        )

    try:
        stream = GrpcStream(Endpoint(url))
    except Exception as exc:  # the server refused the connection: an error of this request
        return record(False, False, f"connect: {exc}")
    try:
        stream.send(request_id=plan.key, **values)
        while True:
            try:
                item = stream.next(timeout=timeout)
            except queue.Empty:
                return record(False, False, f"no response in {timeout:.0f} s")
            if isinstance(item, str):
                return record(False, False, item)
            ids.extend(item.ids)
            if entries is not None:
                entries.extend(json.loads(item.outputs["logprobs"].reshape(-1)[0]) or [])
            if item.final:
                return record(True, False, None, item.finish_reason)
            if plan.cancel_after is not None and len(ids) >= plan.cancel_after:
                stream.cancel()
                return record(False, True, None)
    except Exception as exc:  # a client-side failure is this request's error, never the worker's end
        return record(False, False, f"client: {type(exc).__name__}: {exc}")
    finally:
        try:
            stream.close()
        except Exception:
            pass


@dataclass(frozen=True)
class Level:
    """One concurrency level of the schedule, in wall-clock seconds (time.time(), shared by processes)."""

    index: int
    concurrency: int
    start: float
    end: float


def _stream_loop(
    url: str, seed: int, vocab: int, max_len: int, level: Level, stream: int, timeout: float, out: list
) -> None:
    for n in itertools.count():
        if time.time() >= level.end:
            return
        plan = plan_request(seed, level.index, stream, n, vocab, max_len)
        out.append(asdict(run_request(url, plan, timeout)))


def traffic_worker(
    url: str,
    seed: int,
    vocab: int,
    max_len: int,
    levels: list[Level],
    process: int,
    processes: int,
    timeout: float,
    report: Callable[[Any], None],
) -> list[dict]:
    """One client process of one server: at each level, streams `process`, `process + processes`, ...
    each send requests back to back until the level ends (a request running then finishes). Reports
    each level's figures so far when it ends; returns every request's record."""
    records: list[dict] = []
    threads: list[threading.Thread] = []
    for level in levels:
        _sleep_until(level.start)
        for stream in range(process, level.concurrency, processes):
            args = (url, seed, vocab, max_len, level, stream, timeout, records)
            thread = threading.Thread(target=_stream_loop, args=args, daemon=True)
            thread.start()
            threads.append(thread)
        _sleep_until(level.end)
        done = [r for r in records if parse_key(r["key"])[0] == level.index]
        report({"level": level.index, **tally(done)})
    for thread in threads:
        thread.join()
    return records


def burst_worker(
    url: str, plans: list[RequestPlan], timeout: float, report: Callable[[Any], None]
) -> list[dict]:
    """One client process of a burst: every plan at once, one thread each; their records."""
    records: list[dict] = []
    threads = [
        threading.Thread(target=lambda plan=plan: records.append(asdict(run_request(url, plan, timeout))))
        for plan in plans
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records


def tally(records: list[dict]) -> dict:
    """Finished, cancelled, errored requests and tokens received."""
    return {
        "requests": len(records),
        "finished": sum(r["finished"] for r in records),
        "cancelled": sum(r["cancelled"] for r in records),
        "errors": sum(r["error"] is not None for r in records),
        "tokens": sum(r["num_tokens"] for r in records),
    }


def _sleep_until(moment: float) -> None:
    delay = moment - time.time()
    if delay > 0:
        time.sleep(delay)


# Malformed requests -----------------------------------------------------------------------------


@dataclass
class Malformed:
    """A request that must be refused naming `field` (values as server_fixtures.grpc_inputs takes them:
    a str under sampling_parameters is sent as it is)."""

    name: str
    values: dict
    field: str


def malformed_cases(vocab: int) -> list[Malformed]:
    """The malformed requests the replay sends, in turn."""
    import numpy as np

    return [
        Malformed(
            "negative max_tokens",
            {"text_input": "Hi", "sampling_parameters": {"max_tokens": -5}},
            "max_tokens",
        ),
        Malformed(
            "seed past the generator's range",
            {"text_input": "Hi", "sampling_parameters": '{"seed": 18446744073709551621}'},
            "seed",
        ),
        Malformed("input_ids as INT32", {"input_ids": (np.array([1, 2, 3], np.int32), "INT32")}, "input_ids"),
        Malformed(
            "negative temperature",
            {"text_input": "Hi", "sampling_parameters": {"temperature": -0.5}},
            "temperature",
        ),
        Malformed("input_ids past the vocabulary", {"input_ids": [1, vocab]}, "input_ids"),
    ]


def malformed_schedule(duration_s: float, every_s: float, cases: int) -> list[tuple[float, int]]:
    """(seconds into the replay, case index): one every `every_s`, in the middle of each interval, the
    cases in turn."""
    if every_s <= 0:
        return []
    times = []
    moment = every_s / 2
    while moment < duration_s:
        times.append(moment)
        moment += every_s
    return [(t, i % cases) for i, t in enumerate(times)]


def send_malformed(server: TritonServer, case: Malformed, timeout: float = 60.0) -> dict:
    """Send one malformed request on a gRPC stream to `dspark` and as a gRPC infer to `dspark_generate`;
    both must be refused naming the field (the wrapper with INVALID_ARGUMENT), and the server must stay
    ready."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    result: dict[str, Any] = {"case": case.name, "field": case.field}
    try:
        with GrpcStream(server) as stream:
            outcome = stream.send(**case.values).collect(timeout=timeout)
        result["stream_error"] = outcome.error
        result["stream_responses"] = len(outcome.responses)
    except Exception as exc:
        result["stream_error"], result["stream_responses"] = f"client: {exc}", -1
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer("dspark_generate", grpc_inputs(**case.values), client_timeout=timeout)
        result["wrapper_status"], result["wrapper_error"] = "OK", ""
    except InferenceServerException as exc:
        result["wrapper_status"], result["wrapper_error"] = exc.status(), exc.message()
    finally:
        client.close()
    result["ready_after"] = server_ready(server)
    stream_ok = result["stream_responses"] == 0 and case.field in (result["stream_error"] or "")
    wrapper_ok = (
        result["wrapper_status"] == "StatusCode.INVALID_ARGUMENT" and case.field in result["wrapper_error"]
    )
    result["ok"] = bool(stream_ok and wrapper_ok and result["ready_after"])
    return result


# Solo check -------------------------------------------------------------------------------------


def first_divergence(got: list[int], solo: list[int]) -> int:
    """The first position where two token lists differ (the shorter one's length when one is a prefix)."""
    for position, (a, b) in enumerate(zip(got, solo, strict=False)):
        if a != b:
            return position
    return min(len(got), len(solo))


def top2_margin(entry: dict | None) -> float | None:
    """The log-probability gap between the two likeliest tokens of a logprobs entry (None: under two)."""
    if not entry:
        return None
    values = sorted((v["logprob"] for v in entry.values()), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def classify(
    got: list[int], complete: bool, solo: list[int], solo_logprobs: list[dict] | None, near_tie_nats: float
) -> tuple[str, int | None, float | None]:
    """Compare a stream's tokens with its solo answer: ('match' | 'near_tie' | 'mismatch', the first
    divergent position, the solo answer's top-2 margin there). A finished stream must equal the answer,
    a cancelled one (complete False) be a prefix of it. A difference is a near tie when the solo
    answer's two likeliest tokens at the first divergent position were within `near_tie_nats`: a
    rounding difference between batch shapes may flip such a choice."""
    expected = solo if complete else solo[: len(got)]
    if got == expected:
        return "match", None, None
    position = first_divergence(got, solo)
    entry = solo_logprobs[position] if solo_logprobs is not None and position < len(solo_logprobs) else None
    margin = top2_margin(entry)
    if margin is not None and margin < near_tie_nats:
        return "near_tie", position, margin
    return "mismatch", position, margin


def solo_check(
    server: TritonServer,
    records: list[dict],
    plan_of: Callable[[str], RequestPlan],
    sample: int,
    budget_s: float,
    near_tie_nats: float,
    timeout: float,
    seed: int,
) -> dict:
    """Re-run a random sample of the finished or cancelled greedy streams alone, with logprobs, within
    `budget_s`; classify each against its stream."""
    candidates = [
        r for r in records if r["greedy"] and r["error"] is None and (r["finished"] or r["cancelled"])
    ]
    chosen = random.Random(seed).sample(candidates, min(sample, len(candidates)))
    deadline = time.monotonic() + budget_s
    counts = {"match": 0, "near_tie": 0, "mismatch": 0}
    details, errors = [], []
    checked = 0
    for record in chosen:
        if time.monotonic() >= deadline:
            break
        plan = dataclasses.replace(plan_of(record["key"]), cancel_after=None)
        solo = run_request(server.grpc_url, plan, timeout, logprobs=2)
        if solo.error is not None:
            errors.append(f"{record['key']}: {solo.error}")
            continue
        checked += 1
        verdict, position, margin = classify(
            record["ids"], record["finished"], solo.ids, solo.logprobs, near_tie_nats
        )
        counts[verdict] += 1
        if verdict != "match":
            details.append(
                {
                    "key": record["key"],
                    "verdict": verdict,
                    "position": position,
                    "margin_nats": margin,
                    "finished": record["finished"],
                    "stream_tokens": len(record["ids"]),
                    "solo_tokens": len(solo.ids),
                }
            )
    return {
        "candidates": len(candidates),
        "sampled": len(chosen),
        "checked": checked,
        **counts,
        "errors": errors,
        "details": details,
    }


# Attribution ------------------------------------------------------------------------------------


def variant_features(config: EngineConfig, on_gpu: bool) -> set[str]:
    """What a server configuration runs, as `attribute` names it."""
    features = set()
    if on_gpu and config.cuda_graph_max_tokens > 0:
        features.add("graphs")
    if config.spec_mode != "off":
        features |= {"speculation", config.spec_mode}
    return features


def attribute(failed: dict[str, bool], features: dict[str, set[str]]) -> str:
    """Which features explain the servers that failed a check: the smallest set of features exactly
    those servers run ('graphs', 'speculation', 'graphs+speculation', ...); 'neither: ...' when every
    server failed or no set singles the failing ones out; 'none' when none failed."""
    failing = {name for name, bad in failed.items() if bad}
    if not failing:
        return "none"
    if failing == set(failed):
        return "neither: every configuration (" + ", ".join(sorted(failing)) + ")"
    names = sorted(set().union(*features.values()))
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            if {s for s in failed if set(subset) <= features[s]} == failing:
                return "+".join(subset)
    return "neither: " + ", ".join(sorted(failing))


# Servers ----------------------------------------------------------------------------------------


class ServerOwner:
    """Starts one server from a thread that lives until the server stops: the launcher gets SIGTERM
    when the thread that started it ends (server_fixtures sets PR_SET_PDEATHSIG, which follows the
    thread, not the process)."""

    def __init__(self, name: str, server: TritonServer) -> None:
        self.name = name
        self.server = server
        self.ready = threading.Event()
        self.error: str | None = None
        self.exit_status: int | None = None
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._own, name=f"server-{name}", daemon=True)
        self._thread.start()

    def _own(self) -> None:
        try:
            self.server.start()
        except Exception as exc:
            self.error = str(exc)
        self.ready.set()
        self._stop.wait()
        try:
            self.exit_status = self.server.stop()
        finally:
            self._stopped.set()

    def request_stop(self) -> None:
        """Begin stopping the server (SIGTERM, then SIGKILL after server_fixtures' wait)."""
        self._stop.set()

    def wait_stopped(self, timeout: float = 120.0) -> None:
        """Wait until the server stopped."""
        self._stopped.wait(timeout)


def server_ready(server: TritonServer) -> bool:
    """HTTP /v2/health/ready answers 200."""
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def gauges(server: TritonServer, names: tuple[str, ...]) -> dict[str, float | None]:
    """The named dspark gauges now (None: not published, or the endpoint did not answer)."""
    try:
        text = server.metrics_text()
    except OSError:
        return dict.fromkeys(names)
    values: dict[str, float | None] = dict.fromkeys(names)
    for line in text.splitlines():
        match = re.match(r"^(\w+)\{([^}]*)\} (\S+)$", line)
        if match and match.group(1) in values and 'model="dspark"' in match.group(2):
            values[match.group(1)] = float(match.group(3))
    return values


def wait_idle(server: TritonServer, timeout: float) -> tuple[bool, dict]:
    """Wait until no KV page is used and no request runs or waits; (whether it came, the last gauges)."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(server, LOAD_GAUGES)
        if all(value == 0 for value in now.values()):
            return True, now
        if time.monotonic() >= deadline:
            return False, now
        time.sleep(0.25)


def memory(server: TritonServer) -> dict[str, float | None]:
    """GPU memory allocated and reserved by the server's engine (the load gauges; 0 on the CPU)."""
    values = gauges(server, MEMORY_GAUGES)
    return {"allocated": values[MEMORY_GAUGES[0]], "reserved": values[MEMORY_GAUGES[1]]}


def scan_log(text: str) -> tuple[list[str], int]:
    """Lines naming a device fault or a traceback, and how often dspark serve restarted tritonserver."""
    lines = text.splitlines()
    flagged = [line for line in lines if any(p in line for p in LOG_FAULT_PATTERNS)]
    restarts = sum(RESTART_PATTERN in line and "dspark serve" in line for line in lines)
    return flagged, restarts


# Capture phase ----------------------------------------------------------------------------------


def supports_token_tiers() -> bool:
    """Whether this engine takes explicit CUDA-graph token tiers (EngineConfig.cuda_graph_token_tiers)."""
    return "cuda_graph_token_tiers" in {f.name for f in dataclasses.fields(EngineConfig)}


CAPTURE_LINE = re.compile(r"cuda graph captur.*?tokens=(\d+) requests=(\d+)(?: in ([\d.]+) ms)?")


class _CaptureLines(logging.Handler):
    """Keeps the engine's log lines about graph captures (it logs each one, and a failure naming its
    size; the graphs object holding `capture_log` is dropped after a failure)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "cuda graph captur" in message:
            self.lines.append(message)


def _capture_entry(entry: Any) -> dict:
    """One `capture_log` entry as a dict (a CaptureRecord, or a (tokens, requests, seconds) tuple)."""
    if dataclasses.is_dataclass(entry):
        values = asdict(entry)
    else:
        values = dict(zip(("tokens", "requests", "seconds", "ok", "error"), entry, strict=False))
    values.setdefault("ok", True)
    return values


def _entries_from_lines(lines: list[str]) -> list[dict]:
    """Capture entries read from the engine's log lines (when its capture_log is gone)."""
    entries = []
    for line in lines:
        match = CAPTURE_LINE.search(line)
        if match:
            seconds = float(match.group(3)) / 1e3 if match.group(3) else None
            entries.append(
                {
                    "tokens": int(match.group(1)),
                    "requests": int(match.group(2)),
                    "seconds": seconds,
                    "ok": "fail" not in line,
                    "error": line if "fail" in line else "",
                }
            )
    return entries


def capture_target(config_json: str) -> int:
    """In a fresh process: build the engine (which captures every graph tier) and print one JSON line:
    seconds, the token tiers planned and captured, each capture's size and seconds, the first failed
    size. A short greedy run then replays the graphs."""
    import torch

    from dspark.engine.llm_engine import LLMEngine
    from dspark.runner.cuda_graphs import next_pow2, token_tiers
    from dspark.sampling_params import SamplingParams

    lines = _CaptureLines()
    logging.getLogger("dspark").addHandler(lines)
    logging.getLogger("dspark").setLevel(logging.INFO)
    config = EngineConfig(**json.loads(config_json))
    largest = next_pow2(min(config.cuda_graph_max_tokens, config.max_num_batched_tokens))
    planned = list(getattr(config, "cuda_graph_tiers", None) or token_tiers(largest))
    result: dict[str, Any] = {
        "spec_mode": config.spec_mode,
        "pid": os.getpid(),
        "expected_token_tiers": planned,
    }
    started = time.monotonic()
    try:
        engine = LLMEngine(config)
    except Exception:
        result.update(ok=False, seconds=round(time.monotonic() - started, 2), error=traceback.format_exc())
        result["captures"] = _entries_from_lines(lines.lines)
        print("CAPTURE-RESULT " + json.dumps(result), flush=True)
        return 1
    result["seconds"] = round(time.monotonic() - started, 2)
    graphs = getattr(engine.runner, "graphs", None)
    captured = sorted(graphs.captured) if graphs is not None else []
    result["graphs"] = len(captured)
    result["token_tiers"] = sorted({key[0] for key in captured})
    log = getattr(graphs, "capture_log", None)
    result["capture_log_kept"] = log is not None
    captures = (
        [_capture_entry(entry) for entry in log] if log is not None else _entries_from_lines(lines.lines)
    )
    result["captures"] = captures
    failed = [entry for entry in captures if not entry["ok"]]
    result["failed_at"] = failed[0] if failed else None
    result["missing_token_tiers"] = sorted(set(planned) - set(result["token_tiers"]))
    try:
        engine.add_request("capture-check", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(d.new_token_ids) for d in engine.step())
        result["replay_tokens"] = tokens
        result["ok"] = tokens == 8 and not failed and not result["missing_token_tiers"]
    except Exception:
        result.update(ok=False, error=traceback.format_exc())
    if torch.cuda.is_available():
        result["gpu_allocated"] = torch.cuda.memory_allocated()
        result["gpu_reserved"] = torch.cuda.memory_reserved()
    engine.close()
    print("CAPTURE-RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def run_captures(configs: list[EngineConfig], parallel: int, timeout: float, log_path: Path) -> dict:
    """Each config's capture-target in a fresh process, `parallel` at a time; the phase's results (and
    every capture, with its size and seconds, in `log_path`)."""
    runs: list[dict] = [{} for _ in configs]
    outputs: list[str] = [""] * len(configs)
    pending = list(range(len(configs)))
    lock = threading.Lock()

    def one(index: int) -> None:
        config = configs[index]
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "capture-target",
            json.dumps(asdict(config)),
        ]
        started = time.monotonic()
        status, output = run_bounded(command, timeout)
        result: dict[str, Any] = {"run": index, "spec_mode": config.spec_mode, "exit": status, "ok": False}
        for line in output.splitlines():
            if line.startswith("CAPTURE-RESULT "):
                result.update(json.loads(line.removeprefix("CAPTURE-RESULT ")))
        result["wall_s"] = round(time.monotonic() - started, 2)
        if status == "timeout":
            result["error"] = f"no result in {timeout:.0f} s"
        elif "seconds" not in result:
            result["error"] = f"exit {status} without a result: " + " | ".join(output.splitlines()[-3:])
        with lock:
            runs[index], outputs[index] = result, output
        failed_at = result.get("failed_at")
        print(
            f"capture run {index} ({config.spec_mode}): {'ok' if result['ok'] else 'FAILED'} in "
            f"{result.get('seconds', '?')} s, {result.get('graphs', 0)} graphs, token tiers "
            f"{result.get('token_tiers', [])}"
            + (
                f", failed at tokens={failed_at['tokens']} requests={failed_at['requests']}"
                if failed_at
                else ""
            ),
            flush=True,
        )

    def drain() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index = pending.pop(0)
            one(index)

    workers = [threading.Thread(target=drain, daemon=True) for _ in range(max(1, parallel))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    log = []
    for run, output in zip(runs, outputs, strict=True):
        log.append(
            f"=== capture run {run['run']} ({run['spec_mode']}): exit {run['exit']}, {run.get('seconds')} s"
        )
        for entry in run.get("captures", []):
            seconds = "?" if entry["seconds"] is None else f"{entry['seconds']:.4f}"
            state = "ok" if entry["ok"] else f"FAILED: {entry.get('error', '')}"
            log.append(
                f"run {run['run']} tokens={entry['tokens']} requests={entry['requests']} s={seconds} {state}"
            )
        log += ["--- output", output]
    log_path.write_text("\n".join(log) + "\n")
    failures = [r for r in runs if not r["ok"]]
    return {
        "status": "failed" if failures else "passed",
        "runs": runs,
        "token_tiers_captured": sorted({t for r in runs for t in r.get("token_tiers", [])}),
        "explicit_tiers_supported": supports_token_tiers(),
        "first_failure": first_failure(failures),
    }


def first_failure(failures: list[dict]) -> str | None:
    """The first failed run and what failed there: the size whose capture failed, the tiers missing, or
    the last line of its error."""
    if not failures:
        return None
    run = failures[0]
    where = f"run {run['run']} ({run['spec_mode']})"
    if run.get("failed_at"):
        entry = run["failed_at"]
        size = f"tokens={entry['tokens']} requests={entry['requests']}"
        return f"{where}: capture failed at {size}: {entry['error']}"
    if run.get("missing_token_tiers"):
        return f"{where}: token tiers {run['missing_token_tiers']} not captured"
    error = (run.get("error") or "").strip().splitlines()
    return f"{where}: {error[-1] if error else 'exit ' + str(run.get('exit'))}"


def run_bounded(command: list[str], timeout: float, env: dict | None = None) -> tuple[int | str, str]:
    """Run a command in its own process group with stdout and stderr together; (exit status or
    'timeout', output). On timeout the whole group is killed."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
        cwd=REPO,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return "timeout", output.decode(errors="replace")


# Sanitizer phase --------------------------------------------------------------------------------


def find_compute_sanitizer() -> str | None:
    """compute-sanitizer on PATH or in a CUDA toolkit under /usr/local."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))
    return candidates[-1] if candidates else None


def sanitizer_target(graphs: bool, modes: list[str], max_tokens: int, model: str, draft_model: str) -> int:
    """A short offline engine run for compute-sanitizer: per speculation mode, ragged prompts, greedy and
    sampled requests (one without drafts), small CUDA-graph tiers (or none)."""
    from dspark import LLM, SamplingParams

    tiers = {"cuda_graph_token_tiers": "1,2,4,8,16"} if graphs and supports_token_tiers() else {}
    prompts = [
        [1 + (i * 7919 + j * 104729) % 40000 for j in range(length)]
        for i, length in enumerate((1, 5, 17, 40))
    ]
    params = [
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, temperature=SAMPLED_TEMPERATURE, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_draft_tokens=0),
        SamplingParams(max_tokens=max_tokens, temperature=SAMPLED_TEMPERATURE, seed=2),
    ]
    total = 0
    for mode in modes:
        config = EngineConfig(
            model=model,
            draft_model=draft_model,
            dtype="float32",
            spec_mode=mode,
            num_kv_pages=64,
            kv_page_size=16,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=256,
            cuda_graph_max_tokens=16 if graphs else 0,
            adaptive_speculation=False,
            **tiers,
        )
        with LLM(config) as llm:
            outputs = llm.generate(params=params, prompt_token_ids=prompts)
        total += sum(len(o.token_ids) for o in outputs)
        print(
            f"sanitizer-target {mode} graphs={graphs}: {[len(o.token_ids) for o in outputs]} tokens",
            flush=True,
        )
    print(f"sanitizer-target done: {total} tokens", flush=True)
    return 0


# Triton names a kernel after its function, unmangled; every kernel of dspark.kernels is `_<name>_kernel`
# (torch's and cuBLAS's are mangled C++ names). racecheck instruments only these: over every kernel
# of the eager engine it did not finish a 30-layer run in 150 s on an H200.
TRITON_KERNELS = "^_[A-Za-z0-9_]*_kernel$"


def parse_sanitizer_summary(output: str) -> tuple[int | None, int | None]:
    """(errors, warnings) of compute-sanitizer's last summary line (None: no summary). memcheck, initcheck
    and synccheck end with `ERROR SUMMARY: N errors`; racecheck with `RACECHECK SUMMARY: N hazards
    displayed (E errors, W warnings)`."""
    race = re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", output)
    if race:
        return int(race[-1][0]), int(race[-1][1])
    errors = re.findall(r"ERROR SUMMARY: (\d+) errors?", output)
    return (int(errors[-1]), None) if errors else (None, None)


def run_sanitizer(
    tool: str, target_args: list[str], timeout: float, kernel_regex: str | None = None
) -> tuple[dict, str]:
    """compute-sanitizer --tool `tool` over sanitizer-target (only the kernels whose names match
    `kernel_regex` checked, if given); (result, output)."""
    binary = find_compute_sanitizer()
    if binary is None:
        return {
            "tool": tool,
            "status": "unavailable",
            "detail": "no compute-sanitizer on PATH or /usr/local/cuda*",
        }, ""
    command = [binary, "--tool", tool, "--print-limit", "50"]
    if kernel_regex:
        command += ["--kernel-name", f"regex={kernel_regex}"]
    command += [sys.executable, str(Path(__file__).resolve()), "sanitizer-target", *target_args]
    started = time.monotonic()
    status, output = run_bounded(command, timeout)
    result: dict[str, Any] = {"tool": tool, "command": " ".join(command), "exit": status}
    result["seconds"] = round(time.monotonic() - started, 1)
    errors, warnings = parse_sanitizer_summary(output)
    result["errors"], result["warnings"] = errors, warnings
    target_done = "sanitizer-target done" in output
    if "Device not supported" in output or "not supported on this" in output:
        result["status"], result["detail"] = "unavailable", "compute-sanitizer refused the device"
    elif status == "timeout":
        result["status"], result["detail"] = "timeout", f"past its time box of {timeout:.0f} s"
    elif errors:
        result["status"], result["detail"] = "failed", f"{errors} errors"
    elif errors == 0 and target_done:
        result["status"] = "passed"
        result["detail"] = "0 errors" + (f", {warnings} warnings" if warnings else "")
    else:
        result["status"], result["detail"] = "failed", f"the target did not finish (exit {status})"
    print(f"sanitizer {tool}: {result['status']} ({result['detail']}) in {result['seconds']} s", flush=True)
    return result, output


# The run ----------------------------------------------------------------------------------------


@dataclass
class Knobs:
    """Every setting of a run (the command line's, after --tiny)."""

    out: Path
    work_dir: Path | None
    servers: list[str]
    replay_s: float
    deadline_s: float
    concurrency_cycle: list[int]
    max_len: int
    client_procs: int
    seed: int
    solo_sample: int
    solo_s: float
    near_tie_nats: float
    malformed_every_s: float
    response_timeout_s: float
    idle_timeout_s: float
    capture_runs: int
    capture_parallel: int
    capture_timeout_s: float
    sanitizer_s: float
    token_tiers: str
    dtype: str
    kv_pages: int
    kv_page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    cuda_graph_max_tokens: int
    adaptive_speculation: bool
    model: str
    draft_model: str
    mem_tolerance_mib: float
    reserved_tolerance_mib: float
    warmup_max_len: int


def base_config(knobs: Knobs) -> EngineConfig:
    """The configuration every server shares before its variant's changes."""
    extra = {}
    if supports_token_tiers() and knobs.token_tiers:
        # Tiers past the largest captured step are refused by the config: drop them.
        largest = min(knobs.cuda_graph_max_tokens, knobs.max_num_batched_tokens)
        extra["cuda_graph_token_tiers"] = ",".join(
            t for t in knobs.token_tiers.split(",") if int(t) <= largest
        )
    return EngineConfig(
        model=knobs.model,
        draft_model=knobs.draft_model,
        dtype=knobs.dtype,
        num_kv_pages=knobs.kv_pages,
        kv_page_size=knobs.kv_page_size,
        max_num_seqs=knobs.max_num_seqs,
        max_num_batched_tokens=knobs.max_num_batched_tokens,
        max_model_len=knobs.max_model_len or 2 * knobs.max_len + 64,
        cuda_graph_max_tokens=knobs.cuda_graph_max_tokens,
        adaptive_speculation=knobs.adaptive_speculation,
        seed=knobs.seed,
        **extra,
    )


def vocab_size(config: EngineConfig) -> int:
    """The served target's vocabulary size (its config.json)."""
    return int(json.loads((config.model_path / "config.json").read_text())["vocab_size"])


def cuda_available() -> bool:
    """Whether this machine has a CUDA device (torch asked in a child: this process stays torch-free)."""
    command = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=120).stdout.strip() == "True"
    except (OSError, subprocess.TimeoutExpired):
        return False


class Run:
    """One stress run: its knobs, servers, phases and checks."""

    def __init__(self, knobs: Knobs) -> None:
        self.knobs = knobs
        self.started = time.monotonic()
        self.report: dict[str, Any] = {
            "knobs": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(knobs).items()}
        }
        self.checks: list[dict] = []
        self.incomplete: list[str] = []

    def elapsed(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        """One progress line, stamped with the run's seconds."""
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def check(self, phase: str, server: str, name: str, passed: bool | None, detail: str = "") -> None:
        """Record a check (passed None: does not apply here, e.g. GPU memory on the CPU)."""
        self.checks.append(
            {"phase": phase, "server": server, "check": name, "passed": passed, "detail": detail}
        )

    def skipped(self, phase: str, option: str, asked: bool) -> dict[str, Any]:
        """The result of a phase that did not run: turned off by its option (0), or asked for on a
        machine with no CUDA device, which leaves the run incomplete (never passed)."""
        why = "no CUDA device" if asked else f"disabled ({option} 0)"
        if asked:
            self.incomplete.append(f"{phase}: {why}")
        return {"status": "skipped", "detail": why}

    def execute(self) -> int:
        """Run every phase; the exit status."""
        knobs = self.knobs
        knobs.out.mkdir(parents=True, exist_ok=True)
        work = knobs.work_dir or Path(tempfile.mkdtemp(prefix="dspark-stress-"))
        work.mkdir(parents=True, exist_ok=True)
        on_gpu = cuda_available()
        self.report["device"] = "cuda" if on_gpu else "cpu"
        base = base_config(knobs)
        configs = {name: base.replace(**VARIANTS[name]) for name in knobs.servers}
        self.report["explicit_token_tiers"] = supports_token_tiers()
        self.report["configs"] = {name: asdict(config) for name, config in configs.items()}
        features = {name: variant_features(config, on_gpu) for name, config in configs.items()}
        vocab = vocab_size(base)
        self.say(
            f"device {self.report['device']}; servers {', '.join(knobs.servers)}; vocabulary {vocab}; "
            f"explicit token tiers {'yes' if supports_token_tiers() else 'no (default ladder)'}"
        )

        # Servers start, captures and sanitizer run beside them.
        owners = {}
        for name, config in configs.items():
            root = work / name
            root.mkdir(parents=True, exist_ok=True)
            http, grpc, metrics = free_ports(3)
            server = TritonServer(
                render_repository(root, config), root / "server.log", http, grpc, metrics, 0
            )
            owners[name] = ServerOwner(name, server)
        background: dict[str, threading.Thread] = {}
        capture_result: dict[str, Any] = {}
        if knobs.capture_runs > 0 and on_gpu:
            mains = [configs.get("main-static", base.replace(**VARIANTS["main-static"]))]
            mains.append(configs.get("main-compact", base.replace(**VARIANTS["main-compact"])))
            capture_configs = [mains[i % 2] for i in range(knobs.capture_runs)]

            def captures() -> None:
                capture_result.update(
                    run_captures(
                        capture_configs,
                        knobs.capture_parallel,
                        knobs.capture_timeout_s,
                        knobs.out / "capture.log",
                    )
                )

            background["capture"] = threading.Thread(target=captures, daemon=True)
            background["capture"].start()
        else:
            capture_result.update(self.skipped("capture", "--capture-runs", knobs.capture_runs > 0))

        for owner in owners.values():
            owner.ready.wait()
        failed_start = {name: o.error for name, o in owners.items() if o.error}
        for name, owner in owners.items():
            self.check(
                "start",
                name,
                "ready",
                owner.error is None,
                owner.error or f"{owner.server.ready_after_s:.1f} s",
            )
        self.say(
            "servers ready: "
            + ", ".join(f"{n} {o.server.ready_after_s:.1f} s" for n, o in owners.items() if not o.error)
            + (f"; FAILED: {', '.join(failed_start)}" if failed_start else "")
        )
        live = {name: o.server for name, o in owners.items() if o.error is None}

        # Warm-up and baseline memory.
        baseline = self.warm_up(live, vocab)

        # The replay, sanitizer beside it.
        replay_s = knobs.replay_s
        if knobs.deadline_s > 0:
            # The checks after the phase: the solo runs' time box, draining and stopping the servers.
            reserve = knobs.solo_s + 35
            room = knobs.deadline_s - self.elapsed() - reserve
            if room < replay_s:
                replay_s = max(room, 10.0)
                self.incomplete.append(
                    f"replay shortened to {replay_s:.0f} s (deadline {knobs.deadline_s:.0f} s)"
                )
                self.say(
                    f"replay shortened to {replay_s:.0f} s to meet the {knobs.deadline_s:.0f} s deadline"
                )
        sanitizer_results: dict[str, Any] = {}
        if knobs.sanitizer_s > 0 and on_gpu:
            # Both runs end within the replay, so that the checks after it wait for neither.
            box = min(knobs.sanitizer_s, max(30.0, replay_s / 2 - 10))
            background["sanitizer"] = threading.Thread(
                target=self.sanitize, args=(sanitizer_results, box), daemon=True
            )
            background["sanitizer"].start()
        else:
            sanitizer_results.update(self.skipped("sanitizer", "--sanitizer-s", knobs.sanitizer_s > 0))
        replay = self.replay(live, vocab, replay_s)

        # Checks after the phase.
        servers_report = {}
        plan_of = self.plan_lookup(vocab)

        def after_phase(name: str, server: TritonServer) -> None:
            servers_report[name] = self.after_phase(
                name, server, replay["records"][name], baseline.get(name, {}), plan_of, on_gpu
            )

        threads = [threading.Thread(target=after_phase, args=item) for item in live.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for owner in owners.values():  # all at once: each takes seconds to drain and stop
            owner.request_stop()
        for owner in owners.values():
            owner.wait_stopped()
        # Captures and sanitizer runs are time-boxed (their processes killed at the box's end).
        for thread in background.values():
            thread.join()
        for name, owner in owners.items():
            flagged, restarts = scan_log(owner.server.log_text() if owner.server.log_path.exists() else "")
            servers_report.setdefault(name, {})["exit_status"] = owner.exit_status
            servers_report[name]["log_fault_lines_final"] = flagged[:20]
            self.check("stop", name, "stopped cleanly", owner.exit_status == 0, f"exit {owner.exit_status}")
            self.check(
                "stop",
                name,
                "no CUDA error or traceback in the whole log",
                not flagged,
                " | ".join(flagged[:3])[:500],
            )
            leftovers = owner.server.leftover_processes()
            self.check("stop", name, "no process left", not leftovers, "; ".join(leftovers)[:300])
        self.write_server_logs(owners)

        # Phase statuses.
        self.record_capture(capture_result)
        self.record_sanitizer(sanitizer_results)
        replay_report = {
            "replay_s": round(replay_s, 1),
            "levels": replay["levels"],
            "malformed": replay["malformed"],
            "servers": {
                name: {**replay["summary"].get(name, {}), **servers_report.get(name, {})} for name in configs
            },
        }
        attribution = {}
        for check_name in sorted({c["check"] for c in self.checks if c["phase"] in ATTRIBUTED_PHASES}):
            failed = {
                name: any(
                    c["passed"] is False
                    for c in self.checks
                    if c["server"] == name and c["check"] == check_name and c["phase"] in ATTRIBUTED_PHASES
                )
                for name in configs
            }
            attribution[check_name] = attribute(failed, features)
        slow = {name: replay["summary"].get(name, {}).get("tokens_per_s") for name in configs}
        self.report.update(
            capture=capture_result,
            replay=replay_report,
            sanitizer=sanitizer_results,
            attribution={
                "checks": attribution,
                "tokens_per_s": slow,
                "features": {k: sorted(v) for k, v in features.items()},
            },
            checks=self.checks,
            incomplete=self.incomplete,
            wall_s=round(self.elapsed(), 1),
        )
        failed_checks = [c for c in self.checks if c["passed"] is False]
        status = "failed" if failed_checks else ("incomplete" if self.incomplete else "passed")
        self.report["status"] = status
        (knobs.out / "stress.json").write_text(json.dumps(self.report, indent=1, default=str))
        (knobs.out / "stress.md").write_text(self.markdown())
        self.say(
            f"{status.upper()}: {len(self.checks)} checks, {len(failed_checks)} failed"
            + (f"; incomplete: {'; '.join(self.incomplete)}" if self.incomplete else "")
            + f"; results in {knobs.out}"
        )
        for check in failed_checks:
            print(
                f"  FAILED {check['phase']}/{check['server']}: {check['check']}: {check['detail']}",
                flush=True,
            )
        return {"passed": 0, "failed": 1, "incomplete": 2}[status]

    # Phases ---------------------------------------------------------------------------------

    def warm_up(self, live: dict[str, TritonServer], vocab: int) -> dict[str, dict]:
        """One burst per server at the top concurrency with short outputs (allocations that load brings
        happen here, not in the measured phase), from the client processes (a stream is a connection:
        thousands in this process could pass its file limit), then the idle memory as the baseline."""
        knobs = self.knobs
        names = list(live)
        plans = [
            plan_request(knobs.seed + 1, WARMUP_LEVEL, stream, 0, vocab, knobs.warmup_max_len)
            for stream in range(max(knobs.concurrency_cycle))
        ]
        args, owners = [], []
        for name in names:
            for process in range(knobs.client_procs):
                args.append(
                    (live[name].grpc_url, plans[process :: knobs.client_procs], knobs.response_timeout_s)
                )
                owners.append(name)
        returned = run_in_processes(burst_worker, args)
        baseline: dict[str, dict] = {}

        def settle(name: str, server: TritonServer) -> None:
            mine = [value for owner, value in zip(owners, returned, strict=True) if owner == name]
            errors = [str(value)[-500:] for value in mine if isinstance(value, WorkerFailed)]
            records = [r for value in mine if not isinstance(value, WorkerFailed) for r in value]
            # A logprobs request too: the solo checks ask for them.
            logprobs_plan = dataclasses.replace(plans[0], key=f"{WARMUP_LEVEL}-0-1", cancel_after=None)
            records.append(
                asdict(run_request(server.grpc_url, logprobs_plan, knobs.response_timeout_s, logprobs=2))
            )
            errors += [r["error"] for r in records if r["error"] is not None]
            self.check(
                "warm-up", name, "warm-up requests served", not errors, f"{len(errors)} errors: {errors[:3]}"
            )
            idle, _ = wait_idle(server, knobs.idle_timeout_s)
            baseline[name] = {"idle": idle, **memory(server)}

        threads = [threading.Thread(target=settle, args=item) for item in live.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.say("warm-up done; baseline memory " + _memory_line(baseline))
        return baseline

    def replay(self, live: dict[str, TritonServer], vocab: int, replay_s: float) -> dict:
        """The traffic phase: every server's client processes at once, malformed requests and metrics
        samples from a monitor thread; per server its records and summary."""
        knobs = self.knobs
        names = list(live)
        cycle = knobs.concurrency_cycle
        level_s = replay_s / len(cycle)
        start = time.time() + 3.0 + 0.5 * knobs.client_procs * len(names)  # spawn and import margin
        levels = [Level(i, c, start + i * level_s, start + (i + 1) * level_s) for i, c in enumerate(cycle)]
        args, owners = [], []
        for name in names:
            for process in range(knobs.client_procs):
                url = live[name].grpc_url
                args.append(
                    (
                        url,
                        knobs.seed,
                        vocab,
                        knobs.max_len,
                        levels,
                        process,
                        knobs.client_procs,
                        knobs.response_timeout_s,
                    )
                )
                owners.append(name)
        progress: dict[tuple[str, int], list[dict]] = {}
        printed: set[int] = set()

        def on_progress(index: int, payload: dict) -> None:
            progress.setdefault((owners[index], payload["level"]), []).append(payload)
            level = payload["level"]
            parts = [progress.get((name, level), []) for name in names]
            if level in printed or any(len(p) < knobs.client_procs for p in parts):
                return
            printed.add(level)
            cells = []
            for name, reports in zip(names, parts, strict=True):
                total = {k: sum(r[k] for r in reports) for k in ("finished", "cancelled", "errors", "tokens")}
                cells.append(
                    f"{name} {total['finished']} fin {total['cancelled']} can {total['errors']} err "
                    f"{total['tokens'] / level_s:.0f} tok/s"
                )
            self.say(f"level {level} (concurrency {cycle[level]}, {level_s:.0f} s): " + " | ".join(cells))

        cases = malformed_cases(vocab)
        schedule = malformed_schedule(replay_s, knobs.malformed_every_s, len(cases))
        malformed: dict[str, list[dict]] = {name: [] for name in names}
        samples: dict[str, list[dict]] = {name: [] for name in names}
        stop = threading.Event()

        def monitor() -> None:
            events = [(start + t, "malformed", i) for t, i in schedule]
            events += [(level.end, "sample", level.index) for level in levels]
            for moment, kind, value in sorted(events, key=lambda e: e[0]):
                while time.time() < moment:
                    if stop.wait(min(0.5, max(0.0, moment - time.time()))):
                        return
                if kind == "malformed":
                    for name in names:
                        result = send_malformed(live[name], cases[value])
                        result["at_s"] = round(moment - start, 1)
                        malformed[name].append(result)
                        if not result["ok"]:
                            self.say(f"malformed '{cases[value].name}' to {name}: NOT as expected: {result}")
                else:
                    for name in names:
                        samples[name].append(
                            {"level": value, **gauges(live[name], LOAD_GAUGES), **memory(live[name])}
                        )

        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        self.say(
            f"replay: {replay_s:.0f} s, concurrency {','.join(map(str, cycle))} ({level_s:.0f} s each), "
            f"{knobs.client_procs} client processes per server, {len(schedule)} malformed requests per server"
        )
        returned = run_in_processes(traffic_worker, args, on_progress)
        stop.set()
        watcher.join(timeout=120)
        records: dict[str, list[dict]] = {name: [] for name in names}
        worker_failures: dict[str, list[str]] = {name: [] for name in names}
        for name, value in zip(owners, returned, strict=True):
            if isinstance(value, WorkerFailed):
                worker_failures[name].append(str(value)[-2000:])
            else:
                records[name].extend(value)
        wall = max(time.time() - start, 1e-9)
        summary = {}
        for name in names:
            recs = records[name]
            totals = tally(recs)
            errors = [r["error"] for r in recs if r["error"] is not None]
            faults = [e for e in errors if "engine error" in e or "no response" in e or "connect" in e]
            per_level = []
            for level in levels:
                in_level = [r for r in recs if parse_key(r["key"])[0] == level.index]
                figures = tally(in_level)
                figures["tokens_per_s"] = round(figures["tokens"] / level_s, 1)
                per_level.append({"level": level.index, "concurrency": level.concurrency, **figures})
            reasons: dict[str, int] = {}
            for r in recs:
                if r["finished"]:
                    reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
            summary[name] = {
                **totals,
                "greedy": sum(r["greedy"] for r in recs),
                "finish_reasons": reasons,
                "tokens_per_s": round(totals["tokens"] / wall, 1),
                "error_examples": errors[:10],
                "faults": len(faults) + len(worker_failures[name]),
                "fault_examples": (faults + worker_failures[name])[:10],
                "per_level": per_level,
                "memory_samples": samples[name],
                "malformed": malformed[name],
            }
            self.check("replay", name, "no stream errors", not errors, f"{len(errors)} errors: {errors[:3]}")
            self.check(
                "replay",
                name,
                "client workers ran",
                not worker_failures[name],
                "; ".join(worker_failures[name])[:500],
            )
            bad = [m for m in malformed[name] if not m["ok"]]
            self.check(
                "replay",
                name,
                "malformed requests refused naming the field",
                len(malformed[name]) == len(schedule) and not bad,
                f"{len(malformed[name]) - len(bad)}/{len(schedule)} as expected"
                + (f"; first bad: {bad[0]}" if bad else ""),
            )
        return {
            "records": records,
            "summary": summary,
            "levels": [
                asdict(level) | {"start": round(level.start - start, 1), "end": round(level.end - start, 1)}
                for level in levels
            ],
            "malformed": [{"at_s": t, "case": cases[i].name, "field": cases[i].field} for t, i in schedule],
        }

    def plan_lookup(self, vocab: int) -> Callable[[str], RequestPlan]:
        """The plan of a record's key (the schedule is a pure function of the seed)."""
        knobs = self.knobs

        def plan_of(key: str) -> RequestPlan:
            level, stream, n = parse_key(key)
            return plan_request(knobs.seed, level, stream, n, vocab, knobs.max_len)

        return plan_of

    def after_phase(
        self,
        name: str,
        server: TritonServer,
        records: list[dict],
        baseline: dict,
        plan_of: Callable[[str], RequestPlan],
        on_gpu: bool,
    ) -> dict:
        """Checks after the replay: idle, memory, log, solo answers, readiness."""
        knobs = self.knobs
        result: dict[str, Any] = {}
        idle, last = wait_idle(server, knobs.idle_timeout_s)
        result["idle"] = {"reached": idle, **last}
        self.check("replay", name, "KV pages, running and waiting back to 0", idle, json.dumps(last))
        after = memory(server)
        result["memory"] = {"baseline": baseline, "after": after}
        if on_gpu:
            for kind, tolerance in (
                ("allocated", knobs.mem_tolerance_mib),
                ("reserved", knobs.reserved_tolerance_mib),
            ):
                before, now = baseline.get(kind), after.get(kind)
                if before is None or now is None:
                    self.check("replay", name, f"GPU memory {kind} not growing", False, "gauge not published")
                    continue
                growth = (now - before) / MIB
                result["memory"][f"{kind}_growth_mib"] = round(growth, 1)
                self.check(
                    "replay",
                    name,
                    f"GPU memory {kind} not growing",
                    growth <= tolerance,
                    f"{before / MIB:.0f} -> {now / MIB:.0f} MiB ({growth:+.1f}, tolerance {tolerance:.0f})",
                )
        else:
            self.check("replay", name, "GPU memory allocated not growing", None, "CPU: no GPU memory")
        flagged, restarts = scan_log(server.log_text())
        result["log_fault_lines"], result["restarts"] = flagged[:20], restarts
        self.check(
            "replay",
            name,
            "no CUDA error or traceback in the log",
            not flagged,
            " | ".join(flagged[:3])[:500],
        )
        self.check("replay", name, "no server restart", restarts == 0, f"{restarts} restarts")
        solo = solo_check(
            server,
            records,
            plan_of,
            knobs.solo_sample,
            knobs.solo_s,
            knobs.near_tie_nats,
            knobs.response_timeout_s,
            knobs.seed,
        )
        result["solo"] = solo
        self.check(
            "replay",
            name,
            "greedy streams equal their solo answers",
            solo["mismatch"] == 0 and not solo["errors"] and solo["checked"] > 0,
            f"{solo['checked']} checked of {solo['candidates']}: {solo['match']} match, "
            f"{solo['near_tie']} near ties, {solo['mismatch']} mismatches, {len(solo['errors'])} errors",
        )
        idle_again, _ = wait_idle(server, knobs.idle_timeout_s)
        ready = server_ready(server) and server.ready("dspark") and server.ready("dspark_generate")
        result["ready"] = ready
        self.check(
            "replay",
            name,
            "server ready after the phase",
            ready and idle_again,
            f"ready {ready}, idle {idle_again}",
        )
        self.say(
            f"checks {name}: idle {idle}, memory {_memory_line({name: after})}, log lines {len(flagged)}, "
            f"restarts {restarts}, solo {solo['match']} match / {solo['near_tie']} near tie / "
            f"{solo['mismatch']} mismatch of {solo['checked']}, ready {ready}"
        )
        return result

    def sanitize(self, results: dict, box_s: float) -> None:
        """memcheck over the engine with graphs, then racecheck over the eager engine's Triton kernels, each
        time-boxed."""
        knobs = self.knobs
        model_args = ["--model", knobs.model, "--draft-model", knobs.draft_model]
        runs = {
            "memcheck": (["--graphs", "--modes", "static,compact", *model_args], None),
            "racecheck": (["--no-graphs", "--modes", "static,compact", *model_args], TRITON_KERNELS),
        }
        outputs = []
        for tool, (target_args, kernels) in runs.items():
            result, output = run_sanitizer(tool, target_args, box_s, kernels)
            results[tool] = result
            outputs.append(f"=== {tool}: {result.get('command', '')}\n{output}\n")
        (knobs.out / "sanitizer.log").write_text("".join(outputs))

    def record_capture(self, capture: dict) -> None:
        """Checks and completeness of the capture phase."""
        if capture.get("status") == "skipped":
            return
        for run in capture.get("runs", []):
            detail = f"{run.get('graphs', 0)} graphs, token tiers {run.get('token_tiers', [])}"
            detail += f" in {run.get('seconds', '?')} s"
            if run.get("missing_token_tiers"):
                detail += f"; missing token tiers {run['missing_token_tiers']}"
            if run.get("failed_at"):
                detail += (
                    f"; failed at tokens={run['failed_at']['tokens']} requests={run['failed_at']['requests']}"
                )
            if run.get("error"):
                detail += "; " + run["error"].strip().splitlines()[-1]
            self.check(
                "capture", f"run {run['run']}", "every tier captured from a fresh start", run["ok"], detail
            )
        if not capture.get("explicit_tiers_supported"):
            self.incomplete.append(
                "capture: the engine has no cuda_graph_token_tiers, so 60/96/112 were not captured"
            )

    def record_sanitizer(self, results: dict) -> None:
        """Checks and completeness of the sanitizer phase."""
        if results.get("status") == "skipped":
            return
        for tool in ("memcheck", "racecheck"):
            result = results.get(tool)
            if result is None:
                self.incomplete.append(f"sanitizer {tool}: did not finish")
                continue
            if result["status"] in ("unavailable", "timeout"):
                self.incomplete.append(f"sanitizer {tool}: {result['detail']}")
            else:
                self.check(
                    "sanitizer", "-", f"{tool}: zero errors", result["status"] == "passed", result["detail"]
                )
        statuses = [results.get(t, {}).get("status") for t in ("memcheck", "racecheck")]
        results["status"] = (
            "passed" if statuses == ["passed", "passed"] else ",".join(str(s) for s in statuses)
        )

    def write_server_logs(self, owners: dict[str, ServerOwner]) -> None:
        """Each server's flagged lines and the tail of its log, in one file."""
        parts = []
        for name, owner in owners.items():
            text = owner.server.log_text() if owner.server.log_path.exists() else ""
            flagged, restarts = scan_log(text)
            parts.append(f"=== {name}: {owner.server.log_path} ({restarts} restarts)\n--- flagged lines\n")
            parts.append("\n".join(flagged[:50]) + "\n--- tail\n" + "\n".join(text.splitlines()[-80:]) + "\n")
        (self.knobs.out / "server-logs.txt").write_text("".join(parts))

    def markdown(self) -> str:
        """The summary tables."""
        report = self.report
        lines = [
            f"# Stress run: {report['status']}",
            "",
            f"Device {report['device']}, {report['wall_s']} s in all, "
            f"replay {report['replay']['replay_s']} s "
            f"at concurrency {','.join(map(str, self.knobs.concurrency_cycle))}; explicit token tiers: "
            f"{report['explicit_token_tiers']}.",
            "",
        ]
        if self.incomplete:
            lines += ["Incomplete: " + "; ".join(self.incomplete), ""]
        lines += [
            "| server | requests | finished | cancelled | errors | faults | tok/s "
            "| solo match / near tie / mismatch | malformed ok "
            "| GPU MiB allocated before -> after | reserved before -> after |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, s in report["replay"]["servers"].items():
            solo = s.get("solo", {})
            mem = s.get("memory", {})
            base, after = mem.get("baseline", {}), mem.get("after", {})
            lines.append(
                f"| {name} | {s.get('requests', 0)} | {s.get('finished', 0)} | {s.get('cancelled', 0)} | "
                f"{s.get('errors', 0)} | {s.get('faults', 0)} | {s.get('tokens_per_s', 0)} | "
                f"{solo.get('match', 0)} / {solo.get('near_tie', 0)} / {solo.get('mismatch', 0)} | "
                f"{sum(m['ok'] for m in s.get('malformed', []))}/{len(s.get('malformed', []))} | "
                f"{_mib(base.get('allocated'))} -> {_mib(after.get('allocated'))} | "
                f"{_mib(base.get('reserved'))} -> {_mib(after.get('reserved'))} |"
            )
        lines += ["", "Per level (finished / cancelled / errors, tok/s):", ""]
        names = list(report["replay"]["servers"])
        lines += ["| level | concurrency | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for index, level in enumerate(report["replay"]["levels"]):
            cells = []
            for name in names:
                per = report["replay"]["servers"][name].get("per_level", [])
                p = per[index] if index < len(per) else {}
                cells.append(
                    f"{p.get('finished', 0)} / {p.get('cancelled', 0)} / {p.get('errors', 0)}, "
                    f"{p.get('tokens_per_s', 0)}"
                )
            lines.append(f"| {index} | {level['concurrency']} | " + " | ".join(cells) + " |")
        capture = report["capture"]
        lines += ["", f"Capture: {capture.get('status')} {capture.get('detail', '')}"]
        for run in capture.get("runs", []):
            lines.append(
                f"- run {run['run']} ({run['spec_mode']}): {'ok' if run['ok'] else 'FAILED'}, "
                f"{run.get('graphs', 0)} graphs, {run.get('seconds', '?')} s, "
                f"token tiers {run.get('token_tiers', [])}"
            )
        if capture.get("first_failure"):
            lines.append(f"- first failure: {capture['first_failure']}")
        sanitizer = report["sanitizer"]
        lines += ["", f"Sanitizer: {sanitizer.get('status')} {sanitizer.get('detail', '')}"]
        for tool in ("memcheck", "racecheck"):
            if tool in sanitizer:
                r = sanitizer[tool]
                lines.append(f"- {tool}: {r['status']} ({r.get('detail', '')}, {r.get('seconds', '?')} s)")
        lines += ["", "Attribution of failed checks (features of exactly the failing servers):", ""]
        for check, verdict in report["attribution"]["checks"].items():
            lines.append(f"- {check}: {verdict}")
        failed = [c for c in self.checks if c["passed"] is False]
        lines += ["", f"Checks: {len(self.checks)}, failed {len(failed)}", ""]
        lines += [f"- FAILED {c['phase']}/{c['server']}: {c['check']}: {c['detail']}" for c in failed]
        return "\n".join(lines) + "\n"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.0f}"


def _memory_line(memory_by_server: dict[str, dict]) -> str:
    return ", ".join(
        f"{name} {_mib(m.get('allocated'))}/{_mib(m.get('reserved'))} MiB"
        for name, m in memory_by_server.items()
    )


# Command line -----------------------------------------------------------------------------------

TINY = {
    "servers": "main-static,main-compact",
    "replay_s": 20.0,
    "deadline_s": 0.0,
    "concurrency_cycle": "1,4,8",
    "max_len": 16,
    "client_procs": 1,
    "solo_sample": 6,
    "solo_s": 20.0,
    "malformed_every_s": 8.0,
    "response_timeout_s": 60.0,
    "idle_timeout_s": 20.0,
    "capture_runs": 0,
    "sanitizer_s": 0.0,
    "kv_pages": 96,
    "max_num_seqs": 8,
    "max_model_len": 64,
    "warmup_max_len": 4,
}


def parse_args(argv: list[str] | None) -> Knobs:
    """The run's knobs from the command line (--tiny sets the CPU smoke defaults; explicit flags win)."""
    default_out = Path(os.environ["OUT"]) / "stress" if os.environ.get("OUT") else Path("/tmp/dspark-stress")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--tiny",
        action="store_true",
        help="CPU smoke run: two servers, 20 s, small lengths, no capture/sanitizer",
    )
    add("--out", type=Path, default=default_out, help="results (default $OUT/stress or /tmp/dspark-stress)")
    add("--work-dir", type=Path, help="rendered repositories and whole server logs (default: a new tmp dir)")
    add("--servers", help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    add("--replay-s", type=float, help="seconds of traffic (default 300)")
    add(
        "--deadline-s",
        type=float,
        help="shorten the replay so that the run ends by then (default 540; 0: none)",
    )
    add(
        "--concurrency-cycle",
        help="concurrency levels, each replay-s / count seconds (default 1,60,96,112,128,256)",
    )
    add("--max-len", type=int, help="longest prompt and output, in tokens (default 512)")
    add("--client-procs", type=int, help="client processes per server (default 2)")
    add("--seed", type=int, default=0, help="the traffic schedule's seed (default 0)")
    add("--solo-sample", type=int, help="greedy streams re-run alone per server (default 32)")
    add("--solo-s", type=float, help="time box of a server's solo re-runs (default 75)")
    add(
        "--near-tie-nats",
        type=float,
        default=1e-4,
        help="top-2 margin under which a difference is a near tie",
    )
    add("--malformed-every-s", type=float, help="seconds between malformed requests (default 60)")
    add("--response-timeout-s", type=float, help="longest wait for a stream's next response (default 120)")
    add(
        "--idle-timeout-s", type=float, help="longest wait for a server to drain after the phase (default 60)"
    )
    add("--capture-runs", type=int, help="fresh-start captures (default 5; 0: none)")
    add("--capture-parallel", type=int, default=3, help="captures at once (default 3)")
    add("--capture-timeout-s", type=float, default=240.0, help="time box of one capture run")
    add("--sanitizer-s", type=float, help="time box of each compute-sanitizer run (default 120; 0: none)")
    add(
        "--token-tiers", default=DEFAULT_TOKEN_TIERS, help="cuda_graph_token_tiers when the engine takes them"
    )
    add("--dtype", default="float32", help="the servers' dtype (default float32: exact solo comparison)")
    add("--kv-pages", type=int, help="KV pages per server (default 8192)")
    add("--kv-page-size", type=int, default=16)
    add("--max-num-seqs", type=int, help="(default 256)")
    add("--max-num-batched-tokens", type=int, default=512)
    add("--max-model-len", type=int, help="(default 2 x max-len + 64)")
    add("--cuda-graph-max-tokens", type=int, default=512, help="the mains' and spec-off control's graphs")
    add("--adaptive-speculation", action="store_true", help="let the gate choose (default: draft every step)")
    add("--model", default="", help="target directory (default: the embedded SmolLM2-135M-Instruct)")
    add("--draft-model", default="", help="drafter directory (default: the embedded default's)")
    add("--mem-tolerance-mib", type=float, default=64.0, help="allowed growth of GPU memory allocated")
    add("--reserved-tolerance-mib", type=float, default=1024.0, help="allowed growth of GPU memory reserved")
    args = parser.parse_args(argv)
    defaults = {
        "servers": ",".join(VARIANTS),
        "replay_s": 300.0,
        "deadline_s": 540.0,
        "concurrency_cycle": "1,60,96,112,128,256",
        "max_len": 512,
        "client_procs": 2,
        "solo_sample": 32,
        "solo_s": 75.0,
        "malformed_every_s": 60.0,
        "response_timeout_s": 120.0,
        "idle_timeout_s": 60.0,
        "capture_runs": 5,
        "sanitizer_s": 120.0,
        "kv_pages": 8192,
        "max_num_seqs": 256,
        "max_model_len": 0,
        "warmup_max_len": 16,
    }
    if args.tiny:
        defaults.update(TINY)
    values = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in defaults.items()}
    servers = [s for s in values["servers"].split(",") if s]
    unknown = [s for s in servers if s not in VARIANTS]
    if unknown:
        parser.error(f"--servers: unknown {unknown}; known: {list(VARIANTS)}")
    return Knobs(
        out=args.out,
        work_dir=args.work_dir,
        servers=servers,
        replay_s=float(values["replay_s"]),
        deadline_s=float(values["deadline_s"]),
        concurrency_cycle=[int(c) for c in str(values["concurrency_cycle"]).split(",")],
        max_len=int(values["max_len"]),
        client_procs=int(values["client_procs"]),
        seed=args.seed,
        solo_sample=int(values["solo_sample"]),
        solo_s=float(values["solo_s"]),
        near_tie_nats=args.near_tie_nats,
        malformed_every_s=float(values["malformed_every_s"]),
        response_timeout_s=float(values["response_timeout_s"]),
        idle_timeout_s=float(values["idle_timeout_s"]),
        capture_runs=int(values["capture_runs"]),
        capture_parallel=args.capture_parallel,
        capture_timeout_s=args.capture_timeout_s,
        sanitizer_s=float(values["sanitizer_s"]),
        token_tiers=args.token_tiers,
        dtype=args.dtype,
        kv_pages=int(values["kv_pages"]),
        kv_page_size=args.kv_page_size,
        max_num_seqs=int(values["max_num_seqs"]),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=int(values["max_model_len"]),
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        adaptive_speculation=args.adaptive_speculation,
        model=args.model,
        draft_model=args.draft_model,
        mem_tolerance_mib=args.mem_tolerance_mib,
        reserved_tolerance_mib=args.reserved_tolerance_mib,
        warmup_max_len=int(values["warmup_max_len"]),
    )


def main(argv: list[str] | None = None) -> int:
    """Dispatch: the stress run, or one of its child entry points."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "capture-target":
        return capture_target(argv[1])
    if argv and argv[0] == "sanitizer-target":
        parser = argparse.ArgumentParser(prog="stress.py sanitizer-target")
        parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
        parser.add_argument("--modes", default="static")
        parser.add_argument("--max-tokens", type=int, default=12)
        parser.add_argument("--model", default="")
        parser.add_argument("--draft-model", default="")
        args = parser.parse_args(argv[1:])
        return sanitizer_target(
            args.graphs, args.modes.split(","), args.max_tokens, args.model, args.draft_model
        )
    return Run(parse_args(argv)).execute()


if __name__ == "__main__":
    raise SystemExit(main())
