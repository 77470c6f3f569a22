"""Faults end the affected streams with an error within seconds, readiness tells the truth while the
server recovers, and nothing is left behind: an engine that raises inside a step, a backend process
killed mid-stream, SIGTERM under load.

Each case runs beside good streams. A fault of the engine ends every stream it holds (they share the
engine), so here the good text is checked again once the server is back.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from server_fixtures import TEST_ENGINE_CONFIG, GrpcStream, start_server, wait_for

pytestmark = pytest.mark.server

PROMPT = "Write a haiku about autumn leaves."
SHORT = {"max_tokens": 8, "ignore_eos": True}
LONG = {"max_tokens": 400, "ignore_eos": True}
ERROR_WITHIN_S = 10.0
RECOVERY_S = 180.0


@pytest.fixture(scope="module")
def fault_server(smollm2_dir, tmp_path_factory):
    """A server of its own whose engine raises at its next step once `server.fault_trigger` exists."""
    from dspark.tools.cli import main as dspark_main

    assert dspark_main(["create-draft", "--if-missing"]) == 0
    root = tmp_path_factory.mktemp("faults")
    trigger = root / "inject-fault"
    server = start_server(root, TEST_ENGINE_CONFIG.replace(fault_injection_file=str(trigger)))
    server.fault_trigger = trigger
    yield server
    assert server.stop() == 0, server.log_tail()
    assert server.leftover_processes() == []
    assert server.shared_memory_regions() == []


def greedy_text(server) -> str:
    with GrpcStream(server) as grpc:
        outcome = grpc.send(text_input=PROMPT, stream=True, sampling_parameters=SHORT).collect()
    assert outcome.error is None, outcome.error
    return outcome.text


def send_streams(server, count: int) -> list[GrpcStream]:
    """Streams of hundreds of tokens each, sent at once."""
    return [
        GrpcStream(server).send(
            text_input=PROMPT, stream=True, sampling_parameters=LONG, return_finish_reason=True
        )
        for _ in range(count)
    ]


def open_streams(server, count: int) -> list[GrpcStream]:
    """Streams that have each received a first token and go on for hundreds more."""
    streams = send_streams(server, count)
    for stream in streams:
        assert not isinstance(stream.next(), str)
    return streams


def errors_after_fault(streams: list[GrpcStream]) -> tuple[list[str | None], float]:
    """Each stream's error once it ended, and how long the slowest took to end."""
    started = time.monotonic()
    errors = [stream.collect(timeout=ERROR_WITHIN_S + 5).error for stream in streams]
    elapsed = time.monotonic() - started
    for stream in streams:
        stream.close()
    return errors, elapsed


def assert_recovers(server, expected_text: str, restarts: int) -> None:
    """Readiness drops, the server comes back ready, and serves the same greedy text."""
    assert wait_for(lambda: not server.ready(), ERROR_WITHIN_S, interval=0.05), "readiness never dropped"
    assert wait_for(lambda: server.ready() and server.ready("dspark_generate"), RECOVERY_S, interval=0.25), (
        server.log_tail()
    )
    assert server.running
    assert greedy_text(server) == expected_text
    assert server.log_text().count("restarting tritonserver") == restarts


def test_an_engine_fault_ends_every_stream_with_an_error_and_the_server_comes_back(fault_server):
    expected = greedy_text(fault_server)
    restarts = fault_server.log_text().count("restarting tritonserver")
    streams = open_streams(fault_server, 3)
    fault_server.fault_trigger.touch()
    errors, elapsed = errors_after_fault(streams)
    assert all(error is not None and "InjectedFault" in error for error in errors), errors
    assert elapsed < ERROR_WITHIN_S
    assert_recovers(fault_server, expected, restarts + 1)
    assert not fault_server.fault_trigger.exists(), "the fault fires once"


def test_a_killed_backend_process_ends_its_streams_and_the_server_comes_back(fault_server):
    expected = greedy_text(fault_server)
    restarts = fault_server.log_text().count("restarting tritonserver")
    regions_before = fault_server.shared_memory_regions()
    streams = open_streams(fault_server, 3)
    (stub,) = [pid for pid, instance in fault_server.backend_stubs().items() if instance == "dspark_0_0"]
    os.kill(stub, signal.SIGKILL)
    errors, elapsed = errors_after_fault(streams)
    assert all(error is not None for error in errors), errors
    assert elapsed < ERROR_WITHIN_S
    assert_recovers(fault_server, expected, restarts + 1)
    assert not set(regions_before) & set(fault_server.shared_memory_regions()), "the dead server's regions"


def test_sigterm_under_load_ends_every_stream_and_leaves_no_process_or_shared_memory(smollm2_dir, tmp_path):
    server = start_server(tmp_path)
    try:
        assert server.shared_memory_regions(), "the server's regions carry the launcher's prefix"
        running, waiting = TEST_ENGINE_CONFIG.max_num_seqs, 4
        streams = send_streams(server, running + waiting)
        assert wait_for(lambda: server.metric("dspark_num_requests_waiting", model="dspark") == waiting)
        assert server.metric("dspark_num_requests_running", model="dspark") == running
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        outcomes = [stream.collect(timeout=30) for stream in streams]
        for stream in streams:
            stream.close()
        status = server.process.wait(60)
        stopped_after = time.monotonic() - started
    finally:
        server.stop()
    assert status == 0
    assert all(o.error is None and o.finish_reason == "abort" for o in outcomes), [o.error for o in outcomes]
    assert stopped_after < 20
    assert server.leftover_processes() == []
    assert server.shared_memory_regions() == []


def test_a_killed_launcher_takes_its_server_along_and_leaves_no_shared_memory(smollm2_dir, tmp_path):
    server = start_server(tmp_path)
    try:
        assert server.shared_memory_regions()
        with GrpcStream(server) as grpc:
            grpc.send(text_input=PROMPT, stream=True, sampling_parameters=LONG)
            assert not isinstance(grpc.next(), str)
            server.process.send_signal(signal.SIGKILL)
            rest = grpc.collect(timeout=30)
        server.process.wait(10)
        assert rest.error is None and rest.responses[-1].final  # the guard drained the server
        assert wait_for(lambda: server.leftover_processes() == [], 30), server.leftover_processes()
        time.sleep(2)  # and nothing forked at the last moment lives on
        assert server.leftover_processes() == []
        assert server.shared_memory_regions() == []
    finally:
        server.stop()
