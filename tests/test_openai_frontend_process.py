"""The OpenAI frontend as a process: started, bound and restarted by `dspark serve`; 503 while Triton is
unreachable and serving again once Triton is back (a server restart drops every connection); gone
when the launcher's pipe closes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import yaml
from server_fixtures import free_ports, wait_for

from dspark.config import REPO_ROOT
from dspark.serving import triton_launcher
from dspark.serving.triton_launcher import Frontend, frontend_command, parse_args

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_the_frontend_binds_to_the_server_address_and_reaches_its_grpc_endpoint():
    assert parse_args([]).openai_port == 9000
    command = frontend_command(
        parse_args(["--address", "0.0.0.0", "--grpc-port", "9101", "--openai-port", "9100"])
    )
    assert command[1:3] == ["-m", "dspark.serving.openai_frontend"]
    assert {"--host=0.0.0.0", "--port=9100", "--grpc-url=localhost:9101", "--exit-with-stdin"} <= set(command)
    own = frontend_command(parse_args(["--openai-address", "127.0.0.2", "--grpc-address", "127.0.0.3"]))
    assert {"--host=127.0.0.2", "--grpc-url=127.0.0.3:8001"} <= set(own)


def test_make_serve_and_compose_serve_the_endpoint_on_9000():
    make = ["make", "-n", "-C", str(REPO_ROOT), "serve"]
    assert "--openai-port 9000" in subprocess.run(make, capture_output=True, text=True, check=True).stdout
    other = subprocess.run([*make, "OPENAI_PORT=0"], capture_output=True, text=True, check=True).stdout
    assert "--openai-port 0" in other
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    assert "9000:9000" in compose["services"]["dspark"]["ports"]


def test_a_frontend_that_keeps_dying_is_restarted_after_a_doubling_pause(monkeypatch, capsys):
    monkeypatch.setattr(triton_launcher, "FRONTEND_BACKOFF_S", (0.2, 0.3))
    frontend = Frontend([sys.executable, "-c", "raise SystemExit(3)"], pause=0.2)
    frontend.start()
    first = frontend.process
    first.wait(10)
    frontend.check()
    frontend.check()
    assert frontend.process is first, "not restarted before its pause is over"
    time.sleep(0.25)
    frontend.check()
    assert frontend.process is not first and frontend.pause == 0.3
    frontend.stop()
    assert "the OpenAI frontend exited with status 3; restarting it in 0s" in capsys.readouterr().err


class TcpProxy:
    """Forwards 127.0.0.1:port to 127.0.0.1:target until closed; closing drops every connection, as a
    server that restarts does."""

    def __init__(self, port: int, target: int) -> None:
        self.target = target
        self.sockets: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        for s in [self.listener, *self.sockets]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass


def status_of(call) -> int:
    """The HTTP status a client call ends with (200 when it succeeds)."""
    try:
        call()
    except openai.APIStatusError as exc:
        return exc.status_code
    except openai.APIConnectionError:
        return -1
    return 200


@pytest.mark.server
def test_the_frontend_answers_503_while_triton_is_unreachable_and_serves_again_after(triton_server):
    triton_port, port = free_ports(2)
    frontend = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dspark.serving.openai_frontend",
            f"--port={port}",
            f"--grpc-url=127.0.0.1:{triton_port}",
        ]
        + ["--exit-with-stdin"],
        stdin=subprocess.PIPE,
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30
    )

    def chat() -> None:
        client.chat.completions.create(model="dspark", messages=MESSAGES, max_tokens=2)

    proxy = None
    try:
        assert wait_for(lambda: status_of(client.models.list) == 503, timeout=20)
        assert status_of(chat) == 503
        proxy = TcpProxy(triton_port, triton_server.grpc_port)  # Triton comes up
        assert wait_for(lambda: status_of(client.models.list) == 200, timeout=10)
        assert status_of(chat) == 200
        proxy.close()  # ... goes down (every connection dropped) ...
        assert wait_for(lambda: status_of(chat) == 503, timeout=10)
        proxy = TcpProxy(triton_port, triton_server.grpc_port)  # ... and comes back
        assert wait_for(lambda: status_of(chat) == 200, timeout=10)
        frontend.stdin.close()  # dspark serve went away
        assert frontend.wait(20) == 0
    finally:
        if proxy is not None:
            proxy.close()
        if frontend.poll() is None:
            frontend.kill()
            frontend.wait()


@pytest.mark.server
def test_dspark_serve_restarts_a_frontend_that_died(triton_server):
    (pid,) = [
        int(line.split(":")[0]) for line in triton_server.leftover_processes() if "openai_frontend" in line
    ]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not triton_server.openai_ready(), timeout=5)
    assert wait_for(triton_server.openai_ready, timeout=30), triton_server.log_tail()
    assert "the OpenAI frontend exited with status -9; restarting it" in triton_server.log_text()
    client = openai.OpenAI(base_url=triton_server.openai_url, api_key="unused", max_retries=0)
    assert client.chat.completions.create(model="dspark", messages=MESSAGES, max_tokens=2).choices
