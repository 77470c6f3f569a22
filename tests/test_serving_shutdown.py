"""`dspark serve` stops cleanly on Ctrl-C: in-flight requests end, finalize runs, no process is left."""

from __future__ import annotations

import signal
import time

import pytest
from server_fixtures import GrpcStream, start_server

pytestmark = pytest.mark.server


def test_ctrl_c_ends_in_flight_streams_runs_finalize_and_leaves_no_process(smollm2_dir, tmp_path):
    server = start_server(tmp_path)
    grpc = GrpcStream(server)
    try:
        grpc.send(
            text_input="Tell me about rivers.",
            stream=True,
            sampling_parameters={"max_tokens": 400, "ignore_eos": True},
            return_finish_reason=True,
        )
        assert not isinstance(grpc.next(), str)
        started = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        rest = grpc.collect(timeout=30)
        grpc.close()
        assert server.process.wait(60) == 0
        stopped_after = time.monotonic() - started
    finally:
        grpc.close()
        server.stop()
    assert rest.error is None and rest.finish_reason == "abort"
    assert "dspark: engine shut down" in server.log_path.read_text(), "finalize ran"
    assert stopped_after < 20, "no wait for Triton's exit timeout"
    assert server.leftover_processes() == []
