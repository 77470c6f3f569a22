"""Tensor-parallel workers: ranks 1..N-1 as spawned processes that only execute the driver's steps.

The driver (the engine's process, rank 0) spawns one process per further rank. Each loads its shard
and its KV cache shard, reports `loaded`, joins the TP group (NCCL on CUDA, gloo on CPU), then loops:
receive a TargetStep through its pipe, run the forward (the collectives inside the layers keep the
ranks in step), repeat, until a `shutdown` message. On CUDA a `capture` message first captures every
step graph, the tiers and order agreed with the other ranks (`CudaGraphs.capture_all`: all ranks, or
none, replay graphs), so later steps replay graphs with the collectives inside.
Steps travel as pickled bytes through a private pipe per rank, so the control path is the same on
both backends and needs no named shared memory.

Failure is bounded: a worker that raises reports its traceback and exits; the driver's watchdog
thread notices a rank that dies (or a step that outlives the timeout), kills the whole group and
releases a driver blocked in a collective, so the step raises TensorParallelError. A worker whose
driver disappears exits on its own.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import torch

from dspark.config import EngineConfig
from dspark.parallel.distributed import TensorParallel, abort_group, join_group, leave_group, rendezvous_store
from dspark.parallel.spawning import python_executable, spawning_with
from dspark.process_heap import freeze_startup_heap, skip_exit_collection

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often the watchdog checks the running step's deadline
STOP_GRACE_S = 5.0  # a worker told to shut down gets this long before it is killed
# Collectives time out only after this many step timeouts: they are the backstop, so the driver's
# watchdog (which says what went wrong and releases the driver) normally acts first on a hung rank.
COLLECTIVE_TIMEOUT_FACTOR = 2
# A rank's load (its shard read, a CPU's product paths measured, ...) gets at least this long, whatever
# `tensor_parallel_timeout_s` says: that bounds steps, and a timeout short enough to catch a hung step in
# seconds would fail a load that is only slow (three CPU ranks on a 2-core host measuring their product
# paths at once took over 10 s).
RANK_LOAD_TIMEOUT_S = 300.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or failed; the group is gone and the engine cannot go on."""


class ShardRunner(Protocol):
    """What a rank executes: its target shard's runner (`model_runner.ModelRunner`)."""

    device: torch.device

    def capture_graphs(self, capture_layers: tuple[int, ...]) -> object: ...

    def forward(self, step: Any) -> Any: ...

    def release_graphs(self) -> None: ...


# Loads a rank's shard: (config, device, dtype, tp) -> its runner. The driver passes
# `ModelRunner.create`, so that this module, which model_runner imports, imports no runner.
LoadShard = Callable[[EngineConfig, torch.device, torch.dtype, TensorParallel], ShardRunner]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned rank needs (pickled into the new process)."""

    config: EngineConfig
    rank: int
    size: int
    device: str
    dtype: torch.dtype
    store_port: int
    num_threads: int
    load_shard: LoadShard


# The worker process --------------------------------------------------------------------------------


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of rank `spec.rank` in its spawned process: load, join, execute steps, exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the driver decides
    _exit_with_parent()
    try:
        runner = _load_shard(spec)
        conn.send_bytes(pickle.dumps(("loaded",)))
        timeout = collective_timeout_s(spec.config)
        store = rendezvous_store(spec.store_port, timeout)
        join_group(spec.rank, spec.size, store, timeout, runner.device)
        freeze_startup_heap()
        _execute_steps(runner, conn)
        runner.release_graphs()  # graphs with NCCL inside would block the group's destroy
        leave_group()
        skip_exit_collection()
    except EOFError:  # the driver closed its end without a shutdown message: it is gone
        os._exit(0)
    except BaseException:
        _report(conn, traceback.format_exc())
        os._exit(1)


def _load_shard(spec: WorkerSpec) -> ShardRunner:
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return spec.load_shard(spec.config, device, spec.dtype, TensorParallel(spec.rank, spec.size))


def _execute_steps(runner: ShardRunner, conn: Connection) -> None:
    """Run every step (and graph capture) the driver sends, exactly as rank 0 runs it, until `shutdown`."""
    while True:
        message = pickle.loads(conn.recv_bytes())
        if message[0] == "shutdown":
            return
        if message[0] == "capture":
            runner.capture_graphs(message[1])
        else:
            runner.forward(message[1])


def _report(conn: Connection, text: str) -> None:
    try:
        conn.send_bytes(pickle.dumps(("error", text)))
    except OSError:
        pass


def _exit_with_parent() -> None:
    """Exit as soon as the driver process is gone, even while blocked in a collective."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="dspark-tp-parent-watch", daemon=True).start()


# The driver side -----------------------------------------------------------------------------------


def collective_timeout_s(config: EngineConfig) -> float:
    """How long a collective (or the rendezvous) waits for a missing rank before it raises."""
    return COLLECTIVE_TIMEOUT_FACTOR * config.tensor_parallel_timeout_s


class WorkerGroup:
    """Ranks 1..N-1 of one engine: spawned, fed steps through pipes, watched, stopped."""

    def __init__(self, processes: list[mp.process.BaseProcess], conns: list[Connection], timeout_s: float):
        self._processes = processes
        self._conns = conns
        self._timeout_s = timeout_s
        self._failure: str | None = None
        self._step_deadline: float | None = None
        self._lock = threading.Lock()
        self._failure_lock = threading.Lock()
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    @classmethod
    def spawn(
        cls,
        config: EngineConfig,
        devices: list[torch.device],
        dtype: torch.dtype,
        store_port: int,
        threads: int,
        load_shard: LoadShard,
    ) -> WorkerGroup:
        """Start one process per rank 1..len(devices)-1 (each with `threads` intra-op threads); they
        load their shards (`load_shard`) in the background."""
        size = len(devices)
        context = mp.get_context("spawn")
        processes, conns = [], []
        with spawning_with(context, python_executable()):
            for rank in range(1, size):
                device = str(devices[rank])
                spec = WorkerSpec(config, rank, size, device, dtype, store_port, threads, load_shard)
                ours, theirs = context.Pipe(duplex=True)
                process = context.Process(
                    target=worker_main, args=(spec, theirs), name=f"dspark-tp-rank{rank}", daemon=True
                )
                process.start()
                theirs.close()
                processes.append(process)
                conns.append(ours)
        return cls(processes, conns, config.tensor_parallel_timeout_s)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._processes if p.pid is not None]

    def wait_loaded(self) -> None:
        """Block until every rank loaded its shard; TensorParallelError (with the rank's own error) if
        one fails, dies or takes longer than the step timeout or RANK_LOAD_TIMEOUT_S, the longer."""
        pending = dict(enumerate(self._conns, start=1))
        timeout_s = max(self._timeout_s, RANK_LOAD_TIMEOUT_S)
        deadline = time.monotonic() + timeout_s
        while pending:
            rank_of = {conn: rank for rank, conn in pending.items()}
            rank_of |= {self._processes[rank - 1].sentinel: rank for rank in pending}
            ready = wait(list(rank_of), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = ", ".join(str(r) for r in pending)
                raise self.fail(f"rank(s) {ranks} did not load within {timeout_s:g}s")
            for handle in ready:
                rank = rank_of[handle]
                if rank not in pending:
                    continue
                message = _receive(pending[rank]) if handle is pending[rank] else None
                if message == ("loaded",):
                    del pending[rank]
                    continue
                error = message[1] if message is not None and message[0] == "error" else None
                raise self.fail(self._describe_exit(rank, "failed to start", error), name_dead=False)

    def start_watchdog(self) -> None:
        """Watch the ranks from now on (call once the group is up)."""
        self._watchdog = threading.Thread(target=self._watch, name="dspark-tp-watchdog", daemon=True)
        self._watchdog.start()

    def send(self, message: tuple[str, Any]) -> None:
        """Hand every rank one ("step", TargetStep) or ("capture", capture_layers) message; the driver
        then runs its own share."""
        self.check()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as exc:
            raise self.fail(f"could not send a {message[0]}: {exc}") from exc

    @contextmanager
    def step(self) -> Iterator[None]:
        """Mark a step in flight: the watchdog fails it once it outlives the timeout."""
        self._step_deadline = time.monotonic() + self._timeout_s
        try:
            yield
        finally:
            self._step_deadline = None

    def check(self) -> None:
        """Raise TensorParallelError if the group has failed."""
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def fail(self, reason: str, name_dead: bool = True) -> TensorParallelError:
        """Record the group's failure (the first reported wins; `name_dead` adds a rank that died),
        stop every rank, and return the error to raise."""
        dead = self._first_dead(grace_s=1.0) if name_dead and self._failure is None else None
        with self._failure_lock:
            if self._failure is None:
                self._failure = f"tensor-parallel group failed: {reason}" + (f"; {dead}" if dead else "")
                logger.error(self._failure)
        self.stop(graceful=False)
        return TensorParallelError(self._failure)

    def stop(self, graceful: bool = True) -> None:
        """Shut every rank down (asked first when `graceful`, killed if it does not go) and reap it."""
        with self._lock:
            self._stopped.set()
            if graceful:
                for conn in self._conns:
                    try:
                        conn.send_bytes(pickle.dumps(("shutdown",)))
                    except OSError:
                        pass
                deadline = time.monotonic() + STOP_GRACE_S
                for process in self._processes:
                    process.join(max(0.0, deadline - time.monotonic()))
            for process in self._processes:
                if process.is_alive():
                    process.kill()
            for process in self._processes:
                process.join()
            for conn in self._conns:
                conn.close()
            self._conns = []
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()

    # Watching -----------------------------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes, start=1)}
        while not self._stopped.is_set():
            died = wait(list(sentinels), timeout=WATCH_INTERVAL_S)
            if self._stopped.is_set():
                return
            deadline = self._step_deadline
            if died:
                reason = self._describe_exit(self._culprit(), "died")
            elif deadline is not None and time.monotonic() > deadline:
                reason = f"a step took longer than tensor_parallel_timeout_s ({self._timeout_s:g}s)"
            else:
                continue
            self.fail(reason, name_dead=False)
            abort_group()
            return

    def _first_dead(self, grace_s: float) -> str | None:
        """Describe a rank that exited, waiting up to grace_s for one (a collective error usually
        arrives a moment before the dead rank's exit is visible)."""
        died = wait([p.sentinel for p in self._processes], timeout=grace_s)
        return self._describe_exit(self._culprit(), "died") if died else None

    def _culprit(self) -> int:
        """Of the ranks that exited, the likeliest cause: one killed by a signal (the others then fail
        their collectives and exit with an error), else the lowest."""
        time.sleep(0.1)  # let ranks that fail because of another one finish exiting
        exited = [rank for rank, p in enumerate(self._processes, start=1) if p.exitcode is not None]
        return min(exited, key=lambda r: (self._processes[r - 1].exitcode >= 0, r))

    def _describe_exit(self, rank: int, what: str, error: str | None = None) -> str:
        process = self._processes[rank - 1]
        process.join(1.0)
        code = process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        text = f"rank {rank} (pid {process.pid}) {what} ({how})"
        error = error or self._error_from(rank)
        return f"{text}:\n{error.rstrip()}" if error else text

    def _error_from(self, rank: int) -> str | None:
        """The traceback a failed rank reported before exiting, if it did."""
        conn = self._conns[rank - 1] if rank - 1 < len(self._conns) else None
        while conn is not None and (message := _receive(conn, block=False)) is not None:
            if message[0] == "error":
                return message[1]
        return None


def _receive(conn: Connection, block: bool = True) -> tuple | None:
    """The next message from a rank; None when there is none (or the rank is gone)."""
    try:
        if not block and not conn.poll(0):
            return None
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None
