"""AsyncEngine: the engine's step loop in its own thread, fed from any thread (the Triton adapter's API)."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dspark.config import EngineConfig
from dspark.engine.api import DeathCallback, DeltaCallback, EngineDeadError
from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import EngineLoad, RequestDelta, SpecStats
from dspark.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called by the loop with a timeout (0 between steps): waits that long at most for commands from
# elsewhere and applies them with `submit`/`abort`/`stop`, on the loop's own thread.
Intake = Callable[[float], None]
IDLE_WAIT_S = 0.5  # the longest wait of an idle loop before it looks at its inbox again
STOP_STEPS = 4  # at most this many steps end the requests in flight once the loop is asked to stop


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    on_delta: DeltaCallback
    # time.monotonic() of the hand-over (in the adapter's process, when that is another one)
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    request_id: str


class InjectedFault(RuntimeError):
    """The fault `EngineConfig.fault_injection_file` asks for (testing only)."""


class AsyncEngine:
    """Owns an LLMEngine and runs its loop in a daemon thread.

    `submit` validates and tokenizes in the caller's thread (so a bad request fails at once,
    alone), then hands the request to the loop. Deltas reach `on_delta` from the loop thread:
    the callback must not block (the Triton adapter queues them for its response thread).

    Faults: an error that belongs to one request (its admission raised) fails that request alone.
    An error that breaks the loop ends every request in flight or queued with a failed delta, then
    calls `on_death` once with the cause; from then on `healthy` is False and `submit` raises
    EngineDeadError.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine: LLMEngine | None = None,
        on_death: DeathCallback | None = None,
        after_step: Callable[[], None] | None = None,
        intake: Intake | None = None,
    ) -> None:
        """after_step: called from the loop thread once a step's deltas are all delivered (the engine
        process sends a step's deltas together then, rather than waking its sender for each one).
        intake: called from the loop thread before each step and while idle (`Intake`): the engine
        process reads its adapter's commands there, as a thread of its own reading them took the GIL
        from the step loop at every request (and waited for it: a hand-over per switch interval)."""
        self.config = config
        self.engine = engine if engine is not None else LLMEngine(config)
        self._on_death = on_death
        self._after_step = after_step
        self._intake = intake
        self._first_token_due: dict[str, float] = {}  # admitted, no token yet: their hand-over time
        self._inbox: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._callbacks: dict[str, DeltaCallback] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    @property
    def tokenizer(self):  # noqa: ANN201 - dspark.tokenizer.Tokenizer
        """The target's tokenizer."""
        return self.engine.tokenizer

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
            self._thread.start()

    def bind_to_current_thread(self) -> None:
        """Make the calling thread the loop's, for `run` (instead of `start`): requests are accepted
        from now on and wait in the inbox until `run` begins. The engine process runs its loop on its
        main thread: the CPU's BLAS (MKL through OpenMP) ran a one-row decode step's GEMMs on one core
        when called from any other thread, and a CPU decode step took 1.7x as long."""
        if self._thread is None:
            self._thread = threading.current_thread()

    def run(self) -> None:
        """Run the loop in the thread bound by `bind_to_current_thread` until `stop` (or its death)."""
        if self._thread is not threading.current_thread():
            raise RuntimeError("AsyncEngine.run: call bind_to_current_thread from this thread first")
        self._loop()

    def stop(self) -> None:
        """Ask the loop to stop: it aborts what is in flight and returns (any thread may ask)."""
        self._stopping.set()
        self._inbox.put(None)

    @property
    def healthy(self) -> bool:
        """False once the loop died or was shut down."""
        return (
            self._error is None
            and not self._stopping.is_set()
            and self._thread is not None
            and self._thread.is_alive()
        )

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the loop, if any."""
        return self._error

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        on_delta: DeltaCallback,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        submitted_at: float | None = None,
    ) -> list[int]:
        """Validate and queue one request; returns its prompt token ids.

        submitted_at: the time.monotonic() of its hand-over when that was before this call (in another
        process), for the loop's intake counters. Raises InvalidParameterError (naming the field) for a
        bad prompt, and EngineDeadError when the loop is not running.
        """
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self._error!r}")
        token_ids = self.engine.prepare_prompt(prompt, prompt_token_ids, params)
        with self._lock:  # the loop's death drains the inbox under this lock: nothing is left behind
            if not self.healthy:
                raise EngineDeadError(f"engine is not running: {self._error!r}")
            handed_at = time.monotonic() if submitted_at is None else submitted_at
            self._inbox.put(_Submit(request_id, token_ids, params, on_delta, handed_at))
        return token_ids

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages are freed at the next step and it ends with reason 'abort'."""
        self._inbox.put(_Abort(request_id))

    def stream(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> Iterator[RequestDelta]:
        """Submit and yield this request's deltas until the last one."""
        deltas: queue.Queue[RequestDelta] = queue.Queue()
        self.submit(request_id, params, deltas.put, prompt=prompt, prompt_token_ids=prompt_token_ids)
        while True:
            delta = deltas.get()
            yield delta
            if delta.finished:
                return

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight, stop the loop and join it (unless it is this thread's), then
        close the engine."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.engine.close()

    def load(self) -> EngineLoad:
        """Running and waiting requests and KV pages in use (read without locking; a snapshot)."""
        return self.engine.load()

    def totals(self) -> SpecStats:
        """Speculation counters summed over every finished request."""
        return self.engine.total_spec_stats

    # The loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                block = not self.engine.has_unfinished_requests()
                if not self._drain_inbox(block=block):
                    break
                if self.engine.has_unfinished_requests():
                    self._dispatch(self._step())
            for request_id in list(self._callbacks):
                self.engine.abort_request(request_id)
            # A step launched ahead is completed first; the aborts' final deltas may need the next.
            for _ in range(STOP_STEPS):
                if not self.engine.has_unfinished_requests():
                    break
                self._dispatch(self._step())
        except BaseException as exc:  # the loop must report, never vanish silently
            logger.exception("dspark engine loop died")
            with self._lock:
                self._error = exc
            self._fail_all(f"{type(exc).__name__}: {exc}")
            if self._on_death is not None:
                self._on_death(exc)

    def _step(self) -> list[RequestDelta]:
        """One engine step (raising the injected fault first, when the test hook asks for it)."""
        trigger = self.config.fault_injection_file
        if trigger and os.path.exists(trigger):
            os.remove(trigger)  # fires once: a restarted engine must not fault again
            raise InjectedFault(f"fault injected through {trigger}")
        return self.engine.step()

    def _drain_inbox(self, block: bool) -> bool:
        """Take in commands (`intake`, waiting while idle), then move queued submissions and aborts
        into the engine; False when asked to stop."""
        if self._intake is not None:
            waiting = time.perf_counter()
            self._intake(IDLE_WAIT_S if block else 0.0)
            counters = self.engine.loop_counters
            if block:
                counters.idle_seconds += time.perf_counter() - waiting
            else:
                counters.intake_seconds += time.perf_counter() - waiting
            block = False
        try:
            if block:
                waiting = time.perf_counter()
                try:
                    item = self._inbox.get(timeout=IDLE_WAIT_S)
                finally:
                    self.engine.loop_counters.idle_seconds += time.perf_counter() - waiting
            else:
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, _Submit):
                self._admit(item)
            else:
                self.engine.abort_request(item.request_id)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, item: _Submit) -> None:
        """Hand one request to the engine; if that raises, the request fails alone."""
        try:
            self.engine.add_request(item.request_id, item.prompt_token_ids, item.params)
        except Exception as exc:
            logger.exception("dspark: request %s could not be admitted", item.request_id)
            item.on_delta(RequestDelta.failed(item.request_id, f"{type(exc).__name__}: {exc}"))
            if self._after_step is not None:
                self._after_step()
            return
        self._callbacks[item.request_id] = item.on_delta
        counters = self.engine.loop_counters
        counters.admitted_requests += 1
        counters.intake_wait_seconds += time.monotonic() - item.submitted_at
        self._first_token_due[item.request_id] = item.submitted_at

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        """Hand a step's deltas to their requests' callbacks, then `after_step` (timed: the loop's
        `handover_seconds`)."""
        started = time.perf_counter()
        self._hand_over(deltas)
        self.engine.loop_counters.handover_seconds += time.perf_counter() - started

    def _hand_over(self, deltas: list[RequestDelta]) -> None:
        if self._first_token_due:
            now = time.monotonic()
            for delta in deltas:
                if delta.new_token_ids or delta.finished:
                    handed_at = self._first_token_due.pop(delta.request_id, None)
                    if handed_at is not None and delta.new_token_ids:
                        self.engine.loop_counters.first_token_seconds += now - handed_at
        for delta in deltas:
            callback = self._callbacks.get(delta.request_id)
            if delta.finished:
                self._callbacks.pop(delta.request_id, None)
            if callback is not None:
                callback(delta)
        if self._after_step is not None:
            self._after_step()

    def _fail_all(self, message: str) -> None:
        """End every request the loop holds or has queued with a failed delta."""
        for request_id, callback in list(self._callbacks.items()):
            callback(RequestDelta.failed(request_id, message))
        self._callbacks.clear()
        self._first_token_due.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Submit):
                item.on_delta(RequestDelta.failed(item.request_id, message))
