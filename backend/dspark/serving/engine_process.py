"""EngineProcess: AsyncEngine's interface with the engine in a child process of its own.

Inside Triton's Python backend, the adapter's response thread (building tensors, sending responses,
publishing metrics) and the engine's step loop would share one interpreter and its GIL: every
response the server sends then takes time from the next engine step. Here the engine core runs in a
spawned process (its own GIL, its own CUDA context); the adapter's process keeps only request and
response I/O. Two pipes connect them:

- control (duplex): the adapter's `submit` (answered with the prompt's token ids, or the error that
  names the bad field, so a bad request still fails at once and alone), `abort`, `shutdown`;
- events (engine -> adapter): batches of deltas (a step's, as columns: `dspark.outputs.pack_deltas`,
  written by the step loop itself while the adapter keeps up; when the adapter reads slower than the
  engine steps, everything committed meanwhile in one batch: `_Outbox`) with an occupancy snapshot,
  and the engine's death. The engine leaves the text of requests without stop strings to this side,
  which makes it from their token ids (`DeltaText`) as the engine would: detokenizing every request
  at every step took the step loop's time, and here it is done once per batch of a request's tokens.

Faults: if the engine loop dies, its requests' failed deltas arrive first, then the death; if the
engine process itself dies (killed, out of memory), the adapter sees its events pipe close and fails
every request it was waiting on. Either way `on_death` is called once and `healthy` turns False. The
engine process exits when the adapter's control pipe closes, so it never outlives its adapter.
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
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from dspark.config import EngineConfig
from dspark.engine.async_engine import AsyncEngine, DeathCallback, DeltaCallback, EngineDeadError
from dspark.outputs import EngineLoad, RequestDelta, merge_by_request, pack_deltas, unpack_deltas
from dspark.parallel.tp_worker import python_executable, spawning_with
from dspark.prompts import check_prompt
from dspark.sampling_params import SamplingParams
from dspark.tokenizer import DeltaText, IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # past the engine's own shutdown, before its process is killed
LOAD_INTERVAL_S = 0.1  # how often an idle engine process reports a changed occupancy
SENDER_FAILED_STATUS = 70  # the engine process's exit status when its events could not be sent
# A step with fewer deltas leaves them to the sender thread: its little work then fits in the loop's
# waits for the device (at 1 stream on the H200 the loop's own writes cost 6% of tokens/s), while at
# 64 streams a sender woken every step cost the loop 17% (`_Outbox`).
DIRECT_MIN_DELTAS = 16
FRAME_HEADER_BYTES = 12  # the most `Connection.send_bytes` writes before a message (its length)
READ_CHUNK_BYTES = 1 << 20  # the most the engine loop reads of its commands at once
EngineFactory = Callable[..., AsyncEngine]  # (config, on_death=, after_step=, intake=) -> the engine


class EngineProcess:
    """Runs an AsyncEngine in a spawned process and relays requests and deltas (see the module)."""

    def __init__(
        self,
        config: EngineConfig,
        on_death: DeathCallback | None = None,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        """Spawn the engine process and wait until its engine is built (model load, CUDA graphs).

        engine_factory (picklable; default AsyncEngine): builds the engine in the engine process from
        (config, on_death, after_step); benchmarks/serving_ceiling.py puts a synthetic one here."""
        self.config = config
        self._on_death = on_death
        self._callbacks: dict[str, DeltaCallback] = {}
        # Requests whose text this process makes from their token ids (the engine leaves it here).
        self._texts: dict[str, DeltaText] = {}
        self._lock = threading.Lock()  # the callbacks
        self._control_lock = threading.Lock()  # one command at a time on the control pipe
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._load = EngineLoad(0, 0, 0, 0)
        context = mp.get_context("spawn")
        self._control, control_theirs = context.Pipe(duplex=True)
        self._events, events_theirs = context.Pipe(duplex=False)
        with spawning_with(context, python_executable()):
            # Not a daemon: a tensor-parallel engine spawns rank processes of its own.
            self._process = context.Process(
                target=engine_main,
                args=(config, control_theirs, events_theirs, engine_factory),
                name="dspark-engine",
            )
            self._process.start()
        control_theirs.close()
        events_theirs.close()
        try:
            kind, detail = self._events.recv()
        except EOFError:
            kind, detail = "failed", f"the engine process exited with status {self._process.join(5) or ''}"
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"the engine process failed to start:\n{detail}")
        self._vocab_size, self._max_model_len = detail
        # The adapter's own: it tokenizes and checks prompts here (see `submit`) and decodes them.
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self._reader = threading.Thread(target=self._read_events, name="dspark-engine-events", daemon=True)

    def start(self) -> None:
        """Start relaying the engine's deltas (idempotent)."""
        if not self._reader.is_alive() and not self._stopping.is_set():
            self._reader.start()

    @property
    def healthy(self) -> bool:
        """False once the engine died, its process exited, or shutdown began."""
        return self._error is None and not self._stopping.is_set() and self._process.is_alive()

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
    ) -> list[int]:
        """Validate and tokenize one request here, queue it in the engine process; its prompt token ids.

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
            None
            if params.stop
            else DeltaText(IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens))
        )
        with self._lock:  # before the engine can answer: its first delta may come at once
            self._callbacks[request_id] = on_delta
            if text is not None:
                self._texts[request_id] = text
        try:
            with self._control_lock:
                self._control.send(("submit", request_id, params, ids, time.monotonic()))
        except (OSError, EOFError):
            with self._lock:
                self._callbacks.pop(request_id, None)
                self._texts.pop(request_id, None)
            raise EngineDeadError("engine is not running: the engine process is gone") from None
        return ids

    def abort(self, request_id: str) -> None:
        """Cancel a request; it ends with reason 'abort' at the engine's next step."""
        self._command(("abort", request_id))

    def load(self) -> EngineLoad:
        """The occupancy the engine reported with its last batch of deltas."""
        return self._load

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (their last deltas are relayed), stop the engine and its process."""
        self._stopping.set()
        self._command(("shutdown",))
        self._process.join(timeout + SHUTDOWN_GRACE_S)
        self._kill()
        if self._reader.is_alive():
            self._reader.join(SHUTDOWN_GRACE_S)

    # The adapter's side -----------------------------------------------------------------------

    def _command(self, message: tuple) -> None:
        try:
            with self._control_lock:
                self._control.send(message)
        except (OSError, EOFError):
            pass  # the engine process is gone; the events reader reports it

    def _read_events(self) -> None:
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            if message[0] == "deltas":
                self._load = message[2]
                self._dispatch(unpack_deltas(message[1]))
            elif message[0] == "load":
                self._load = message[1]
            elif message[0] == "dead":
                self._died(RuntimeError(message[1]))
        if not self._stopping.is_set():
            self._process.join(1)
            self._died(RuntimeError(f"the engine process exited (status {self._process.exitcode})"))
        self._fail_all("the engine process stopped")

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
        for request_id, callback in callbacks.items():
            callback(RequestDelta.failed(request_id, message))

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(SHUTDOWN_GRACE_S)


# The engine's side ----------------------------------------------------------------------------


def engine_main(
    config: EngineConfig, control: Connection, events: Connection, engine_factory: EngineFactory | None = None
) -> None:
    """The engine process: build the engine, take in control commands on its loop's thread, send delta
    batches."""
    outbox = _Outbox(_PipeRoom.of(events))
    intake = _ControlIntake(control, outbox.put, outbox.put_now)
    try:
        engine = (engine_factory or AsyncEngine)(
            config,
            on_death=lambda cause: outbox.put_now(("dead", f"{type(cause).__name__}: {cause}")),
            after_step=outbox.wake,
            intake=intake,
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
    events.send(("ready", (engine.engine.model_config.vocab_size, engine.engine.limits.max_model_len)))
    outbox.bind_load(engine.load)
    sender = threading.Thread(target=_send_events_or_exit, args=(outbox, events), daemon=True)
    sender.start()
    engine.run()
    # A loop that died leaves the commands served (each submit fails alone) until the adapter shuts
    # this process down.
    while not intake.closed:
        intake(LOAD_INTERVAL_S)
    engine.shutdown()
    outbox.put_now(None)
    sender.join()


class _Outbox:
    """What the engine process sends, in order: deltas, the engine's death, None (the end).

    A step's deltas are put by the step loop (`put`) and sent at the step's end (`wake`, on the loop's
    thread): when there are DIRECT_MIN_DELTAS or more, one message written straight into the events
    pipe when the adapter has read everything before (`_PipeRoom`) and nothing older is waiting. A
    sender thread woken at every step's end took the GIL from the step loop in the middle of the next
    step, at every handoff (py-spy, H200, 64 streams: the loop's first host copy of a step held 18% of
    its samples, 4% offline; steps 2.49 ms against 2.10 ms for the same closed loop in one process).
    What does not go straight (few deltas; the adapter reads slower than the engine steps; no `pipe`;
    events) waits for the sender thread (`take`), which sends it with each request's waiting deltas
    merged into one."""

    def __init__(self, pipe: _PipeRoom | None = None) -> None:
        """pipe: the events pipe's writer, when the loop may write into it itself."""
        self._pipe = pipe
        self._load: Callable[[], EngineLoad] | None = None
        self._step: list[RequestDelta] = []  # the step's deltas, put by the loop
        self._waiting: list = []  # for the sender, in order
        self._sending = False  # the sender has items in hand: nothing may overtake them
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.last_load: EngineLoad | None = None  # sent with the latest batch of deltas

    def bind_load(self, load: Callable[[], EngineLoad]) -> None:
        """The engine's occupancy snapshot, sent with each batch of deltas and, while idle, on change."""
        self._load = load

    def occupancy(self) -> EngineLoad | None:
        """The engine's occupancy now (None before `bind_load`)."""
        return self._load() if self._load is not None else None

    def batch(self, deltas: list[RequestDelta]) -> tuple:
        """The message of a batch of deltas: each request's merged into one, packed as columns, with the
        occupancy now (kept as `last_load`)."""
        self.last_load = self.occupancy()
        return ("deltas", pack_deltas(merge_by_request(deltas)), self.last_load)

    def put(self, delta: RequestDelta) -> None:
        """Queue one of the step's deltas (sent at the step's end)."""
        with self._lock:
            self._step.append(delta)

    def put_now(self, item: Any) -> None:
        """Queue a delta or an event (the engine's death, None: the end) behind everything queued, for
        the sender, and wake it."""
        with self._lock:
            self._waiting += self._step
            self._step = []
            self._waiting.append(item)
        self._ready.set()

    def wake(self) -> None:
        """The step's end (the loop's thread): send its deltas, straight into the pipe when they can go."""
        with self._lock:
            if not self._step:
                return
            deltas, self._step = self._step, []
            direct = len(deltas) >= DIRECT_MIN_DELTAS and self._pipe is not None
            if direct and not self._waiting and not self._sending:
                try:
                    message = ForkingPickler.dumps(self.batch(deltas))
                except Exception:  # noqa: BLE001 - the sender fails on it again and ends the process
                    message = None
                if message is not None and self._pipe.write_if_drained(message):
                    return
            self._waiting += deltas
        self._ready.set()

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


class _PipeRoom:
    """The events pipe's sending end, written by the step loop only when the adapter has read
    everything before (Linux: FIONREAD, the bytes not yet read) and the message fits the pipe's
    capacity: the loop never blocks on it, and an adapter that falls behind gets what the engine
    commits meanwhile from the sender thread, merged into fewer, fuller batches (its pipe then fills
    at the default capacity and the sender waits, merging, as before)."""

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

    def write_if_drained(self, message: bytes | memoryview) -> bool:
        """Send `message` (a pickled object, as `Connection.send` frames it) if the adapter has read
        everything before and it fits the empty pipe; False, nothing written, if not."""
        if len(message) + FRAME_HEADER_BYTES > self._capacity or self.unread():
            return False
        self._events.send_bytes(message)
        return True


class _ControlIntake:
    """The adapter's commands (submit, abort, shutdown), read and applied on the engine loop's thread
    (AsyncEngine's `intake`): between steps without waiting, while idle waiting up to the timeout. Each
    read takes everything the adapter has written (one system call, however many requests), and no
    thread of its own asks the step loop for the GIL: a control thread woken for every request did,
    and waited for it too (up to a switch interval per read while the loop computed).

    `closed` once the adapter asked to shut down or went away; the engine is then told to stop."""

    def __init__(
        self, control: Connection, on_delta: Callable[[Any], None], on_failed: Callable[[Any], None]
    ) -> None:
        self._control = control
        self._fd = control.fileno()
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._on_delta = on_delta
        self._on_failed = on_failed
        self._buffer = bytearray()  # read, not yet a whole message
        self._engine: AsyncEngine | None = None
        self.closed = False

    def bind(self, engine: AsyncEngine) -> None:
        """The engine the commands go to."""
        self._engine = engine

    def __call__(self, timeout: float) -> None:
        """Apply every command that arrives within `timeout` seconds (0: only those already here)."""
        if self.closed or not self._poller.poll(int(timeout * 1000)):
            return
        try:
            chunk = os.read(self._fd, READ_CHUNK_BYTES)
        except OSError:
            chunk = b""
        if not chunk:  # the adapter went away
            self._close()
            return
        self._buffer += chunk
        for message in self._messages():
            self._apply(message)
            if self.closed:
                return

    def _messages(self) -> list:
        """The whole messages in the buffer, as `Connection.send` framed them (a 4-byte length, or -1
        and an 8-byte one), unpickled; a partial one stays for the next read."""
        messages, at, data = [], 0, self._buffer
        while len(data) - at >= 4:
            (size,) = struct.unpack_from("!i", data, at)
            header = 4
            if size == -1:
                if len(data) - at < 12:
                    break
                (size,) = struct.unpack_from("!Q", data, at + 4)
                header = 12
            if len(data) - at - header < size:
                break
            messages.append(pickle.loads(data[at + header : at + header + size]))
            at += header + size
        del data[:at]
        return messages

    def _apply(self, message: tuple) -> None:
        engine = self._engine
        kind = message[0]
        if kind == "submit":
            _, request_id, params, ids, submitted_at = message
            try:
                engine.submit(
                    request_id, params, self._on_delta, prompt_token_ids=ids, submitted_at=submitted_at
                )
            except Exception as exc:  # checked in the adapter's process already; fails this one alone
                self._on_failed(RequestDelta.failed(request_id, f"{type(exc).__name__}: {exc}"))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "shutdown":
            self._close()

    def _close(self) -> None:
        self.closed = True
        self._engine.stop()


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
                    events.send(outbox.batch(deltas))
                    deltas = []
                if item is None:
                    return
                events.send(item)
            if deltas:
                events.send(outbox.batch(deltas))
        finally:
            outbox.sent()
