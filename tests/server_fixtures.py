"""A real tritonserver, started through `dspark serve` on a model repository rendered into tmp, with its
OpenAI-compatible endpoint (dspark.serving.openai_frontend) on a free port too.

The repository is the checked-in one (dspark and dspark_generate) with dspark's config.pbtxt
rendered from test-friendly EngineConfig settings: a small KV cache, so that the pages a request
holds show up in the metrics, and a short context, so that a too-long prompt is cheap to build.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dspark.config import EngineConfig
from dspark.serving.triton_config import DEFAULT_INSTANCES, DEFAULT_MODEL_REPOSITORY, render_config_pbtxt

# Serving tests check speculation's counters and streams: draft on every step (the gate's timing-driven
# choice is tested in test_speculation_gate.py).
TEST_ENGINE_CONFIG = EngineConfig(
    num_kv_pages=96, kv_page_size=16, max_num_seqs=8, max_model_len=512, seed=0, adaptive_speculation=False
)
STARTUP_TIMEOUT_S = 300.0
# The OpenAI frontend's packages (the `serve` extra; `make test` always has them).
OPENAI_FRONTEND_INSTALLED = all(importlib.util.find_spec(name) for name in ("starlette", "uvicorn"))
ADMIN_KEY = "test-admin-key"  # what the test servers take as --admin-key


def _die_with_parent() -> None:
    """In the launcher: get SIGTERM if the test process dies without stopping it."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_ports(count: int) -> list[int]:
    """Ports nobody listens on now, below the kernel's ephemeral range.

    A port taken from port 0 and released can be handed out again by the kernel to the next port-0
    bind, such as the tensor-parallel driver's rendezvous store, which binds while the server starts
    and then holds the port its HTTP service was to take (it happened: "Socket already in use"). The
    kernel never hands out a port below its ephemeral range for port 0."""
    low = _ephemeral_port_range_start()
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(max(1024, low - 10000), low)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # the wildcard address, as tritonserver binds it
            except OSError:
                continue
        ports.append(port)
    return ports


def _ephemeral_port_range_start() -> int:
    """The first port the kernel may pick for port 0 (Linux: ip_local_port_range; 32768 if unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def render_model_repository(root: Path, config: EngineConfig, instances: int = DEFAULT_INSTANCES) -> Path:
    """Copy the model repository into root with dspark's config.pbtxt rendered from `config` (and
    `instances` backend stubs)."""
    repo = root / "model_repository"
    shutil.copytree(DEFAULT_MODEL_REPOSITORY, repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "dspark" / "config.pbtxt").write_text(render_config_pbtxt(config, instances=instances))
    return repo


@dataclass
class TritonServer:
    """One `dspark serve` process (and the tritonserver and OpenAI frontend it runs) on free ports."""

    repo: Path
    log_path: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int = 0  # the OpenAI endpoint's (dspark.serving.openai_frontend); 0: none
    process: subprocess.Popen | None = None
    ready_after_s: float = 0.0
    _log: object = field(default=None, repr=False)

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def openai_url(self) -> str:
        """The OpenAI endpoint's base URL, as the openai package takes it."""
        return f"http://localhost:{self.openai_port}/v1"

    def start(self) -> TritonServer:
        """Launch and wait until both models are ready (idempotent while it runs)."""
        if self.process is not None and self.process.poll() is None:
            return self
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        command = [
            sys.executable,
            "-m",
            "dspark.serving.triton_launcher",
            "--model-repository",
            str(self.repo),
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            "--openai-port",
            str(self.openai_port),
            "--exit-timeout",
            "10",
            "--admin-key",
            ADMIN_KEY,
        ]
        # One intra-op thread: on a 2-core machine shared with the test client, torch's spinning
        # worker threads slow every step down by an order of magnitude.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.monotonic()
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        deadline = started + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dspark serve exited with {self.process.returncode}:\n{self.log_tail()}")
            if self._ready("dspark") and self._ready("dspark_generate") and self.openai_ready():
                self.ready_after_s = time.monotonic() - started
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM the launcher (as a service manager would) and wait for it; the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                for line in self.leftover_processes():  # tritonserver has its own process group
                    os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def leftover_processes(self) -> list[str]:
        """Command lines of live processes that belong to this server (tritonserver or a stub)."""
        markers = [str(self.repo)] + ([f"dspark_{self.process.pid}_"] if self.process else [])  # + guards
        if self.openai_port:
            markers.append(f"--port={self.openai_port} --grpc-url=")  # the OpenAI frontend
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if any(marker in cmdline for marker in markers) and state != "Z":
                found.append(f"{entry.name}: {cmdline.strip()}")
        return found

    def tritonserver_pid(self) -> int | None:
        """The pid of the tritonserver the launcher runs now (None while there is none)."""
        for line in self.leftover_processes():
            pid, cmdline = line.split(": ", 1)
            if "bin/tritonserver" in cmdline.split()[0]:
                return int(pid)
        return None

    def backend_stubs(self) -> dict[int, str]:
        """The Python backend stub processes of the running tritonserver: pid -> model instance."""
        from dspark.serving.triton_launcher import backend_stubs

        pid = self.tritonserver_pid()
        return {} if pid is None else backend_stubs(pid)

    def shared_memory_regions(self) -> list[str]:
        """Shared-memory regions of this launcher's servers that exist now."""
        if self.process is None:
            return []
        return sorted(path.name for path in Path("/dev/shm").glob(f"dspark_{self.process.pid}_*"))

    def ready(self, model: str = "dspark") -> bool:
        """True when the model's readiness endpoint answers 200."""
        return self._ready(model)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://localhost:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one sample on the metrics endpoint (labels matched as given), or None."""
        for line in self.metrics_text().splitlines():
            match = re.match(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$", line)
            if not match:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                return float(match.group(3))
        return None

    def aborted_requests(self) -> float:
        """Requests of the dspark model that ended with finish reason abort so far (0 before the first)."""
        return self.metric("dspark_requests_total", model="dspark", finish_reason="abort") or 0.0

    def post(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, str]:
        """POST JSON to the HTTP endpoint; (status, body text), errors included."""
        request = urllib.request.Request(
            f"http://{self.http_url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def openai_ready(self) -> bool:
        """True when the OpenAI endpoint lists the model (always, when the server has none)."""
        if not self.openai_port:
            return True
        try:
            with urllib.request.urlopen(f"{self.openai_url}/models", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _ready(self, model: str) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://{self.http_url}/v2/models/{model}/ready", timeout=2
            ) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


def start_server(
    root: Path, config: EngineConfig = TEST_ENGINE_CONFIG, instances: int = DEFAULT_INSTANCES
) -> TritonServer:
    """Render a repository under root and start a server on it."""
    root.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port, metrics_port, openai_port = free_ports(4)
    if not OPENAI_FRONTEND_INSTALLED:  # a bare GPU machine (gpu_check.sh) serves without it
        openai_port = 0
    server = TritonServer(
        render_model_repository(root, config, instances),
        root / "server.log",
        http_port,
        grpc_port,
        metrics_port,
        openai_port,
    )
    return server.start()


@dataclass
class Response:
    """One decoupled response as a test sees it."""

    text: str
    ids: list[int]
    finish_reason: str
    final: bool
    outputs: dict


@dataclass
class Outcome:
    """Everything one request got back: its responses, or the error that ended it."""

    responses: list[Response]
    error: str | None

    @property
    def text(self) -> str:
        return "".join(r.text for r in self.responses)

    @property
    def ids(self) -> list[int]:
        return [i for r in self.responses for i in r.ids]

    @property
    def finish_reason(self) -> str:
        return self.responses[-1].finish_reason if self.responses else ""


def grpc_inputs(**values: object) -> list:
    """InferInputs from Python values: str -> BYTES [1], bool -> BOOL [1], list[int] -> INT64 [n],
    dict -> its JSON as BYTES [1]; an explicit (numpy array, datatype) pair is sent as given."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        if isinstance(value, tuple):
            array, datatype = value
        elif isinstance(value, bool):
            array, datatype = np.array([value]), "BOOL"
        elif isinstance(value, dict):
            array, datatype = np.array([json.dumps(value).encode()], dtype=np.object_), "BYTES"
        elif isinstance(value, str):
            array, datatype = np.array([value.encode()], dtype=np.object_), "BYTES"
        else:
            array, datatype = np.array(value, dtype=np.int64), "INT64"
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class GrpcStream:
    """One gRPC bidirectional stream carrying one request at a time."""

    def __init__(self, server: TritonServer, model: str = "dspark") -> None:
        import queue

        import tritonclient.grpc as grpcclient

        self.model = model
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue = queue.Queue()
        self.in_flight = False
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, request_id: str = "", **values: object) -> GrpcStream:
        self.client.async_stream_infer(self.model, grpc_inputs(**values), request_id=request_id)
        self.in_flight = True
        return self

    def next(self, timeout: float = 120.0) -> Response | str:
        """The next response, or the error text."""
        result, error = self.results.get(timeout=timeout)
        if error is not None:
            self.in_flight = False
            return error.message() if hasattr(error, "message") else str(error)
        response = result.get_response()
        self.in_flight = not response.parameters["triton_final_response"].bool_param
        outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
        reason = outputs.get("finish_reason")
        return Response(
            text=outputs["text_output"].reshape(-1)[0].decode(),
            ids=[int(i) for i in outputs["output_ids"].reshape(-1)],
            finish_reason=reason.reshape(-1)[0].decode() if reason is not None else "",
            final=response.parameters["triton_final_response"].bool_param,
            outputs=outputs,
        )

    def collect(self, timeout: float = 120.0) -> Outcome:
        """Responses until the final one (or an error)."""
        responses: list[Response] = []
        while True:
            item = self.next(timeout)
            if isinstance(item, str):
                return Outcome(responses, item)
            responses.append(item)
            if item.final:
                return Outcome(responses, None)

    def cancel(self) -> None:
        """Close the stream, cancelling its request in the server (as a client going away does)."""
        self.client.stop_stream(cancel_requests=True)

    def close(self) -> None:
        """End the stream, cancelling a request still in flight. (A finished stream is closed without
        cancelling: with Triton 2.51's gRPC frontend a cancellation racing the last response can leak
        the request's state, and the server then waits out its exit timeout at shutdown.)"""
        self.client.stop_stream(cancel_requests=self.in_flight)
        self.client.close()

    def __enter__(self) -> GrpcStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    """Poll until predicate() is true; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
