"""The engine process's delta batches cross its pipe as columns (dspark.outputs.pack_deltas): every field
of every delta comes back equal, in order, logprobs included, and a new field cannot be forgotten."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import struct
import time

from dspark.outputs import (
    EngineLoad,
    Logprob,
    LogprobsLog,
    LogprobsPrefix,
    RequestDelta,
    SpecStats,
    pack_deltas,
    unpack_deltas,
)
from dspark.serving.engine_process import _Client, _ControlIntake


def fields(delta: RequestDelta) -> list:
    values = [getattr(delta, f.name) for f in dataclasses.fields(RequestDelta)]
    values[7] = dataclasses.asdict(delta.spec_stats)
    values[9] = None if delta.logprobs is None else list(delta.logprobs)
    return values


def batch() -> list[RequestDelta]:
    log = LogprobsLog()
    log.entries.extend([{7: Logprob(-0.5, 1, "x")}, {8: Logprob(-0.25, 2, "y"), 9: Logprob(-0.1, 1, "z")}])
    return [
        RequestDelta("a", [1, 2, 3], "héllo", False, None, 5, 3, SpecStats(4, 3, 2, 1, 1, [2, 1], [3, 3])),
        RequestDelta("b", [], "", True, "abort", 7, 0, SpecStats()),
        RequestDelta.failed("c", "engine error: boom"),
        RequestDelta(
            # final: its request's last delta (the receiving process then forgets the rebuilt log).
            "d",
            [7, 8],
            "xy",
            True,
            "length",
            2,
            2,
            SpecStats(steps=2),
            None,
            LogprobsPrefix(log, 2, final=True),
            -0.75,
        ),
        RequestDelta(
            "e", [2**40], "🙂", False, None, 1, 1, SpecStats(drafted_tokens=3, verified_per_position=[1])
        ),
        RequestDelta("f", [4, 5], "", False, None, 3, 2, SpecStats(), text_pending=True),
    ]


def test_a_packed_batch_unpacks_to_equal_deltas_in_order():
    deltas = batch()
    received = unpack_deltas(pickle.loads(pickle.dumps(pack_deltas(deltas))))
    assert [fields(d) for d in received] == [fields(d) for d in deltas]
    assert [type(d.finished) for d in received] == [bool] * len(deltas)
    assert unpack_deltas(pack_deltas([])) == []


def test_every_delta_field_is_packed():
    # pack_deltas names each field it carries; a field added to RequestDelta or SpecStats must be too.
    assert len(dataclasses.fields(RequestDelta)) == 12
    assert len(dataclasses.fields(SpecStats)) == 7


def test_packed_logprobs_cross_a_real_pipe_in_order():
    mine, theirs = mp.Pipe(duplex=False)
    log = LogprobsLog()
    entries = [{t: Logprob(-0.1 * t, 1, f"w{t}")} for t in (3, 4, 5)]
    log.entries.extend(entries[:1])
    first = RequestDelta("a", [3], "w3", False, None, 1, 1, SpecStats(), logprobs=LogprobsPrefix(log, 1, 0))
    theirs.send(pack_deltas([first]))
    log.entries.extend(entries[1:])
    second = RequestDelta(
        "a", [4, 5], "w4w5", True, "stop", 1, 3, SpecStats(), logprobs=LogprobsPrefix(log, 3, 1, final=True)
    )
    theirs.send(pack_deltas([second]))
    one, two = unpack_deltas(mine.recv())[0], unpack_deltas(mine.recv())[0]
    assert one.logprobs.last(1) == entries[:1]
    assert two.logprobs.last(2) == entries[1:] and list(two.logprobs) == entries


def _delta(request_id: str, tokens: list[int], finished: bool = False) -> RequestDelta:
    reason = "length" if finished else None
    return RequestDelta(request_id, tokens, "", finished, reason, 1, len(tokens), SpecStats())


def test_the_step_loop_writes_a_busy_steps_deltas_into_the_pipe_itself_while_the_adapter_keeps_up():
    from dspark.serving.engine_process import _Outbox, _PipeRoom

    ours, theirs = mp.Pipe(duplex=False)
    pipe = _PipeRoom.of(theirs)
    assert pipe is not None and pipe.unread() == 0 and pipe.drained()  # Linux: it says what is unread
    assert pipe.write_if_fits(b"x" * 1000) and pipe.unread() == 1004  # the message and its length
    assert not pipe.drained()  # the adapter has not read the last one
    assert ours.recv_bytes() == b"x" * 1000 and pipe.drained()
    assert not pipe.write_if_fits(b"z" * (1 << 20))  # larger than the pipe: never straight
    outbox = _Outbox(pipe)
    outbox.bind_load(lambda: "load-1")
    busy = [_delta(f"r{i}", [i, i + 1]) for i in range(16)]
    for delta in busy:
        outbox.put(delta)
    outbox.wake()  # no sender thread runs: the loop's own write is all there is
    assert ours.poll(5)
    kind, packed, load = ours.recv()
    assert (kind, load) == ("deltas", "load-1")
    received = [(d.request_id, d.new_token_ids) for d in unpack_deltas(packed)]
    assert received == [(d.request_id, d.new_token_ids) for d in busy]
    assert outbox.take(0) == [] and not ours.poll(0)
    outbox.sent()
    # A step of one delta goes straight too, without the occupancy (sent at most every LOAD_EVERY_S)...
    outbox.put(_delta("x", [9]))
    outbox.wake()
    kind, packed, load = ours.recv()
    assert [d.request_id for d in unpack_deltas(packed)] == ["x"] and load is None
    assert outbox.take(0) == []
    outbox.sent()
    # ... but with it when a request ends in the batch (the adapter's gauges follow at once).
    outbox.bind_load(lambda: "load-2")
    outbox.put(_delta("x", [10], finished=True))
    outbox.wake()
    assert ours.recv()[2] == "load-2"


class _Behind:
    """A pipe whose adapter has not read the last batch yet (it reads slower than the engine steps), until
    `drained` is set; what is written goes into `theirs`."""

    def __init__(self, theirs) -> None:  # noqa: ANN001
        self.theirs = theirs
        self.is_drained = False
        self.capacity = 1 << 16

    def drained(self) -> bool:
        return self.is_drained

    def write_if_fits(self, message) -> bool:  # noqa: ANN001
        if len(message) > self.capacity:
            return False
        self.theirs.send_bytes(message)
        return True


def _held_outbox():  # noqa: ANN202
    """An outbox over a pipe whose adapter is behind, holding one step's delta ("a", [1]): (the pipe's
    reading end, the pipe, the outbox)."""
    from dspark.serving.engine_process import _Outbox

    ours, theirs = mp.Pipe(duplex=False)
    behind = _Behind(theirs)
    outbox = _Outbox(behind)
    outbox.bind_load(lambda: "load")
    outbox.put(_delta("a", [1]))
    outbox.wake()
    return ours, behind, outbox


def test_while_the_adapter_is_behind_the_loop_holds_the_deltas_and_merges_them_into_the_next_write():
    ours, behind, outbox = _held_outbox()
    outbox.put(_delta("a", [2]))
    outbox.put(_delta("b", [5]))
    outbox.wake()
    assert not ours.poll(0) and outbox.take(0) == []  # held by the loop: no sender woken, nothing sent
    outbox.sent()
    behind.is_drained = True  # caught up: the held deltas go first, with this step's, in one message
    outbox.put(_delta("a", [3], finished=True))
    outbox.wake()
    kind, packed, load = ours.recv()
    assert [(d.request_id, d.new_token_ids, d.finished) for d in unpack_deltas(packed)] == [
        ("a", [1, 2, 3], True),
        ("b", [5], False),
    ]
    assert (kind, load) == ("deltas", "load") and not ours.poll(0)
    # A step with no deltas of its own still writes what is held once the adapter has caught up.
    behind.is_drained = False
    outbox.put(_delta("c", [7]))
    outbox.wake()
    behind.is_drained = True
    outbox.wake()
    assert [d.request_id for d in unpack_deltas(ours.recv()[1])] == ["c"]


def test_what_the_loop_holds_goes_to_the_sender_when_it_idles_or_before_an_event_and_nothing_overtakes_it():
    from dspark.serving.engine_process import _send_events

    ours, behind, outbox = _held_outbox()
    outbox.release()  # the loop is about to wait idle: the sender sends what it held
    items = outbox.take(0)
    assert [d.request_id for d in items] == ["a"]
    outbox.sent()
    outbox.put(_delta("a", [2]))
    outbox.wake()
    outbox.put_now(("cancel_done", 3))  # an event goes behind the held deltas
    behind.is_drained = True
    outbox.put(_delta("a", [3], finished=True))
    outbox.wake()  # something older waits for the sender: this step's deltas wait behind it
    outbox.put_now(None)
    _send_events(outbox, behind.theirs)
    kind, packed, _ = ours.recv()
    assert [(d.request_id, d.new_token_ids) for d in unpack_deltas(packed)] == [("a", [2])]
    assert ours.recv() == ("cancel_done", 3)
    kind, packed, _ = ours.recv()
    assert [(d.request_id, d.new_token_ids, d.finished) for d in unpack_deltas(packed)] == [("a", [3], True)]
    assert not ours.poll(0)


def test_a_message_larger_than_the_pipe_goes_to_the_sender():
    from dspark.serving.engine_process import _Outbox

    ours, theirs = mp.Pipe(duplex=False)
    behind = _Behind(theirs)
    behind.is_drained, behind.capacity = True, 100
    outbox = _Outbox(behind)
    outbox.put(_delta("a", list(range(200))))
    outbox.wake()
    assert not ours.poll(0)
    assert [d.request_id for d in outbox.take(0)] == ["a"]


class _Commands:
    """The engine side of `_ControlIntake`: what it was told, in order."""

    healthy = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def submit(self, request_id, params, on_delta, prompt_token_ids=None, submitted_at=None) -> None:  # noqa: ANN001
        self.calls.append(("submit", request_id, params, prompt_token_ids, submitted_at))

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    def stop(self) -> None:
        self.calls.append(("stop",))

    def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0, 0)


def _intake():  # noqa: ANN202
    """An intake over a fake engine with one adapter: (its control's writing end, its events' reading
    end, the intake, the engine)."""
    control_ours, control_theirs = mp.Pipe(duplex=True)
    events_ours, events_theirs = mp.Pipe(duplex=False)
    engine = _Commands()
    intake = _ControlIntake()
    intake.bind(engine)
    intake.join(_Client(control_theirs, events_theirs, intake), ("ready", None))
    assert events_ours.recv() == ("ready", None)
    intake(0.5)  # takes the adapter in
    return control_ours, events_ours, intake, engine


def test_the_loop_takes_in_every_command_written_since_its_last_read_in_order():
    """Many small submits, one over 16 KiB (`Connection` writes its length and its body apart), an abort
    and a frame with the 8-byte length (what `Connection` writes past 2 GiB), all applied at one intake
    call; a message half written waits for its rest; the last adapter leaving stops the engine."""
    ours, events, intake, engine = _intake()
    big = list(range(5000))
    for i in range(50):
        ours.send(("submit", f"r{i}", None, [i, i + 1], 100.0 + i, ""))
    ours.send(("submit", "big", None, big, 1.5, "tag"))
    ours.send(("abort", "r3"))
    body = pickle.dumps(("abort", "long-framed"))
    os.write(ours.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body)
    deadline = time.monotonic() + 10
    while len(engine.calls) < 53 and time.monotonic() < deadline:
        intake(0.5)
    expected = [("submit", f"r{i}", None, [i, i + 1], 100.0 + i) for i in range(50)]
    expected += [("submit", "big", None, big, 1.5), ("abort", "r3"), ("abort", "long-framed")]
    assert engine.calls == expected
    intake(0.0)  # nothing new: nothing applied, no wait
    assert len(engine.calls) == 53

    frame = struct.pack("!i", len(body)) + body
    os.write(ours.fileno(), frame[:7])
    intake(0.2)
    assert len(engine.calls) == 53  # half a message: not yet
    os.write(ours.fileno(), frame[7:])
    intake(0.5)
    assert engine.calls[-1] == ("abort", "long-framed")

    ours.send(("shutdown",))
    intake(0.5)
    assert engine.calls[-1] == ("stop",) and intake.closed
    intake.end_all()  # the events end (their sender exits the process if it cannot write)
    assert _eof(events)


def test_an_adapter_going_away_without_shutting_down_stops_the_engine():
    ours, events, intake, engine = _intake()
    ours.close()
    intake(1.0)
    assert intake.closed and engine.calls == [("stop",)]
    intake.end_all()
    assert _eof(events)


def test_a_cancel_matches_requests_by_tag_and_is_answered_when_they_ended():
    """The answer says how many matched at once, and `cancel_done` follows the last one's final delta."""
    ours, events, intake, engine = _intake()
    ours.send(("submit", "a", None, [1], 1.0, "t1"))
    ours.send(("submit", "b", None, [1], 1.0, "t1"))
    ours.send(("submit", "c", None, [1], 1.0, "t2"))
    ours.send(("cancel", "t1", 7))
    ours.send(("cancel", "nothing", 8))
    deadline = time.monotonic() + 10
    while len(engine.calls) < 5 and time.monotonic() < deadline:
        intake(0.5)
    assert engine.calls[3:] == [("abort", "a"), ("abort", "b")] or engine.calls[3:] == [
        ("abort", "b"),
        ("abort", "a"),
    ]
    assert _event(events) == ("cancel_matched", 7, 2)
    assert _event(events) == ("cancel_matched", 8, 0)
    client = next(iter(intake._clients.values()))
    client.on_delta(RequestDelta("a", [], "", True, "abort", 1, 0, SpecStats()))
    assert _event(events, 0.3) is None  # "b" has not ended yet
    client.on_delta(RequestDelta("b", [], "", True, "abort", 1, 0, SpecStats()))
    intake.step_ended()
    got = [_event(events), _event(events)]
    assert got[0][0] == "deltas" and [d.request_id for d in unpack_deltas(got[0][1])] == ["a", "b"]
    assert got[1] == ("cancel_done", 7)
    intake.end_all()
    assert _eof(events)


def _eof(events) -> bool:  # noqa: ANN001
    """Whether the events pipe ends (after any occupancy updates)."""
    try:
        while True:
            events.recv()
    except EOFError:
        return True


def _event(events, timeout: float = 10.0):  # noqa: ANN001, ANN202
    """The next event but the occupancy updates an idle sender sends; None if none came in time."""
    deadline = time.monotonic() + timeout
    while events.poll(max(0.0, deadline - time.monotonic())):
        event = events.recv()
        if event[0] != "load":
            return event
    return None
