"""EngineProcess: AsyncEngine's interface with the engine in a child process of its own.

Inside Triton's Python backend, the adapter's response thread (building tensors, sending responses,
publishing metrics) and the engine's step loop would share one interpreter and its GIL: every
response the server sends then takes time from the next engine step. Here the engine core runs in a
spawned process (its own GIL, its own CUDA context); the adapter's process keeps only request and
response I/O. Two pipes connect them:

- control: the adapter's `submit` (checked and tokenized on the adapter's side first, so a bad request
  still fails at once and alone, naming the field), `abort`, `cancel` (by Triton id), `shutdown`;
- events (engine -> adapter): batches of deltas (a step's, as columns: `dspark.outputs.pack_deltas`,
  written by the step loop itself while the adapter keeps up; when the adapter reads slower than the
  engine steps, everything committed meanwhile in one batch: `_Outbox`) with an occupancy snapshot,
  and the engine's death. The engine leaves the text of requests without stop strings to this side,
  which makes it from their token ids (`DeltaText`) as the engine would: detokenizing every request
  at every step took the step loop's time, and here it is done once per batch of a request's tokens.

The engine process reads every adapter's commands on its step loop's thread, between steps
(`_ControlIntake`): a control thread of its own took the GIL from the loop at every request.

Several adapters (the backend stubs of a model's instances, dspark.serving.shared_engine) may share
one engine process: the one that spawns it passes `listen`, the others `attach` over that Unix socket
with pipes of their own; each gets its own requests' deltas, and a cancel by Triton id reaches every
adapter's requests.

Faults: if the engine loop dies, its requests' failed deltas arrive first, then the death; if the
engine process itself dies (killed, out of memory), the adapter sees its events pipe close and fails
every request it was waiting on. Either way `on_death` is called once and `healthy` turns False. The
engine process exits when the spawning adapter shuts down or any adapter's control pipe closes without
that, so it never outlives its adapters.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import select
import struct
import threading
import time
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import recv_handle, send_handle
from typing import TYPE_CHECKING, Any

from dspark.config import EngineConfig
from dspark.engine.api import DeathCallback, DeltaCallback, EngineDeadError
from dspark.outputs import EngineLoad, RequestDelta, merge_by_request, pack_deltas, unpack_deltas
from dspark.parallel.spawning import python_executable, spawning_with
from dspark.process_heap import freeze_startup_heap, skip_exit_collection
from dspark.prompts import check_prompt
from dspark.sampling_params import SamplingParams
from dspark.serving.request_inputs import CANCEL_ALL
from dspark.tokenizer import DeltaText, Tokenizer

if TYPE_CHECKING:
    from dspark.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # past the engine's own shutdown, before its process is killed
LOAD_INTERVAL_S = 0.1  # how often an idle engine process reports a changed occupancy
LOAD_EVERY_S = 0.02  # the occupancy goes with a batch of deltas at most this often (and when one ended)
SENDER_FAILED_STATUS = 70  # the engine process's exit status when its events could not be sent
FRAME_HEADER_BYTES = 12  # the most `Connection.send_bytes` writes before a message (its length)
READ_CHUNK_BYTES = 1 << 20  # the most the engine loop reads of its commands at once
# While its requests are in flight an adapter looks for deltas every eighth of the time between the
# engine's messages (its step time), within these bounds (see `EngineProcess._read_events`).
READ_TICK_S = (0.0005, 0.01)
EngineFactory = Callable[..., "AsyncEngine"]  # (config, on_death=, after_step=, intake=) -> the engine


class EngineClosedError(RuntimeError):
    """The engine shut down with the adapter that spawned it (its model is being unloaded); an attached
    adapter's `on_death` gets this cause instead of a fault."""


class EngineProcess:
    """Runs an AsyncEngine in a spawned process and relays requests and deltas (see the module)."""

    def __init__(
        self,
        config: EngineConfig,
        on_death: DeathCallback | None = None,
        engine_factory: EngineFactory | None = None,
        listen: str | None = None,
    ) -> None:
        """Spawn the engine process and wait until its engine is built (model load, CUDA graphs).

        engine_factory (picklable; default AsyncEngine): builds the engine in the engine process from
        (config, on_death, after_step, intake); benchmarks/serving_ceiling.py puts a synthetic one here.
        listen: a Unix socket path where other adapters may then `attach` to the same engine."""
        self._setup(config, on_death)
        self.owner = True  # this adapter spawned the process: the engine stops when it shuts down
        context = mp.get_context("spawn")
        self._control, control_theirs = context.Pipe(duplex=True)
        self._events, events_theirs = context.Pipe(duplex=False)
        with spawning_with(context, python_executable()):
            # Not a daemon: a tensor-parallel engine spawns rank processes of its own.
            self._process = context.Process(
                target=engine_main,
                args=(config, control_theirs, events_theirs, engine_factory, listen),
                name="dspark-engine",
            )
            self._process.start()
        control_theirs.close()
        events_theirs.close()
        self._await_ready()

    @classmethod
    def attach(
        cls, address: str, config: EngineConfig, on_death: DeathCallback | None = None
    ) -> EngineProcess:
        """Another adapter of the engine process listening at `address` (a model's other instance): its
        own pair of pipes, whose far ends it passes over the socket. The engine process serves it until
        it shuts down, or until the spawning adapter does (its events then end: `on_death`)."""
        self = cls.__new__(cls)
        self._setup(config, on_death)
        self.owner = False
        self._process = None
        control_theirs, control_ours = os.pipe()
        events_ours, events_theirs = os.pipe()
        try:
            with Client(address, family="AF_UNIX") as conn:
                send_handle(conn, control_theirs, 0)
                send_handle(conn, events_theirs, 0)
        finally:
            os.close(control_theirs)
            os.close(events_theirs)
        self._control = Connection(control_ours, readable=False)
        self._events = Connection(events_ours, writable=False)
        self._await_ready()
        return self

    def _setup(self, config: EngineConfig, on_death: DeathCallback | None) -> None:
        self.config = config
        self._on_death = on_death
        self._callbacks: dict[str, DeltaCallback] = {}
        # Requests whose text this process makes from their token ids (the engine leaves it here).
        self._texts: dict[str, DeltaText] = {}
        self._cancels: dict[int, tuple[Callable[[int], None], Callable[[], None]]] = {}
        self._next_cancel = 0
        self._lock = threading.Lock()  # the callbacks and cancels
        self._control_lock = threading.Lock()  # one command at a time on the control pipe
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._load = EngineLoad(0, 0, 0, 0)

    def _await_ready(self) -> None:
        try:
            kind, detail = self._events.recv()
        except EOFError:
            status = "" if self._process is None else self._process.join(5) or ""
            kind, detail = "failed", f"the engine process exited with status {status}"
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"the engine process failed to start:\n{detail}")
        self._vocab_size, self._max_model_len = detail
        # The adapter's own: it tokenizes and checks prompts here (see `submit`) and decodes them.
        self.tokenizer = Tokenizer.from_dir(self.config.model_path)
        self._reader = threading.Thread(target=self._read_events, name="dspark-engine-events", daemon=True)

    def start(self) -> None:
        """Start relaying the engine's deltas (idempotent)."""
        if not self._reader.is_alive() and not self._stopping.is_set():
            self._reader.start()

    @property
    def healthy(self) -> bool:
        """False once the engine died, its process exited, or shutdown began."""
        alive = self._process is None or self._process.is_alive()  # attached: the events pipe tells
        return self._error is None and not self._stopping.is_set() and alive

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, if it did."""
        return self._error

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        on_delta: DeltaCallback,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        tag: str = "",
    ) -> list[int]:
        """Validate and tokenize one request here, queue it in the engine process; its prompt token ids.
        tag: what `cancel` finds it by (the Triton request id).

        Raises InvalidParameterError (naming the field) for a bad request, EngineDeadError when the
        engine is not running. No reply is awaited: a submission waiting on the engine process's
        control thread (which shares that process's GIL with the step loop) held up every request
        behind it. A request the engine still refuses at admission ends with a failed delta.
        """
        # Not `healthy`: asking whether the process lives is a system call (waitpid) per request, where
        # the stub's threads wait for the GIL after it. A process that died closes the events pipe
        # (the reader then sets the error) and the control pipe (the send below fails).
        if self._error is not None or self._stopping.is_set():
            raise EngineDeadError(f"engine is not running: {self._error!r}")
        ids = check_prompt(
            prompt, prompt_token_ids, params, self.tokenizer, self._vocab_size, self._max_model_len
        )
        # Stop strings: the engine makes the text (it decides the finish); else this side does.
        text = (
            None if params.stop else DeltaText.after_prompt(self.tokenizer, ids, params.skip_special_tokens)
        )
        with self._lock:  # before the engine can answer: its first delta may come at once
            self._callbacks[request_id] = on_delta
            if text is not None:
                self._texts[request_id] = text
        try:
            with self._control_lock:
                self._control.send(("submit", request_id, params, ids, time.monotonic(), tag))
        except (OSError, EOFError):
            with self._lock:
                self._callbacks.pop(request_id, None)
                self._texts.pop(request_id, None)
            raise EngineDeadError("engine is not running: the engine process is gone") from None
        return ids

    def abort(self, request_id: str) -> None:
        """Cancel a request; it ends with reason 'abort' at the engine's next step."""
        self._command(("abort", request_id))

    def cancel(self, target: str, on_matched: Callable[[int], None], on_done: Callable[[], None]) -> None:
        """Abort the requests of every adapter of this engine tagged `target` (CANCEL_ALL: all of them).
        on_matched(count) follows as soon as the engine process has looked; on_done() once the last of
        them ended there (not called when none matched). Raises EngineDeadError when it cannot ask."""
        with self._lock:
            token = self._next_cancel = self._next_cancel + 1
            self._cancels[token] = (on_matched, on_done)
        try:
            with self._control_lock:
                self._control.send(("cancel", target, token))
        except (OSError, EOFError):
            with self._lock:
                self._cancels.pop(token, None)
            raise EngineDeadError("engine is not running: the engine process is gone") from None

    def load(self) -> EngineLoad:
        """The occupancy the engine reported with its last batch of deltas (to the spawning adapter;
        an attached one keeps the empty load it started with)."""
        return self._load

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort this adapter's requests in flight (their last deltas are relayed) and leave the engine
        process; when this adapter spawned it, stop the engine and its process (any attached adapter's
        events then end: `EngineClosedError`)."""
        self._stopping.set()
        self._command(("shutdown",))
        if self._process is not None:
            self._process.join(timeout + SHUTDOWN_GRACE_S)
            self._kill()
        if self._reader.is_alive():
            self._reader.join(timeout if self._process is None else SHUTDOWN_GRACE_S)

    # The adapter's side -----------------------------------------------------------------------

    def _command(self, message: tuple) -> None:
        try:
            with self._control_lock:
                self._control.send(message)
        except (OSError, EOFError):
            pass  # the engine process is gone; the events reader reports it

    def _read_events(self) -> None:
        closing = False  # the spawning adapter shut the engine down (an attached adapter hears it)
        shortest, longest = READ_TICK_S
        tick, last = shortest, time.monotonic()
        while True:
            try:
                # While requests are in flight, look every `tick` rather than block in the read: a
                # reader blocked on the pipe is woken by each of the step loop's writes, inside the
                # loop's write (on 2 busy cores 652 of the 951 us a step the loop spent handing over
                # 8 requests' deltas). Idle, it blocks: the first delta wakes it once. `tick`: an
                # eighth of the time between the engine's messages (a moving average), in READ_TICK_S.
                polled = bool(self._callbacks)
                while self._callbacks and not self._events.poll(0):
                    time.sleep(tick)
                message = self._events.recv()
            except (EOFError, OSError):
                break
            now = time.monotonic()
            if polled:  # the time since the last message is then the engine's pace, not an idle wait
                tick = min(max(0.75 * tick + 0.25 * (now - last) / 8, shortest), longest)
            last = now
            if message[0] == "deltas":
                if message[2] is not None:  # an attached adapter gets none (`_Client.start`)
                    self._load = message[2]
                self._dispatch(unpack_deltas(message[1]))
            elif message[0] == "load":
                self._load = message[1]
            elif message[0] in ("cancel_matched", "cancel_done"):
                self._cancel_answer(*message)
            elif message[0] == "closing":
                closing = True
            elif message[0] == "dead":
                self._died(RuntimeError(message[1]))
        if not self._stopping.is_set():
            if closing:
                self._died(EngineClosedError("the engine shut down with the instance that spawned it"))
            elif self._process is None:
                self._died(RuntimeError("the engine process stopped serving this instance"))
            else:
                self._process.join(1)
                self._died(RuntimeError(f"the engine process exited (status {self._process.exitcode})"))
        self._fail_all("the engine process stopped")

    def _cancel_answer(self, kind: str, token: int, *count: int) -> None:
        with self._lock:
            callbacks = self._cancels.get(token)
            if callbacks is not None and (kind == "cancel_done" or not count[0]):
                del self._cancels[token]
        if callbacks is None:
            return
        on_matched, on_done = callbacks
        if kind == "cancel_matched":
            on_matched(count[0])
        else:
            on_done()

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        with self._lock:  # once a batch: hundreds of deltas a step at high concurrency
            callbacks = [
                self._callbacks.pop(delta.request_id, None)
                if delta.finished
                else self._callbacks.get(delta.request_id)
                for delta in deltas
            ]
            texts = [
                (self._texts.pop if delta.finished else self._texts.get)(delta.request_id, None)
                for delta in deltas
            ]
        for delta, text in zip(deltas, texts, strict=True):
            if delta.text_pending and text is not None:  # made here, off the engine's step loop
                delta.new_text = text.text_of(delta.new_token_ids, delta.finish_reason)
                delta.text_pending = False
        for delta, callback in zip(deltas, callbacks, strict=True):
            if callback is not None:
                callback(delta)

    def _died(self, cause: BaseException) -> None:
        """The engine stopped: fail what is left, report it once."""
        if self._error is not None:
            return
        logger.error("dspark engine process: %s", cause)
        self._error = cause
        self._fail_all(f"{type(cause).__name__}: {cause}")
        if self._on_death is not None:
            self._on_death(cause)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, {}
            self._texts = {}
            cancels, self._cancels = self._cancels, {}
        for request_id, callback in callbacks.items():
            callback(RequestDelta.failed(request_id, message))
        for _, on_done in cancels.values():  # what they waited on ended with the engine
            on_done()

    def _kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(SHUTDOWN_GRACE_S)


# The engine's side ----------------------------------------------------------------------------


def engine_main(
    config: EngineConfig,
    control: Connection,
    events: Connection,
    engine_factory: EngineFactory | None = None,
    listen: str | None = None,
) -> None:
    """The engine process: build the engine, take in its adapters' commands on the loop's thread, send
    each adapter its delta batches. `listen`: a Unix socket path where more adapters (the backend stubs
    of a model's other instances) attach (`EngineProcess.attach`)."""
    # The engine (and torch) load here only: the adapters' processes (Triton's backend stubs) never
    # import them, which keeps their start and their memory small.
    from dspark.engine.async_engine import AsyncEngine

    intake = _ControlIntake()
    first = _Client(control, events, intake, owner=True)
    try:
        engine = (engine_factory or AsyncEngine)(
            config, on_death=intake.engine_died, after_step=intake.step_ended, intake=intake
        )
    except BaseException:
        events.send(("failed", traceback.format_exc()))
        return
    intake.bind(engine)
    # The loop runs on this (the main) thread, commands are served beside it (AsyncEngine.run says why).
    engine.bind_to_current_thread()
    if isinstance(engine, AsyncEngine):
        # The adapter makes the text of requests without stop strings from their ids (`DeltaText`):
        # detokenizing every request at every step took the step loop's time.
        engine.engine.defer_text = True
    ready = ("ready", (engine.engine.model_config.vocab_size, engine.engine.limits.max_model_len))
    # Listening before the spawning adapter hears "ready": the instances after it find the socket.
    listener = _Listener(listen, intake, ready) if listen is not None else None
    freeze_startup_heap()  # before the first adapter hears "ready": its requests then meet no full pass
    intake.join(first, ready)
    if listener is not None:
        listener.start()
    engine.run()
    # The loop's last deltas (a stop's aborts) go now, not after the shutdown below (which can be slow).
    intake.release()
    # A loop that died leaves the commands served (each submit fails alone) until the spawning adapter
    # leaves or one went away.
    while not intake.closed:
        intake(LOAD_INTERVAL_S)
    if listener is not None:
        listener.close()
    engine.shutdown()
    intake.end_all()
    skip_exit_collection()  # the adapter that spawned this process waits for its exit


class _Outbox:
    """What the engine process sends, in order: deltas, the engine's death, None (the end).

    A step's deltas are put by the step loop (`put`) and sent at the step's end (`wake`, on the loop's
    thread): one message written straight into the events pipe when the adapter has read everything
    before (`_PipeRoom`) and nothing older is waiting for the sender, however few deltas the step has
    (leaving steps of fewer than 16 to the sender cost served throughput at 8 streams on the H200:
    0.49-0.82 of offline against 1.04-1.06 writing every step). While the adapter has not read the last
    message, the loop holds the deltas and tries again at the next step's end, merged with that step's
    (each request's into one): handing them to the sender thread woke it, and it took the GIL from the
    step loop at its next system call (a sender woken at every step's end: the loop's first host copy of
    a step held 18% of its samples on the H200, 4% offline; on this CPU, four adapters at 64 streams,
    waking senders and their GIL made most of the loop's time between steps). What the loop holds when it
    is about to wait idle goes to the sender (`release`), as does what cannot go straight (larger than
    the pipe, no `pipe`) and every event; the sender sends it with each request's deltas merged."""

    def __init__(self, pipe: _PipeRoom | None = None) -> None:
        """pipe: the events pipe's writer, when the loop may write into it itself."""
        self._pipe = pipe
        self._load: Callable[[], EngineLoad] | None = None
        # The loop's thread's own (the lock guards what the sender thread shares: `_waiting`, `_sending`):
        self._step: list[RequestDelta] = []  # the step's deltas, put by the loop
        self._held: list[RequestDelta] = []  # earlier steps' deltas the loop writes itself, in order
        self._waiting: list = []  # for the sender, in order
        self._sending = False  # the sender has items in hand: nothing may overtake them
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.last_load: EngineLoad | None = None  # sent with the latest batch of deltas
        self._load_at = float("-inf")  # when `last_load` was taken for a batch

    def bind_load(self, load: Callable[[], EngineLoad]) -> None:
        """The engine's occupancy snapshot, sent with batches of deltas (`batch`) and, while idle, on
        change."""
        self._load = load

    def occupancy(self) -> EngineLoad | None:
        """The engine's occupancy now (None before `bind_load`)."""
        return self._load() if self._load is not None else None

    def batch(self, deltas: list[RequestDelta]) -> tuple:
        """The message of a batch of deltas: each request's merged into one, packed as columns, with the
        occupancy now (kept as `last_load`) when a request ended in it or LOAD_EVERY_S passed since the
        last (else None): the adapter publishes it every POLL_INTERVAL_S, and made and pickled with
        every step's batch it was most of a one-request step's message (~10 µs of the loop a step)."""
        merged = merge_by_request(deltas)
        load = None
        if self._load is not None:
            now = time.monotonic()
            if now - self._load_at >= LOAD_EVERY_S or any(delta.finished for delta in merged):
                load = self.last_load = self._load()
                self._load_at = now
        return ("deltas", pack_deltas(merged), load)

    def put(self, delta: RequestDelta) -> None:
        """Queue one of the step's deltas (sent at the step's end). The loop's thread only: `_step` and
        `_held` are its own (the sender thread touches `_waiting` and `_sending`, under the lock), so
        this takes no lock (a lock a delta was 55 us of a 256-request step's loop on this CPU)."""
        self._step.append(delta)

    def put_now(self, item: Any) -> None:
        """Queue a delta or an event (the engine's death, None: the end) behind everything queued, for
        the sender, and wake it."""
        with self._lock:
            self._held += self._step
            self._step = []
            self._to_sender()
            self._waiting.append(item)
        self._ready.set()

    def wake(self) -> None:
        """The step's end (the loop's thread): send the step's deltas and those held from earlier steps,
        straight into the pipe once the adapter has read everything before, else hold them."""
        with self._lock:
            self._held += self._step
            self._step = []
            if not self._held:
                return
            if self._pipe is not None and not self._waiting:
                if self._sending or not self._pipe.drained():
                    return  # held for the next step's end (or `release`)
                try:
                    message = _dumps(self.batch(self._held))
                except Exception:  # noqa: BLE001 - the sender fails on it again and ends the process
                    message = None
                if message is not None and self._pipe.write_if_fits(message):
                    self._held = []
                    return
            self._to_sender()
        self._ready.set()

    def release(self) -> None:
        """The loop is about to wait idle: the deltas it holds go to the sender."""
        with self._lock:
            if not self._held:
                return
            self._to_sender()
        self._ready.set()

    def _to_sender(self) -> None:
        """Move the held deltas behind what waits for the sender (the caller holds `_lock`)."""
        self._waiting += self._held
        self._held = []

    def take(self, timeout: float) -> list:
        """Everything waiting, once woken (or after `timeout`: possibly nothing); the caller sends it
        and then calls `sent` (the loop writes nothing straight in between)."""
        self._ready.wait(timeout)
        self._ready.clear()
        with self._lock:
            items, self._waiting = self._waiting, []
            self._sending = True
        return items

    def sent(self) -> None:
        """The items `take` returned are in the pipe."""
        with self._lock:
            self._sending = False


def _dumps(message: tuple) -> bytes:
    """A batch of deltas pickled for the events pipe (`Connection.recv` reads it). Plain pickle: a
    batch holds no object that needs multiprocessing's reducers, and `ForkingPickler.dumps` copies its
    table of them (78 with torch loaded) for every message, ~4 us of the loop a step and adapter."""
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


class _PipeRoom:
    """The events pipe's sending end, written by the step loop only when the adapter has read
    everything before (Linux: FIONREAD, the bytes not yet read) and the message fits the pipe's
    capacity: the loop never blocks on it, and an adapter that falls behind gets what the engine
    commits meanwhile in fewer, fuller batches (held by the loop, `_Outbox`)."""

    def __init__(self, events: Connection) -> None:
        import fcntl
        import termios

        self._events = events
        fd = events.fileno()
        self._ioctl, self._fionread = fcntl.ioctl, termios.FIONREAD
        self._capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        self._unread = array("i", [0])
        self._fd = fd
        self.unread()  # raises OSError where a pipe's unread bytes cannot be asked

    @classmethod
    def of(cls, events: Connection) -> _PipeRoom | None:
        """The writer, or None where the pipe cannot say what is unread (not Linux, not a pipe)."""
        try:
            return cls(events)
        except (ImportError, AttributeError, OSError):
            return None

    def unread(self) -> int:
        """Bytes in the pipe the adapter has not read yet."""
        self._ioctl(self._fd, self._fionread, self._unread, True)
        return self._unread[0]

    def drained(self) -> bool:
        """The adapter has read everything written before."""
        return self.unread() == 0

    def write_if_fits(self, message: bytes | memoryview) -> bool:
        """Send `message` (a pickled object, as `Connection.send` frames it) into the drained pipe if it
        fits the pipe's capacity (the write cannot block); False, nothing written, if not."""
        if len(message) + FRAME_HEADER_BYTES > self._capacity:
            return False
        self._events.send_bytes(message)
        return True


class _Client:
    """One adapter (a backend stub) of the engine process: its control pipe (read by `_ControlIntake`),
    its outbox and sender thread, and its requests in flight (engine id -> the Triton id it gave)."""

    def __init__(
        self, control: Connection, events: Connection, intake: _ControlIntake, owner: bool = False
    ) -> None:
        self.owner = owner  # the adapter that spawned the process: when it leaves, the engine stops
        self.control = control
        self.events = events
        self.outbox = _Outbox(_PipeRoom.of(events))
        self.requests: dict[str, str] = {}
        self.buffer = bytearray()  # read from control, not yet a whole message
        self.leaving = False  # asked to shut down: its events end once its requests have
        self._intake = intake
        self._sender: threading.Thread | None = None

    def start(self, load: Callable[[], EngineLoad]) -> None:
        """Start sending: the occupancy goes with each batch (see `_Outbox.bind_load`) to the spawning
        adapter only, the one that publishes the engine's gauges: to the others it was a snapshot made
        and pickled on the loop's thread every step for nothing."""
        if self.owner:
            self.outbox.bind_load(load)
        self._sender = threading.Thread(target=self._send, name="dspark-events", daemon=True)
        self._sender.start()

    def _send(self) -> None:
        _send_events_or_exit(self.outbox, self.events)
        self.events.close()  # after the end (None): the adapter reads to its end

    def on_delta(self, delta: RequestDelta) -> None:
        """The engine's delta for one of this adapter's requests (the loop's thread)."""
        self.outbox.put(delta)
        if delta.finished:  # after it is queued: the adapter may be let go, or a cancel answered
            self.requests.pop(delta.request_id, None)
            self._intake.request_ended(self, delta.request_id)

    def end(self) -> None:
        """Send what is queued, then close the events pipe (the sender does, without holding up the
        loop)."""
        self.outbox.put_now(None)
        self.control.close()

    def wait_sent(self, timeout: float) -> None:
        """Wait for the sender to have sent everything and closed the events pipe."""
        if self._sender is not None:
            self._sender.join(timeout)


class _ControlIntake:
    """The adapters' commands (submit, abort, cancel, shutdown), read and applied on the engine loop's
    thread (AsyncEngine's `intake`): between steps without waiting, while idle waiting up to the
    timeout. Each read takes everything an adapter has written (one system call, however many
    requests), and no thread of its own asks the step loop for the GIL: a control thread woken for
    every request did, and waited for it too (up to a switch interval per read while the loop computed).

    Adapters: the one that spawned the process, and those that attach later (`_Listener`, `join`). One
    that asks to shut down leaves: its requests are aborted and its events end after their final
    deltas; when the spawning one leaves (the model is being unloaded), the engine stops and every
    adapter's events end. One whose control pipe closes without that went away (its process died): a
    fault, so every other adapter's requests fail with an error (not the abort of a stop) and the engine
    stops too, and so the whole server restarts (`dspark serve`), as it does when the only one dies.
    `closed` once the engine was told to stop."""

    def __init__(self) -> None:
        self._poller = select.poll()
        self._clients: dict[int, _Client] = {}  # by control fd
        self._joining: list[_Client] = []
        self._lock = threading.Lock()  # _joining
        self._wake_read, self._wake_write = os.pipe()  # a joining adapter wakes an idle loop
        os.set_blocking(self._wake_read, False)
        self._poller.register(self._wake_read, select.POLLIN)
        self._engine: AsyncEngine | None = None
        self._cancels: list[_EngineCancel] = []
        self._owner_left = False  # the engine stops because the spawning adapter shut down
        self._ended: list[_Client] = []  # removed adapters (their senders end once all is sent)
        self.closed = False

    def bind(self, engine: AsyncEngine) -> None:
        """The engine the commands go to."""
        self._engine = engine

    def join(self, client: _Client, ready: tuple) -> None:
        """Tell the adapter the engine is ready and take in its commands from the loop's next read on
        (any thread)."""
        client.events.send(ready)
        client.start(self._engine.load)
        with self._lock:
            self._joining.append(client)
        os.write(self._wake_write, b"j")

    def __call__(self, timeout: float) -> None:
        """Apply every command that arrives within `timeout` seconds (0: only those already here)."""
        if self.closed:
            return
        if timeout > 0:  # the loop is about to wait
            self.release()
        for fd, _ in self._poller.poll(int(timeout * 1000)):
            if fd == self._wake_read:
                self._take_joining()
                continue
            client = self._clients.get(fd)
            if client is None:
                continue
            try:
                chunk = os.read(fd, READ_CHUNK_BYTES)
            except OSError:
                chunk = b""
            if not chunk:  # the adapter's process went away
                self._went_away(client)
                return
            client.buffer += chunk
            for message in _messages(client.buffer):
                self._apply(client, message)
                if self.closed:
                    return

    def release(self) -> None:
        """The loop waits or has stopped: what it holds for each adapter goes to that adapter's sender."""
        for client in self._clients.values():
            client.outbox.release()

    def step_ended(self) -> None:
        """The loop's `after_step`: every adapter's share of the step goes out."""
        for client in self._clients.values():
            client.outbox.wake()

    def engine_died(self, cause: BaseException) -> None:
        """The loop's `on_death`: every adapter hears it after its requests' failed deltas."""
        for client in self._all():
            client.outbox.put_now(("dead", f"{type(cause).__name__}: {cause}"))

    def request_ended(self, client: _Client, request_id: str) -> None:
        """A request's final delta (the loop's thread): answer the cancels it was the last one of, and
        let a leaving adapter go once its last request ended."""
        if self._cancels:
            for cancel in [c for c in self._cancels if c.settle(request_id)]:
                cancel.client.outbox.put_now(("cancel_done", cancel.token))
                self._cancels.remove(cancel)
        if client.leaving and not client.requests:
            self._remove(client)

    def end_all(self) -> None:
        """After the loop: end every adapter's events (telling those still attached, when the spawning
        one shut the engine down, that this is no fault), and wait until they are sent."""
        self._take_joining()
        for client in list(self._clients.values()):
            if self._owner_left and not client.leaving:
                client.outbox.put_now(("closing",))
            self._remove(client)
        for client in self._ended:  # an adapter that left earlier may still be sending its last deltas
            client.wait_sent(SHUTDOWN_GRACE_S)

    def _all(self) -> list[_Client]:
        with self._lock:
            return [*self._clients.values(), *self._joining]

    def _take_joining(self) -> None:
        try:
            os.read(self._wake_read, 4096)
        except OSError:
            pass
        with self._lock:
            joining, self._joining = self._joining, []
        for client in joining:
            self._clients[client.control.fileno()] = client
            self._poller.register(client.control.fileno(), select.POLLIN)

    def _apply(self, client: _Client, message: tuple) -> None:
        engine = self._engine
        kind = message[0]
        if kind == "submit":
            _, request_id, params, ids, submitted_at, tag = message
            client.requests[request_id] = tag
            try:
                engine.submit(
                    request_id, params, client.on_delta, prompt_token_ids=ids, submitted_at=submitted_at
                )
            except Exception as exc:  # checked in the adapter's process already; fails this one alone
                client.requests.pop(request_id, None)
                client.outbox.put_now(RequestDelta.failed(request_id, f"{type(exc).__name__}: {exc}"))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "cancel":
            self._cancel(client, message[1], message[2])
        elif kind == "shutdown":
            self._leave(client)

    def _cancel(self, client: _Client, target: str, token: int) -> None:
        """Abort every adapter's requests with this Triton id (CANCEL_ALL: all); the asking adapter hears
        how many matched now, and `cancel_done` once the last of them ended."""
        matched = {
            request_id
            for other in self._clients.values()
            for request_id, tag in other.requests.items()
            if target in (CANCEL_ALL, tag)
        }
        client.outbox.put_now(("cancel_matched", token, len(matched)))
        if matched:
            self._cancels.append(_EngineCancel(client, token, matched))
            for request_id in matched:
                self._engine.abort(request_id)

    def _leave(self, client: _Client) -> None:
        """The adapter asked to shut down: abort its requests; its events end after their finals."""
        self._poller.unregister(client.control.fileno())
        client.leaving = True
        if client.owner or len(self._clients) == 1:  # the engine stops (aborting what is in flight)
            self._owner_left = True
            self._close()
            return
        for request_id in list(client.requests):
            self._engine.abort(request_id)
        if not client.requests or not self._engine.healthy:  # a dead loop ends nothing more
            self._remove(client)

    def _remove(self, client: _Client) -> None:
        fd = client.control.fileno()
        if self._clients.pop(fd, None) is None:
            return
        if not client.leaving:
            self._poller.unregister(fd)
        client.end()
        self._ended.append(client)

    def _went_away(self, gone: _Client) -> None:
        """An adapter's process died (its control pipe closed without a shutdown): a fault, so the
        others' requests fail with an error before the engine stops (its aborts would read as a normal
        end), and the server restarts."""
        who = "the spawning instance" if gone.owner else "another instance"
        cause = f"InstanceGone: the backend process of {who} of this model died; the engine stops"
        for client in self._all():
            if client is not gone:
                client.outbox.put_now(("dead", cause))
        self._close()

    def _close(self) -> None:
        self.closed = True
        self._engine.stop()


@dataclass
class _EngineCancel:
    """A cancel an adapter asked for: the requests (of any adapter) it waits on."""

    client: _Client
    token: int
    waiting_on: set[str]

    def settle(self, request_id: str) -> bool:
        """Note that request_id ended; True when that was the last one waited on."""
        self.waiting_on.discard(request_id)
        return not self.waiting_on


class _Listener(threading.Thread):
    """Accepts the adapters that attach (`EngineProcess.attach`): each passes the ends of its two pipes
    over the Unix socket, and joins once told the engine is ready."""

    def __init__(self, address: str, intake: _ControlIntake, ready: tuple) -> None:
        super().__init__(name="dspark-listener", daemon=True)
        self._listener = Listener(address, family="AF_UNIX")
        self._intake = intake
        self._ready = ready

    def close(self) -> None:
        """Stop accepting (the socket file goes)."""
        try:
            self._listener.close()
        except OSError:
            pass

    def run(self) -> None:
        while not self._intake.closed:
            try:
                with self._listener.accept() as conn:
                    control_fd, events_fd = recv_handle(conn), recv_handle(conn)
            except (OSError, EOFError):
                if self._intake.closed:
                    return
                continue
            client = _Client(
                Connection(control_fd, writable=False), Connection(events_fd, readable=False), self._intake
            )
            try:
                self._intake.join(client, self._ready)
            except OSError:
                client.end()


def _messages(buffer: bytearray) -> list:
    """The whole messages in `buffer`, as `Connection.send` framed them (a 4-byte length, or -1 and an
    8-byte one), unpickled and removed from it; a partial one stays for the next read."""
    messages, at = [], 0
    while len(buffer) - at >= 4:
        (size,) = struct.unpack_from("!i", buffer, at)
        header = 4
        if size == -1:
            if len(buffer) - at < 12:
                break
            (size,) = struct.unpack_from("!Q", buffer, at + 4)
            header = 12
        if len(buffer) - at - header < size:
            break
        messages.append(pickle.loads(buffer[at + header : at + header + size]))
        at += header + size
    del buffer[:at]
    return messages


def _send_events_or_exit(
    outbox: _Outbox, events: Connection, exit_process: Callable[[int], None] = os._exit
) -> None:
    """`_send_events`, ending this process if it raises: an engine whose deltas can no longer reach the
    adapter must not live on (its requests would never end); the adapter sees the events pipe close and
    fails every request it was waiting on."""
    try:
        _send_events(outbox, events)
    except BaseException:
        logger.error("dspark engine process: sending events failed; exiting\n%s", traceback.format_exc())
        exit_process(SENDER_FAILED_STATUS)


def _send_events(outbox: _Outbox, events: Connection) -> None:
    """Send what the step loop could not (`_Outbox`): each run of waiting deltas as one batch, each
    request's merged into one (when the adapter reads slower than the engine steps, a batch spans
    steps: fewer, fuller deltas), and the engine's death, in order; while nothing waits, the occupancy
    whenever it changes."""
    while True:
        items = outbox.take(LOAD_INTERVAL_S)
        try:
            if not items:
                now = outbox.occupancy()
                if now is not None and now != outbox.last_load:
                    events.send(("load", now))
                    outbox.last_load = now
                continue
            deltas = []
            for item in items:
                if isinstance(item, RequestDelta):
                    deltas.append(item)
                    continue
                if deltas:
                    events.send_bytes(_dumps(outbox.batch(deltas)))
                    deltas = []
                if item is None:
                    return
                events.send(item)
            if deltas:
                events.send_bytes(_dumps(outbox.batch(deltas)))
        finally:
            outbox.sent()
