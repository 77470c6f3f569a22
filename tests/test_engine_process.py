"""EngineProcess: the engine in a process of its own streams what the in-process engine streams, bad
requests still fail at once naming the field, and a fault or a killed engine process fails every request
and reports once."""

from __future__ import annotations

import os
import queue
import signal
import threading

import pytest
from server_fixtures import wait_for

from dspark import EngineConfig, InvalidParameterError, SamplingParams
from dspark.engine.async_engine import AsyncEngine, EngineDeadError
from dspark.outputs import RequestDelta
from dspark.serving.engine_process import EngineClosedError, EngineProcess
from dspark.serving.shared_engine import instance_count, open_engine

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [3, 1, 4, 1, 5, 2], [7, 7, 2]]


def _config(target_dir, draft_dir, **changes) -> EngineConfig:
    base = EngineConfig(
        model=str(target_dir), draft_model=str(draft_dir), num_kv_pages=256, kv_page_size=4, max_num_seqs=8
    )
    return base.replace(**changes)


def _collect(engine, name: str, params: SamplingParams, prompt: list[int]) -> queue.Queue:
    deltas: queue.Queue = queue.Queue()
    engine.submit(name, params, deltas.put, prompt_token_ids=prompt)
    return deltas


def _until_final(deltas: queue.Queue, timeout: float = 60.0) -> list:
    seen = []
    while not seen or not seen[-1].finished:
        seen.append(deltas.get(timeout=timeout))
    return seen


class _Deaths:
    def __init__(self) -> None:
        self.causes: list[BaseException] = []
        self.event = threading.Event()

    def __call__(self, cause: BaseException) -> None:
        self.causes.append(cause)
        self.event.set()


def test_the_engine_process_streams_what_the_in_process_engine_streams(tiny_target_dir, tiny_drafter_dir):
    config = _config(tiny_target_dir, tiny_drafter_dir)
    expected = []
    local = AsyncEngine(config)
    local.start()
    try:
        for i, prompt in enumerate(PROMPTS):
            expected.append(
                [t for d in local.stream(f"r{i}", GREEDY, prompt_token_ids=prompt) for t in d.new_token_ids]
            )
    finally:
        local.shutdown()
    engine = EngineProcess(config)
    engine.start()
    try:
        streams = [_collect(engine, f"r{i}", GREEDY, prompt) for i, prompt in enumerate(PROMPTS)]
        got = [[t for d in _until_final(s) for t in d.new_token_ids] for s in streams]
        # The loop's intake counters, sent with the deltas: every request admitted, its hand-over in
        # this process timed to its admission and to its first token there.
        loop = engine.load().loop
        assert loop.admitted_requests == len(PROMPTS)
        assert 0 < loop.intake_wait_seconds < loop.first_token_seconds < 60 * len(PROMPTS)
        # And its time between steps: commands taken in, each step's deltas handed to the pipe; with
        # the steps and the idle waits, no more than the loop has lived.
        assert loop.intake_seconds > 0 and loop.handover_seconds > 0
        between = loop.intake_seconds + loop.handover_seconds
        assert between + loop.step_seconds + loop.idle_seconds < 60 * len(PROMPTS)
        with pytest.raises(InvalidParameterError) as bad:
            engine.submit("bad", GREEDY, lambda d: None, prompt_token_ids=[])
        assert bad.value.field == "prompt_token_ids"
        assert engine.healthy
    finally:
        engine.shutdown()
    assert got == expected
    assert not engine.healthy and not engine._process.is_alive()


def test_the_text_made_in_the_adapters_process_is_the_engines(tiny_target_dir, tiny_drafter_dir):
    """The engine process leaves the text of requests without stop strings to the adapter's side
    (`RequestDelta.text_pending`): what arrives is the in-process engine's text, delta by delta merged,
    for requests that end by length, by EOS or by a stop string (whose text the engine still makes)."""
    config = _config(tiny_target_dir, tiny_drafter_dir)
    cases = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=40),  # EOS (w0) may end it, its id kept out of the text
        SamplingParams(max_tokens=40, stop=["w3"], ignore_eos=True),
    ]
    local = AsyncEngine(config)
    local.start()
    try:
        expected = [
            ("".join(d.new_text for d in deltas), deltas[-1].finish_reason)
            for i, params in enumerate(cases)
            for deltas in [list(local.stream(f"t{i}", params, prompt_token_ids=PROMPTS[i]))]
        ]
    finally:
        local.shutdown()
    engine = EngineProcess(config)
    engine.start()
    try:
        streams = [_collect(engine, f"t{i}", params, PROMPTS[i]) for i, params in enumerate(cases)]
        got = []
        for stream in streams:
            deltas = _until_final(stream)
            assert not any(d.text_pending for d in deltas)
            got.append(("".join(d.new_text for d in deltas), deltas[-1].finish_reason))
    finally:
        engine.shutdown()
    assert got == expected
    assert all(text for text, _ in got)


def test_shutdown_ends_requests_in_flight_with_abort(tiny_target_dir, tiny_drafter_dir):
    engine = EngineProcess(_config(tiny_target_dir, tiny_drafter_dir))
    engine.start()
    deltas = _collect(engine, "long", LONG, PROMPTS[0])
    assert not deltas.get(timeout=60).finished
    engine.shutdown()
    assert _until_final(deltas)[-1].finish_reason == "abort"
    assert not engine._process.is_alive()


def test_an_engine_fault_fails_every_request_and_reports_once(tiny_target_dir, tiny_drafter_dir, tmp_path):
    trigger = tmp_path / "fault"
    deaths = _Deaths()
    engine = EngineProcess(
        _config(tiny_target_dir, tiny_drafter_dir, fault_injection_file=str(trigger)), deaths
    )
    engine.start()
    try:
        streams = [_collect(engine, f"r{i}", LONG, prompt) for i, prompt in enumerate(PROMPTS)]
        for deltas in streams:
            assert not deltas.get(timeout=60).finished
        trigger.touch()
        for deltas in streams:
            last = _until_final(deltas)[-1]
            assert last.finish_reason == "error" and "InjectedFault" in last.error
        assert deaths.event.wait(10) and len(deaths.causes) == 1
        assert not engine.healthy
        with pytest.raises(EngineDeadError):
            engine.submit("late", LONG, lambda d: None, prompt_token_ids=PROMPTS[0])
    finally:
        engine.shutdown()


def test_a_killed_engine_process_fails_every_request_and_reports_once(tiny_target_dir, tiny_drafter_dir):
    deaths = _Deaths()
    engine = EngineProcess(_config(tiny_target_dir, tiny_drafter_dir), deaths)
    engine.start()
    try:
        streams = [_collect(engine, f"r{i}", LONG, prompt) for i, prompt in enumerate(PROMPTS)]
        for deltas in streams:
            assert not deltas.get(timeout=60).finished
        os.kill(engine._process.pid, signal.SIGKILL)
        for deltas in streams:
            assert _until_final(deltas)[-1].finish_reason == "error"
        assert deaths.event.wait(10) and len(deaths.causes) == 1
        assert "exited" in str(deaths.causes[0])
        assert not engine.healthy
    finally:
        engine.shutdown()


def test_an_engine_process_whose_events_cannot_be_sent_exits():
    """A delta that cannot cross the pipe (here: unpicklable) ends the engine process, so the adapter
    sees the pipe close and fails its requests instead of waiting for them forever."""
    from multiprocessing import Pipe

    from dspark.serving.engine_process import SENDER_FAILED_STATUS, _Outbox, _send_events_or_exit

    ours, theirs = Pipe(duplex=False)
    outbox = _Outbox()
    bad = RequestDelta.failed("r", "x")
    bad.error = lambda: None  # no pickle for a lambda
    outbox.put_now(bad)
    statuses: list[int] = []
    _send_events_or_exit(outbox, theirs, exit_process=statuses.append)
    assert statuses == [SENDER_FAILED_STATUS]


def test_a_models_instances_share_one_engine_process(tiny_target_dir, tiny_drafter_dir, tmp_path):
    """The first instance spawns the engine (`open_engine`), the next attaches to it over the socket;
    both stream what the engine streams, a cancel asked through one ends the other's request tagged so,
    an instance leaving leaves the other served, and the spawning one leaving ends the engine."""
    config = _config(tiny_target_dir, tiny_drafter_dir)
    socket_path = tmp_path / "engine.sock"
    first = open_engine(config, None, socket_path)
    deaths = _Deaths()
    second = open_engine(config, deaths, socket_path)
    third = open_engine(config, None, socket_path)
    assert first.owner and not second.owner and not third.owner
    for engine in (first, second, third):
        engine.start()
    try:
        streams = [_collect(engine, f"{n}-r", GREEDY, PROMPTS[0]) for n, engine in enumerate((first, second))]
        got = [[t for d in _until_final(s) for t in d.new_token_ids] for s in streams]
        assert got[0] == got[1] and len(got[0]) == GREEDY.max_tokens
        # The occupancy goes with the deltas to the spawning instance only (it publishes the gauges).
        assert first.load().loop.steps > 0 and second.load().loop.steps == 0

        tagged: queue.Queue = queue.Queue()
        first.submit("long", LONG, tagged.put, prompt_token_ids=PROMPTS[1], tag="triton-7")
        assert not tagged.get(timeout=60).finished
        matched: queue.Queue = queue.Queue()
        done = threading.Event()
        second.cancel("triton-7", matched.put, done.set)
        assert matched.get(timeout=30) == 1 and done.wait(30)
        assert _until_final(tagged)[-1].finish_reason == "abort"
        second.cancel("no-such-request", matched.put, done.set)
        assert matched.get(timeout=30) == 0

        going_on = _collect(first, "going-on", LONG, PROMPTS[2])
        assert not going_on.get(timeout=60).finished
        third.shutdown()
        assert not third.healthy and first.healthy and second.healthy
        assert not going_on.get(timeout=60).finished  # still served
    finally:
        first.shutdown()
    assert _until_final(going_on)[-1].finish_reason == "abort"
    # The engine went with the spawning instance, as at an unload: no fault.
    assert deaths.event.wait(30) and not second.healthy
    assert [type(cause) for cause in deaths.causes] == [EngineClosedError]
    assert not first._process.is_alive() and not socket_path.exists()
    second.shutdown()


def test_instances_are_counted_from_the_models_instance_groups():
    assert instance_count({}) == 1
    assert instance_count({"instance_group": [{"kind": "KIND_MODEL", "count": 4}]}) == 4
    assert instance_count({"instance_group": [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}]}) == 4
    assert instance_count({"instance_group": [{"count": 2}, {"count": 1}]}) == 3


def test_the_rendezvous_is_private_and_forgets_servers_that_are_gone(tmp_path, monkeypatch):
    import tempfile

    from dspark.serving.shared_engine import forget, rendezvous

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = 2**22 + 12345  # above any pid this kernel hands out
    directory = rendezvous("m", "1", os.getpid()).parent
    assert directory.stat().st_mode & 0o777 == 0o700
    for name in (f"{gone}-m-1.sock", f"{gone}-m-1.lock", f"{os.getpid()}-m-1.lock"):
        (directory / name).touch()
    path = rendezvous("m", "1", os.getpid())
    assert sorted(p.name for p in directory.iterdir()) == [f"{os.getpid()}-m-1.lock"]
    forget(path)
    assert not list(directory.iterdir())
    directory.chmod(0o755)
    with pytest.raises(PermissionError):
        rendezvous("m", "1", os.getpid())


def test_an_instance_that_dies_fails_the_other_instances_requests(
    tiny_target_dir, tiny_drafter_dir, tmp_path
):
    """A backend process gone without a shutdown (killed) is a fault: the requests of the instances
    still attached end with an error naming it, never with the abort of a normal stop."""
    config = _config(tiny_target_dir, tiny_drafter_dir)
    socket_path = tmp_path / "engine.sock"
    first = open_engine(config, None, socket_path)
    deaths = _Deaths()
    second = open_engine(config, deaths, socket_path)
    for engine in (first, second):
        engine.start()
    try:
        streams = [_collect(engine, f"{n}-r", LONG, PROMPTS[n]) for n, engine in enumerate((first, second))]
        for deltas in streams:
            assert not deltas.get(timeout=60).finished
        first._control.close()  # as a killed process's pipe closes: no shutdown was sent
        last = _until_final(streams[1])[-1]
        assert last.finish_reason == "error" and "InstanceGone" in last.error, last
        assert deaths.event.wait(30) and not second.healthy
        assert "InstanceGone" in str(deaths.causes[0])
        # Polled: the adapter's reader thread reaps the process too, and a join racing it can miss the exit.
        assert wait_for(lambda: not first._process.is_alive(), 30, interval=0.05)
    finally:
        second.shutdown()
        first.shutdown()
