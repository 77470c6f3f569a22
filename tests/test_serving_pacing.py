"""The adapter's response pacing (model_repository/dspark/1/model.py), without a server: a request's first
and final responses go at once, ahead of the rest, the others wait until their due time and merge what
arrives meanwhile, and a send queue gives first responses, then final ones, then due ones, then the
rest."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import types

import pytest

from dspark.config import REPO_ROOT
from dspark.outputs import RequestDelta, SpecStats
from dspark.serving.send_queue import SendQueue


@pytest.fixture(scope="module")
def model():  # noqa: ANN201 - the adapter's module, over a stand-in for the stub's pb_utils
    fake = types.ModuleType("triton_python_backend_utils")
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = fake
    try:
        spec = importlib.util.spec_from_file_location(
            "dspark_model_pacing", REPO_ROOT / "model_repository/dspark/1/model.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("dspark_model_pacing", None)
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


def delta(tokens: int, finished: bool = False) -> RequestDelta:
    reason = "length" if finished else None
    return RequestDelta("req-0", [1] * tokens, "x" * tokens, finished, reason, 3, tokens, SpecStats())


def adapter(model, live_count: int, responses_per_s: float = 2000.0):  # noqa: ANN001, ANN201
    """A TritonPythonModel with only what _on_delta and _send_pending's bookkeeping use."""
    self = object.__new__(model.TritonPythonModel)
    self._responses_per_s = responses_per_s
    self._lock = threading.Lock()
    self._send_queues = [SendQueue()]
    self._live = {f"other-{i}": None for i in range(live_count - 1)}
    return self


def live(model, sent: bool):  # noqa: ANN001, ANN201
    request = model._Live("req-0", "t", None, True, frozenset(), "", time.monotonic())
    if sent:  # a response went out just now
        request.spec_seen, request.sent_at = {}, time.monotonic()
    return request


def queued(sends) -> tuple[int, int, int]:  # noqa: ANN001
    return len(sends._first) + len(sends._final), len(sends._later), len(sends._rest)


def test_a_first_response_goes_at_once_ahead_of_the_rest(model):
    self = adapter(model, 256)
    request = live(model, sent=False)
    self._on_delta(request, delta(1))
    assert queued(self._send_queues[0]) == (1, 0, 0)


def test_a_later_response_waits_for_its_due_time_and_merges_what_arrives(model):
    self = adapter(model, 200, 1000.0)  # due 0.2 s after the last response
    request = live(model, sent=True)
    self._on_delta(request, delta(1))
    self._on_delta(request, delta(2))
    sends = self._send_queues[0]
    assert queued(sends) == (0, 1, 0) and request.deferred and len(request.pending) == 2
    due = sends._later[0][0]
    assert 0.15 < due - request.sent_at <= 0.2
    got = []
    taker = threading.Thread(target=lambda: got.append((sends.take(), time.monotonic())))
    taker.start()
    taker.join(5)
    assert got and got[0][0] is request and got[0][1] >= due


def test_a_final_delta_goes_at_once_even_while_its_request_waits(model):
    self = adapter(model, 64, 10.0)  # due 6.4 s later
    request = live(model, sent=True)
    self._on_delta(request, delta(1))
    self._on_delta(request, delta(1, finished=True))
    sends = self._send_queues[0]
    assert queued(sends) == (1, 1, 0) and not request.deferred
    assert sends.take() is request  # the final one, now; the paced entry then finds nothing to send


def test_a_final_delta_goes_ahead_of_the_queued_rest(model):
    # Under load the send threads fall behind: a request queued among the rest must not keep its final
    # response (which a closed-loop client waits on to send its next request) behind them.
    self = adapter(model, 256, 0.0)  # unpaced: every update queues in order
    sends = self._send_queues[0]
    sends.put("another request's update")
    request = live(model, sent=True)
    self._on_delta(request, delta(1))
    assert queued(sends) == (0, 0, 2)
    self._on_delta(request, delta(1, finished=True))
    assert queued(sends) == (1, 0, 2) and len(request.pending) == 2
    assert sends.take() is request
    # A request queued ahead already (its first response) takes its final update along.
    fresh = live(model, sent=False)
    self._on_delta(fresh, delta(1))
    self._on_delta(fresh, delta(1, finished=True))
    assert queued(sends) == (1, 0, 2) and len(fresh.pending) == 2


def test_no_pacing_when_the_budget_is_zero_or_the_request_is_alone(model):
    for budget, count in ((0.0, 256), (2000.0, 1)):
        self = adapter(model, count, budget)
        request = live(model, sent=True)
        request.sent_at -= 0.01  # its last response went 10 ms ago
        self._on_delta(request, delta(1))
        assert queued(self._send_queues[0]) == (0, 0, 1)


def test_a_send_queue_takes_first_final_due_then_the_rest(model):
    sends = SendQueue()
    sends.put("rest")
    sends.put_later("due", time.monotonic() - 1)
    sends.put_later("later", time.monotonic() + 60)
    sends.put("final", SendQueue.FINAL)
    sends.put("first", SendQueue.FIRST)
    assert [sends.take() for _ in range(4)] == ["first", "final", "due", "rest"]
    assert queued(sends) == (0, 1, 0)
