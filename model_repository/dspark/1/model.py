"""Triton Python backend adapter for the DSpark engine: it translates, and nothing more.

`execute()` turns each request into an `AsyncEngine.submit` and returns at once. The engine calls
back with `RequestDelta`s, which are appended to the request's pending deltas (a list append under a
lock: the engine's side never waits on a response). Send threads (each request always on the same
one) merge a request's pending deltas into one response and `send()` it: while a send waits on its
round trip to the server process, the engine's next tokens merge into the following one, so a stream
gets fewer, fuller responses under load instead of falling behind, and one request's responses stay
in order. A request's first response goes ahead of the rest (time to first token), and so does its
final one (a closed-loop client sends its next request when it arrives). Each response costs
the same (a round trip to the server, the server's gRPC write, the client's read) whatever it carries,
so under load the responses are paced: a request's next response waits until `this instance's live
requests / max_responses_per_s` seconds after its previous one (the config parameter; at its default,
2000, with the default 4 instances: about 1 ms at 8 streams, 8 ms at 64 and 32 ms at 256), merging what
the engine commits meanwhile; its first and its final response never wait. A poll thread asks
senders whether their client went away (aborting cancelled requests so their KV pages free at the
next step) and publishes the load gauges and counters.

Each instance of the model (`instance_group` count, a backend stub each) runs this adapter; all of them
share one engine process (dspark.serving.shared_engine: the first spawns it, the others attach), so
more instances take in and send out more, over one batch and one KV cache.

If the engine loop dies, every request in flight ends with an INTERNAL error (FINAL), new ones get
UNAVAILABLE, and after a short grace this backend process exits: a model whose engine is gone must not
look ready, and `dspark serve` restarts the server when a backend process dies (see its module).

The interface is Triton's vLLM backend's (text_input, stream, sampling_parameters,
exclude_input_in_output, return_* flags; text_output, finish_reason, num_*_tokens) plus input_ids,
output_ids, return_spec_stats/spec_stats and cancel_request_id; see dspark.serving.triton_config
(the tensors) and dspark.serving.request_inputs (how a request's inputs become engine values).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark import EngineConfig, InvalidParameterError
from dspark.engine.api import EngineDeadError
from dspark.outputs import RequestDelta, logprobs_json, merge_deltas
from dspark.process_heap import freeze_startup_heap, skip_exit_collection
from dspark.serving.engine_process import EngineClosedError, EngineProcess
from dspark.serving.metrics import Metrics, TritonMetrics, vllm_max_model_len
from dspark.serving.request_inputs import CANCEL_ALL, describe, generate_inputs, message, string_input
from dspark.serving.send_queue import SendQueue
from dspark.serving.shared_engine import forget, instance_count, open_engine, rendezvous
from dspark.serving.triton_config import INPUTS, OUTPUTS, add_missing_io, parameters_from_model_config
from dspark.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from dspark.engine.async_engine import AsyncEngine

POLL_INTERVAL_S = 0.1  # cancellation checks and metric publishing
SEND_THREADS = 4  # threads sending responses (a request's always on the same one)
CANCEL_POLL_BUDGET = 32  # senders asked about cancellation per poll
DEATH_GRACE_S = 1.0  # after the engine died: time for the error responses to go out before exiting
# After the instance that spawned the shared engine shut it down (the model is being unloaded): the time
# this instance's own unload has to come before it exits as after a fault (so that an instance left
# without an engine, if Triton ever removed the spawning one alone, gets the server restarted).
CLOSED_GRACE_S = 20.0


@dataclass
class _Live:
    """One request in flight: where its responses go, what it asked for, and what is left to send."""

    engine_id: str
    triton_id: str
    sender: Any
    stream: bool
    returns: frozenset[str]
    prefix: str  # prompt text put before a non-streamed completion ("" when excluded)
    arrived: float
    text: list[str] = field(default_factory=list)  # non-streamed: everything so far
    token_ids: list[int] = field(default_factory=list)
    last_token_at: float | None = None  # when the tokens of the last response sent arrived
    sent_at: float = 0.0  # when its last response was taken to be sent (pacing)
    spec_seen: dict | None = None
    cancelled: bool = False  # the client went away; the engine was told to abort
    # Guarded by the model's lock: the engine's deltas not yet sent (merged into one at send time);
    # when the first and the last of their tokens arrived; whether a send thread holds it in its
    # queue (`ahead`: ahead of the rest, `deferred`: paced, due later); and whether its final
    # response is decided (nothing may be sent for it after that; it is set with the request's removal
    # from the model's live requests, so those are never closed).
    pending: list[RequestDelta] = field(default_factory=list)
    first_pending_at: float | None = None
    last_pending_at: float | None = None
    scheduled: bool = False
    ahead: bool = False
    deferred: bool = False
    closed: bool = False
    # Held while its final response is sent and while its sender is asked whether the client went
    # away: once the final response is out, Triton frees the request's response factory, and asking
    # `is_cancelled()` then crashed tritonserver (a use after free in ResponseFactoryIsCancelled).
    final_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    final_sent: bool = False


@dataclass
class _Reply:
    """A single final response (an error, or the answer to a cancel request)."""

    sender: Any
    response: Any
    outcome: str | None  # counted as a finished request with this reason, when set


@dataclass
class _PendingCancel:
    """A cancel request, answered once every request it cancelled has sent its final response."""

    sender: Any
    waiting_on: set[str]

    def settle(self, engine_id: str) -> bool:
        """Note that engine_id ended; True when that was the last one waited on."""
        if engine_id not in self.waiting_on:
            return False
        self.waiting_on.discard(engine_id)
        return not self.waiting_on


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        add_missing_io(auto_complete_model_config, INPUTS, OUTPUTS)
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("dspark needs model_transaction_policy { decoupled: true }")
        config = EngineConfig.from_parameters(parameters_from_model_config(model_config))
        self._logger = pb_utils.Logger
        # Several instances (backend stubs) share one engine process (dspark.serving.shared_engine).
        self._instances = instance_count(model_config)
        self._shared = self._instances > 1
        # Where the instances meet (the tritonserver process is this stub's parent).
        self._rendezvous = (
            rendezvous(args["model_name"], args["model_version"], os.getppid()) if self._shared else None
        )
        self._id_prefix = f"{args['model_instance_name']}/" if self._shared else ""
        self._metrics = self._make_metrics(config, args)
        self._live: dict[str, _Live] = {}
        self._responses_per_s = config.max_responses_per_s  # the pacing budget (see the module)
        self._lock = threading.Lock()  # _live, _cancels and each _Live's pending fields
        self._next_id = itertools.count()
        self._cancels: list[_PendingCancel] = []
        self._cancel_poll_at = 0  # where the next cancellation poll starts in the live requests
        self._engine_death: BaseException | None = None
        self._stopping = threading.Event()
        self._send_queues = [SendQueue() for _ in range(SEND_THREADS)]
        self._send_threads = [
            threading.Thread(target=self._send_loop, args=(sends,), name=f"dspark-send-{i}", daemon=True)
            for i, sends in enumerate(self._send_queues)
        ]
        self._engine = self._make_engine(config, self._on_engine_death)
        # The engine's own gauges and counters (occupancy, KV pages, loop totals) come from one instance:
        # the one that spawned the engine. Request metrics come from every instance (Triton adds them up).
        self._publishes_engine = getattr(self._engine, "owner", True)
        freeze_startup_heap()  # this stub's (and an in-process engine's) heap, built for its life
        self._engine.start()
        for thread in self._send_threads:
            thread.start()
        self._poller = threading.Thread(target=self._poll_loop, name="dspark-poll", daemon=True)
        self._poller.start()
        shared = ""
        if self._shared:
            how = "spawned" if self._publishes_engine else "attached to"
            shared = f"; {args['model_instance_name']} {how} the engine shared by {self._instances} instances"
        self._logger.log_info(
            f"dspark: engine started (spec_mode={config.spec_mode}, device={config.device}){shared}"
        )

    def _make_engine(self, config: EngineConfig, on_death) -> AsyncEngine | EngineProcess:  # noqa: ANN001
        """The engine this model serves (benchmarks/serving_ceiling.py puts a synthetic one here)."""
        if config.engine_process:
            return open_engine(config, on_death, self._rendezvous)
        if self._shared:
            raise pb_utils.TritonModelException(
                "instance_group: several instances share one engine process; set engine_process true"
            )
        # Only an engine in this process loads the engine's modules (and torch) here.
        from dspark.engine.async_engine import AsyncEngine

        return AsyncEngine(config, on_death=on_death)

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                cancel_id = string_input(request, "cancel_request_id")
                if cancel_id is not None:
                    self._cancel_by_id(cancel_id, sender)
                else:
                    self._submit(request, sender)
            except InvalidParameterError as exc:
                self._reply_error(sender, describe(exc), pb_utils.TritonError.INVALID_ARG, "invalid")
            except EngineDeadError as exc:
                self._reply_error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE, "error")
            except Exception as exc:  # a request must never take the model down
                self._logger.log_error(f"dspark: request failed: {traceback.format_exc()}")
                self._reply_error(sender, f"internal error: {exc}", pb_utils.TritonError.INTERNAL, "error")
        return None

    def finalize(self) -> None:
        self._engine.shutdown()  # in-flight requests end with reason "abort"; their last deltas are merged
        if self._rendezvous is not None and self._publishes_engine:
            forget(self._rendezvous)
        self._stopping.set()
        self._poller.join()
        self._end_abandoned()
        self._stop_sending()
        self._logger.log_info("dspark: engine shut down")
        # This backend process exits next, and Triton stops a model's instances one after another.
        skip_exit_collection()

    # execute(): hand over ----------------------------------------------------------------------

    def _submit(self, request, sender) -> None:
        inputs = generate_inputs(request)
        text, token_ids, params = inputs.text, inputs.token_ids, inputs.params
        shown = text  # the prompt a non-streamed completion starts with, unless excluded
        if inputs.chat:
            shown, token_ids = self._chat_prompt(text)
            text = None
        prefix = ""
        if not inputs.stream and not inputs.exclude_input:
            prefix = shown if shown is not None else self._engine.tokenizer.decode(token_ids)
        live = _Live(
            engine_id=f"{self._id_prefix}req-{next(self._next_id)}",
            triton_id=request.request_id(),
            sender=sender,
            stream=inputs.stream,
            returns=inputs.returns,
            prefix=prefix,
            arrived=time.monotonic(),
        )
        with self._lock:
            self._live[live.engine_id] = live
        tag = {"tag": live.triton_id} if self._shared else {}  # what another instance cancels it by
        try:
            self._engine.submit(
                live.engine_id,
                params,
                partial(self._on_delta, live),
                prompt=text,
                prompt_token_ids=token_ids,
                **tag,
            )
        except BaseException as exc:
            with self._lock:
                self._live.pop(live.engine_id, None)
            chat_ids = (
                inputs.chat and isinstance(exc, InvalidParameterError) and exc.field == "prompt_token_ids"
            )
            if chat_ids:  # the client sent text, not ids
                raise InvalidParameterError("text_input", f"as a chat turn, {message(exc)}") from None
            raise

    def _chat_prompt(self, user_turn: str) -> tuple[str, list[int]]:
        """One user turn rendered by the chat template, and its token ids (`Tokenizer.chat_prompt`)."""
        try:
            return self._engine.tokenizer.chat_prompt([{"role": "user", "content": user_turn}])
        except ChatTemplateError as exc:
            raise InvalidParameterError("apply_chat_template", str(exc)) from None

    def _cancel_by_id(self, target: str, sender) -> None:
        """Abort the requests in flight with this Triton request id ("*": all of them); the answer,
        one final response with finish_reason "cancelled", follows the last of their final responses."""
        if not target:
            raise InvalidParameterError("cancel_request_id", "must be the id of a request in flight")
        if self._shared:
            self._cancel_in_engine(target, sender)
            return
        with self._lock:
            matches = [live for live in self._live.values() if target in (CANCEL_ALL, live.triton_id)]
            if matches and not self._engine.healthy:  # a dead engine ends nothing: answer at once
                self._queue_reply(_Reply(sender, _cancelled(), None))
                return
            if matches:
                self._cancels.append(_PendingCancel(sender, {live.engine_id for live in matches}))
        if not matches and target != CANCEL_ALL:
            message = f"cancel_request_id: no request in flight with id {target!r}"
            self._reply_error(sender, message, pb_utils.TritonError.NOT_FOUND, None)
        elif not matches:
            self._queue_reply(_Reply(sender, _cancelled(), None))
        for live in matches:
            self._engine.abort(live.engine_id)

    def _cancel_in_engine(self, target: str, sender) -> None:
        """With several instances the request may be another's: the engine process aborts every
        instance's requests with that id and says when the last one ended there (the answer then
        follows the engine's end of them; their final responses go out from their own instances)."""

        def matched(count: int) -> None:
            if count == 0 and target != CANCEL_ALL:
                message = f"cancel_request_id: no request in flight with id {target!r}"
                self._reply_error(sender, message, pb_utils.TritonError.NOT_FOUND, None)
            elif count == 0:
                self._queue_reply(_Reply(sender, _cancelled(), None))

        self._engine.cancel(target, matched, lambda: self._queue_reply(_Reply(sender, _cancelled(), None)))

    def _reply_error(self, sender, message: str, code: Any, outcome: str | None) -> None:
        error = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
        self._queue_reply(_Reply(sender, error, outcome))

    def _queue_reply(self, reply: _Reply) -> None:
        self._send_queues[hash(id(reply.sender)) % len(self._send_queues)].put(reply)

    # The engine's side: merge and hand over ------------------------------------------------------

    def _on_delta(self, live: _Live, delta: RequestDelta) -> None:
        """Engine thread: merge into the request's pending update, queue the request for its send
        thread unless it is queued already, and return (never block the engine, nor hold the GIL long)."""
        now = time.monotonic()
        with self._lock:
            if live.closed:
                return
            live.pending.append(delta)
            if delta.new_token_ids:
                live.last_pending_at = now
                if live.first_pending_at is None:
                    live.first_pending_at = now
            # Queued already: a later update goes with the one queued, but a final one goes ahead of
            # a queued entry that is not (that entry then finds nothing left to send).
            if live.scheduled and (live.ahead or not delta.finished):
                return
            # The first response and the final one go ahead of the rest, unpaced; the others are
            # paced (see the module).
            first = live.spec_seen is None
            kind = SendQueue.FIRST if first else SendQueue.FINAL if delta.finished else SendQueue.REST
            budget = self._responses_per_s
            due = live.sent_at + len(self._live) / budget if budget > 0 else 0.0
            live.scheduled, live.ahead = True, kind != SendQueue.REST
            live.deferred = defer = not live.ahead and due > now
        sends = self._send_queues[hash(live.engine_id) % len(self._send_queues)]
        if defer:
            sends.put_later(live, due)
        else:
            sends.put(live, kind)

    def _on_engine_death(self, cause: BaseException) -> None:
        """Engine thread: its requests' failed deltas came first; the poll thread ends this process."""
        self._engine_death = cause

    # The send threads --------------------------------------------------------------------------

    def _send_loop(self, sends: SendQueue) -> None:
        """A send thread: each send waits on a round trip to the server process, outside the GIL."""
        while (item := sends.take()) is not None:
            try:
                if isinstance(item, _Reply):
                    self._send_now(item.sender, item.response, final=True)
                    if item.outcome is not None:
                        self._metrics.request_finished(item.outcome)
                else:
                    self._send_pending(item)
            except Exception:
                self._logger.log_error(f"dspark: send thread: {traceback.format_exc()}")

    def _send_pending(self, live: _Live) -> None:
        """Send what the engine committed for this request since its last response, as one response."""
        with self._lock:
            deltas, first_at, last_at = live.pending, live.first_pending_at, live.last_pending_at
            live.pending, live.first_pending_at, live.last_pending_at = [], None, None
            live.scheduled = live.ahead = live.deferred = False
            if not deltas or live.closed:
                return
            live.sent_at = time.monotonic()
            delta = merge_deltas(deltas)
            settled: list[_PendingCancel] = []
            if delta.finished:
                live.closed = True
                settled = self._settle(live)
        self._account(live, delta, first_at, last_at)
        response = self._response(live, delta)
        if response is not None and delta.finished:
            with live.final_lock:
                self._send_now(live.sender, response, final=True)
                live.final_sent = True
        elif response is not None:
            self._send_now(live.sender, response, final=False)
        for cancel in settled:  # after the response it waited on
            self._send_now(cancel.sender, _cancelled(), final=True)

    def _settle(self, live: _Live) -> list[_PendingCancel]:
        """Under the lock: forget an ended request; the cancel requests it was the last one of."""
        self._live.pop(live.engine_id, None)
        settled = [cancel for cancel in self._cancels if cancel.settle(live.engine_id)]
        self._cancels = [cancel for cancel in self._cancels if cancel.waiting_on]
        return settled

    def _response(self, live: _Live, delta: RequestDelta):  # noqa: ANN202 - pb_utils.InferenceResponse
        """The response for this (merged) update, None when there is nothing to send yet."""
        if live.cancelled:
            if not delta.finished:
                return None
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
            )
        if delta.finish_reason == "error":
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"engine error: {delta.error}", pb_utils.TritonError.INTERNAL)
            )
        if live.stream:
            return self._data_response(live, delta, delta.new_text, delta.new_token_ids)
        live.text.append(delta.new_text)
        live.token_ids.extend(delta.new_token_ids)
        if not delta.finished:
            return None
        return self._data_response(live, delta, live.prefix + "".join(live.text), live.token_ids)

    def _account(
        self, live: _Live, delta: RequestDelta, first_at: float | None, last_at: float | None
    ) -> None:
        """Metrics of one response: times measured from when the engine's tokens arrived."""
        spec = delta.spec_stats.as_dict()
        if live.spec_seen is None:
            self._metrics.prompt_tokens(delta.num_prompt_tokens)
        count = len(delta.new_token_ids)
        if count and last_at is not None:
            first = live.last_token_at is None
            since_arrival = first_at - live.arrived if first and first_at is not None else None
            since_last = None if first else last_at - live.last_token_at
            self._metrics.tokens_generated(count, since_arrival, since_last)
            live.last_token_at = last_at
        self._metrics.speculation(live.spec_seen, spec)
        live.spec_seen = spec
        if delta.finished:
            ended_at = last_at if last_at is not None else time.monotonic()
            self._metrics.request_finished(delta.finish_reason or "stop")
            self._metrics.request_completed(
                delta.num_prompt_tokens, delta.num_output_tokens, ended_at - live.arrived
            )

    def _data_response(self, live: _Live, delta: RequestDelta, text: str, token_ids: list[int]):
        spec = live.spec_seen or {}
        outputs = [
            _strings("text_output", [text]),
            pb_utils.Tensor("output_ids", np.array(token_ids, np.int32)),
        ]
        if "return_finish_reason" in live.returns:
            # str(None) before the end: the "None" Triton's vLLM backend sends on non-final responses
            outputs.append(_strings("finish_reason", [str(delta.finish_reason)]))
        if "return_num_input_tokens" in live.returns:
            outputs.append(
                pb_utils.Tensor("num_input_tokens", np.array([delta.num_prompt_tokens], np.uint32))
            )
        if "return_num_output_tokens" in live.returns:
            outputs.append(pb_utils.Tensor("num_output_tokens", np.array([len(token_ids)], np.uint32)))
        if "return_spec_stats" in live.returns:
            outputs.append(_strings("spec_stats", [json.dumps(spec)]))
        if "return_logprobs" in live.returns:
            # The tokens of this response (a stream's new ones, or all): the last of the request's entries.
            entries = None if delta.logprobs is None else delta.logprobs.last(len(token_ids))
            outputs.append(_strings("logprobs", [logprobs_json(entries)]))
        if "return_cumulative_logprob" in live.returns:
            # NaN when the request asked for no logprobs (vLLM computes none then, and sends NaN too)
            value = float("nan") if delta.cumulative_logprob is None else delta.cumulative_logprob
            outputs.append(pb_utils.Tensor("cumulative_logprob", np.array([value], np.float32)))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def _send_now(self, sender, response, final: bool) -> None:
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception as exc:  # the client may be gone; the request still ends in the engine
            self._logger.log_warn(f"dspark: send failed: {exc}")

    def _stop_sending(self) -> None:
        """Let the send threads send what they hold, then end them."""
        for sends in self._send_queues:
            sends.put(None)
        for thread in self._send_threads:
            thread.join()

    # The poll thread ---------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        """Every POLL_INTERVAL_S: cancellations, load gauges and counters; exit once the engine died."""
        exit_at: float | None = None
        while not self._stopping.wait(POLL_INTERVAL_S):
            if self._engine_death is not None and exit_at is None:
                closed = isinstance(self._engine_death, EngineClosedError)
                grace = CLOSED_GRACE_S if closed else DEATH_GRACE_S
                log = self._logger.log_info if closed else self._logger.log_error
                log(
                    f"dspark: the engine stopped on {self._engine_death!r}; its requests failed; this "
                    f"backend process exits in {grace:.0f}s (unless it is unloaded first) so that the "
                    "server is restarted"
                )
                exit_at = time.monotonic() + grace
            if exit_at is not None and time.monotonic() >= exit_at:
                self._exit_after_engine_death()
            try:
                self._poll_cancelled()
                if self._publishes_engine:
                    self._metrics.load(self._engine.load())
                self._metrics.flush()
            except Exception:
                self._logger.log_error(f"dspark: poll thread: {traceback.format_exc()}")

    def _poll_cancelled(self) -> None:
        """Ask up to CANCEL_POLL_BUDGET senders, in turn, whether their client went away: each ask is a
        round trip to the server process, and asking all of them every poll took the time of sends
        at hundreds of streams (a cancel is still seen within a few polls)."""
        with self._lock:
            live_now = list(self._live.values())
        if len(live_now) > CANCEL_POLL_BUDGET:
            start = self._cancel_poll_at % len(live_now)
            live_now = (live_now[start:] + live_now[:start])[:CANCEL_POLL_BUDGET]
            self._cancel_poll_at = start + CANCEL_POLL_BUDGET
        for live in live_now:
            if live.cancelled or live.closed:
                continue
            with live.final_lock:
                if live.final_sent or not live.sender.is_cancelled():
                    continue
            live.cancelled = True
            # The vLLM backend's wording, which its clients' tests and log scrapers look for.
            self._logger.log_info(f"[vllm] Cancelling the request (dspark: {live.triton_id!r} cancelled)")
            self._engine.abort(live.engine_id)
            self._logger.log_info("[vllm] Successfully cancelled the request")

    def _exit_after_engine_death(self) -> None:
        """End what is still open, then end this process: `dspark serve` sees it and restarts the server."""
        self._end_abandoned()
        self._stop_sending()
        print("dspark: backend process exits after the engine died", file=sys.stderr, flush=True)
        os._exit(1)

    def _end_abandoned(self) -> None:
        """After shutdown: close any request the engine never finished, so Triton can release it (one
        whose final update is pending is left to its send thread)."""
        ends: list[tuple[Any, Any]] = []
        with self._lock:
            for live in list(self._live.values()):
                if live.pending and live.pending[-1].finished:
                    continue
                live.closed = True
                live.pending = []
                gone = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("model is shutting down", pb_utils.TritonError.UNAVAILABLE)
                )
                ends.append((live.sender, gone))
                ends.extend((cancel.sender, _cancelled()) for cancel in self._settle(live))
        for sender, response in ends:
            self._queue_reply(_Reply(sender, response, None))

    def _make_metrics(self, config: EngineConfig, args: dict) -> Metrics:
        if not config.enable_metrics:
            return Metrics()
        labels = {"model": args["model_name"], "version": args["model_version"]}
        try:
            return TritonMetrics(
                pb_utils.MetricFamily,
                labels,
                max_model_len=vllm_max_model_len(config),
                instances=self._instances,
            )
        except pb_utils.TritonModelException as exc:  # the server runs with --allow-metrics=false
            self._logger.log_warn(f"dspark: metrics unavailable: {exc}")
            return Metrics()


# Responses ----------------------------------------------------------------------------------------


def _cancelled():
    """The answer to a cancel request."""
    return pb_utils.InferenceResponse(
        output_tensors=[_strings("text_output", [""]), _strings("finish_reason", ["cancelled"])]
    )


def _strings(name: str, values: list[str]):
    """A string output tensor, UTF-8 encoded."""
    return pb_utils.Tensor(name, np.array([value.encode("utf-8") for value in values], dtype=np.object_))
