"""`dspark serve`: run tritonserver on the model repository, in the foreground, until Ctrl-C / SIGTERM.

The server is the system `tritonserver` when one is on PATH (the Triton container), else the one in
the nvidia-pytriton wheel. For the wheel's server a backend directory is prepared once under
`.cache/tritonserver/` holding its Python backend and the stub built for the running Python. The
Python backend's stub embeds libpython and, with no program name set, finds its interpreter as
`python3` on PATH: putting this interpreter's bin/ first on PATH (and its base libpython on
LD_LIBRARY_PATH) makes model.py run inside this virtual environment, so `import dspark, torch` works.
tritonserver runs in its own process group; shutdown signals the server, then clears the group, so
no stub process outlives it.

The launcher supervises the server. A backend stub process that dies (killed, or exiting because its
engine died) strands the requests it held and leaves the model looking ready, so the launcher then
kills the whole server, which ends every open stream with an error at once, and starts it again
(at most `--max-restarts` times in RESTART_WINDOW_S; past that it exits with status 1 and leaves the
restart to the service manager). While it restarts, readiness fails. Every server it starts gets its
own shared-memory prefix, and the regions under it are removed when that server is gone. A guard
process beside each server (start_guard) does the same if the launcher itself is killed.

Who may call what: inference, health, metadata, model configuration and statistics are open; Triton's
shared-memory, model-repository (model control), logging and trace APIs need the header
`dspark-admin-key` (ADMIN_HEADER; gRPC metadata `triton-grpc-protocol-dspark-admin-key`) set to
`--admin-key` (default: a random key per run, known to no one but the launcher, so those APIs are
effectively off). Every endpoint binds to `--address` (127.0.0.1 unless told otherwise) or its own
`--http-address` / `--grpc-address` / `--metrics-address` / `--openai-address`.

The OpenAI-compatible endpoint (`--openai-port`, 0: off) is a child process of its own
(dspark.serving.openai_frontend) that reaches the server over gRPC. The launcher starts it once and restarts
it if it dies (Frontend); it outlives server restarts, reconnecting by itself. It stops with the
launcher, and reads its standard input, a pipe only the launcher holds, so that it stops too when the
launcher is killed (the guard's own mechanism).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.config import REPO_ROOT
from dspark.serving.request_inputs import CANCEL_ALL
from dspark.serving.triton_config import DEFAULT_MODEL_REPOSITORY

BACKEND_CACHE = REPO_ROOT / ".cache" / "tritonserver"
KILL_MARGIN_S = 5.0  # after tritonserver's own exit timeout, before its process group is killed
DRAIN_TIMEOUT_S = 30.0
SUPERVISE_INTERVAL_S = 0.25  # how often the server and its backend stubs are checked
RESTART_WINDOW_S = 600.0  # --max-restarts counts restarts within this many seconds
ADMIN_HEADER = "dspark-admin-key"
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # the metadata key gRPC calls carry it in
# Triton APIs that change the server or read its memory: behind ADMIN_HEADER (HTTP and gRPC alike).
RESTRICTED_APIS = ("shared-memory", "model-repository", "logging", "trace")
SHM_ROOT = Path("/dev/shm")
STUB_BINARY = "triton_python_backend_stub"
GUARD_FLAG = "--guard"  # `python -m dspark.serving.triton_launcher --guard ...` runs guard_main
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "[::]")
FRONTEND_MODEL = "dspark"  # the Triton model the OpenAI endpoint serves
FRONTEND_BACKOFF_S = (1.0, 30.0)  # pause before restarting a dead frontend: first, and at most (doubling)
FRONTEND_STABLE_S = 60.0  # a frontend that ran this long before dying restarts after the first pause
FRONTEND_STOP_S = 15.0  # its graceful shutdown (open streams end with the drain), then it is killed


@dataclass
class Server:
    """Where the tritonserver binary is and what it needs around it."""

    binary: Path
    backend_dir: Path | None  # None: the binary's own default (the container's /opt/tritonserver/backends)
    library_dirs: list[Path]


def find_server() -> Server:
    """The system tritonserver when on PATH, else the nvidia-pytriton wheel's."""
    system = shutil.which("tritonserver")
    if system:
        return Server(Path(system), None, [])
    # Found, not imported: only the wheel's files are used, and its Python API needs more (pyzmq, ...).
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "no tritonserver on PATH and nvidia-pytriton is not installed (pip install -e '.[serve]')"
        )
    problem = wheel_stub_problem(importlib.metadata.version("numpy"))
    if problem:
        raise SystemExit(f"dspark serve: {problem}")
    root = Path(spec.submodule_search_locations[0]).resolve()
    dist = root / "tritonserver"
    return Server(
        dist / "bin" / "tritonserver", _wheel_backends(dist), [root.parent / "nvidia_pytriton.libs"]
    )


def wheel_stub_problem(numpy_version: str) -> str | None:
    """Why the nvidia-pytriton Python backend stub cannot run in this interpreter, or None.

    The wheel's stub (0.7.0) embeds this Python and was built against numpy 1: under numpy 2 every
    tensor that crosses it is corrupt and the first text request aborts it (seen on an H200 machine).
    """
    if int(numpy_version.split(".")[0]) < 2:
        return None
    return (
        f"numpy {numpy_version} is installed in {sys.executable}, but the nvidia-pytriton Python backend "
        f"stub that embeds this interpreter needs numpy < 2 (under numpy 2 it corrupts every tensor). "
        f"Run `{sys.executable} -m pip install 'numpy<2'`, or serve from the Triton container (docker/)."
    )


def _wheel_backends(dist: Path) -> Path:
    """A backends/ directory with the wheel's Python backend and the stub for this Python."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"nvidia-pytriton has no Python backend stub for Python {version}")
    target = BACKEND_CACHE / version / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for source in [stub, *(dist / "backends" / "python").glob("*.*")]:
        destination = target / source.name
        if not destination.exists() or destination.stat().st_mtime < source.stat().st_mtime:
            partial = destination.with_name(f".{destination.name}.{os.getpid()}")
            shutil.copy2(source, partial)
            os.replace(partial, destination)  # atomic: another launcher may be starting too
    return target.parent


def server_environment(server: Server) -> dict[str, str]:
    """The environment tritonserver and its Python stubs run in (see the module docstring)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libpython = Path(sys.base_prefix) / "lib"
    library_dirs = [str(d) for d in server.library_dirs]
    if (libpython / f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0").exists():
        library_dirs.insert(0, str(libpython))
    if env.get("LD_LIBRARY_PATH"):
        library_dirs.append(env["LD_LIBRARY_PATH"])
    if library_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(library_dirs)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def server_command(
    server: Server, args: argparse.Namespace, admin_key: str = "", shm_prefix: str = ""
) -> list[str]:
    """The tritonserver command line (admin APIs behind `admin_key` when given; backend shared memory
    named from `shm_prefix` when given)."""
    command = [
        str(server.binary),
        f"--model-repository={Path(args.model_repository).resolve()}",
        f"--http-address={args.http_address or args.address}",
        f"--http-port={args.http_port}",
        f"--grpc-address={args.grpc_address or args.address}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-address={args.metrics_address or args.address}",
        f"--metrics-port={args.metrics_port}",
        "--exit-on-error=true",
        f"--exit-timeout-secs={args.exit_timeout}",
    ]
    if admin_key:
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key}"
        command += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
    if shm_prefix:
        command.append(f"--backend-config=python,shm-region-prefix-name={shm_prefix}")
    if server.backend_dir is not None:
        command.append(f"--backend-directory={server.backend_dir}")
    return command + list(args.extra)


def poll_host(args: argparse.Namespace, bind_address: str | None = None) -> str:
    """Where the launcher itself reaches an endpoint bound to `bind_address` (default: HTTP's): --host,
    else the bind address (localhost for a wildcard one)."""
    if args.host:
        return args.host
    address = bind_address or args.http_address or args.address
    return "localhost" if address in WILDCARD_ADDRESSES else address


def frontend_command(args: argparse.Namespace) -> list[str]:
    """The OpenAI frontend's command line: bound like the other endpoints, talking to the gRPC one."""
    grpc_url = f"{poll_host(args, args.grpc_address or args.address)}:{args.grpc_port}"
    return [
        sys.executable,
        "-m",
        "dspark.serving.openai_frontend",
        f"--host={args.openai_address or args.address}",
        f"--port={args.openai_port}",
        f"--grpc-url={grpc_url}",
        f"--model={FRONTEND_MODEL}",
        "--exit-with-stdin",
    ]


def _proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, parent, process group, ...), or
    None when there is no such process."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _live_processes() -> list[tuple[int, list[str]]]:
    """Every live (not zombie) process: (pid, its stat fields)."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = _proc_stat(entry.name) if entry.name.isdigit() else None
        if stat is not None and stat[0] != "Z":
            found.append((int(entry.name), stat))
    return found


def backend_stubs(server_pid: int) -> dict[int, str]:
    """The Python backend stub processes of a tritonserver: pid -> model instance name."""
    stubs = {}
    for pid, stat in _live_processes():
        if stat[1] != str(server_pid):
            continue
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].decode(errors="replace").endswith(STUB_BINARY):
            stubs[pid] = argv[8].decode(errors="replace") if len(argv) > 8 else "?"
    return stubs


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def remove_shared_memory(prefix: str) -> list[str]:
    """Remove the shared-memory regions a server of this prefix left behind; their names."""
    removed = []
    for region in SHM_ROOT.glob(f"{prefix}*") if prefix else []:
        try:
            region.unlink()
            removed.append(region.name)
        except OSError:
            pass
    return removed


def wait_ready(
    process: subprocess.Popen, url: str, timeout: float, tick: Callable[[], None] | None = None
) -> bool:
    """Poll Triton's readiness endpoint until it answers 200, the process exits or time runs out
    (calling `tick`, if given, at every poll)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if tick is not None:
            tick()
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    return False


def drain(http_url: str, timeout: float = DRAIN_TIMEOUT_S, admin_key: str = "") -> None:
    """Cancel every request in flight on each decoupled model that takes `cancel_request_id`.

    Needed before tritonserver stops: it finalizes a model only after every request holding it has
    sent its last response, and once shutdown has begun, responses to streaming clients stall. The
    cancel answers after the cancelled requests' final responses (finish_reason "abort").
    """
    try:
        models = _http_json(f"{http_url}/v2/repository/index", {}, timeout=5, admin_key=admin_key)
    except OSError:
        return
    for model in models:
        if model.get("state") != "READY":
            continue
        try:
            config = _http_json(f"{http_url}/v2/models/{model['name']}/config", None, timeout=5)
            decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
            if decoupled and any(t["name"] == "cancel_request_id" for t in config.get("input", [])):
                body = {"cancel_request_id": CANCEL_ALL}
                _http_json(f"{http_url}/v2/models/{model['name']}/generate", body, timeout=timeout)
        except (OSError, ValueError, KeyError):
            continue


def _http_json(url: str, body: dict | None, timeout: float, admin_key: str = "") -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if admin_key:
        headers[ADMIN_HEADER] = admin_key
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def stop(
    process: subprocess.Popen, http_url: str | None = None, exit_timeout: float = 30.0, admin_key: str = ""
) -> int:
    """Drain the models, ask tritonserver to shut down (models unload, finalize runs), then clear its
    process group so no stub outlives it.

    tritonserver gives in-flight work `exit_timeout` seconds; past that it can hang on its way out
    (a client's gRPC stream left open holds the model), so the group is killed a little later.
    """
    if process.poll() is None and http_url is not None:
        drain(http_url, admin_key=admin_key)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(exit_timeout + KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            print("dspark serve: tritonserver did not exit in time; killing it", file=sys.stderr, flush=True)
    _kill_group(process.pid)
    return process.wait()


def _kill_group(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL a process group until none of it is left: a stub that tritonserver was forking as the
    first signal went out (its Python backend restarts stubs) would escape one killpg."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not _group_members(pgid) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    return [pid for pid, stat in _live_processes() if stat[2] == str(pgid)]


@dataclass
class ServerRun:
    """One tritonserver process the launcher started, and what it watches of it."""

    process: subprocess.Popen
    shm_prefix: str
    guard: subprocess.Popen | None = None  # see start_guard
    stubs: dict[int, str] = field(default_factory=dict)  # backend stub pid -> model instance, once ready

    def fault(self) -> str | None:
        """Why this server must be restarted, or None while it and its backend processes live."""
        if self.process.poll() is not None:
            return f"tritonserver exited with status {self.process.returncode}"
        for pid, instance in self.stubs.items():
            if not process_alive(pid):
                return f"the backend process of {instance} (pid {pid}) died"
        return None

    def end(self) -> None:
        """Kill what is left of this server and remove its shared memory (idempotent)."""
        _kill_group(self.process.pid)
        self.process.wait()
        remove_shared_memory(self.shm_prefix)
        if self.guard is not None and self.guard.poll() is None:
            self.guard.stdin.close()  # the guard finds the server gone, and exits
            self.guard.wait()


def start_guard(run: ServerRun, http_url: str, exit_timeout: int, admin_key: str) -> subprocess.Popen:
    """A watchdog process (its own session) that stops this server and removes its shared memory if
    the launcher dies first, however it dies: it waits for its standard input, held by the launcher,
    to close."""
    argv = [str(run.process.pid), run.shm_prefix, http_url, str(exit_timeout)]
    guard = subprocess.Popen(
        [sys.executable, "-m", "dspark.serving.triton_launcher", GUARD_FLAG, *argv],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    guard.stdin.write(f"{admin_key}\n".encode())  # not on the command line, where ps shows it
    guard.stdin.flush()
    return guard


def guard_main(argv: list[str]) -> int:
    """The guard (see start_guard): once the launcher is gone, drain and stop its server, then clean up."""
    server_pid, shm_prefix, http_url, exit_timeout = int(argv[0]), argv[1], argv[2], float(argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    admin_key = sys.stdin.readline().strip()
    sys.stdin.read()  # returns when the launcher closes it or dies
    if process_alive(server_pid):
        drain(http_url, admin_key=admin_key)
        os.kill(server_pid, signal.SIGINT)
        deadline = time.monotonic() + exit_timeout + KILL_MARGIN_S
        while process_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(SUPERVISE_INTERVAL_S)
        _kill_group(server_pid)
    remove_shared_memory(shm_prefix)
    return 0


@dataclass
class Frontend:
    """The OpenAI frontend process, restarted whenever it dies (after a pause that doubles while it keeps
    dying, so that a port in use does not spin); it never takes the server down with it."""

    command: list[str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    pause: float = FRONTEND_BACKOFF_S[0]

    def start(self) -> None:
        """Start it in its own session (a terminal's Ctrl-C is the launcher's), its stdin a pipe we hold."""
        if self.process is not None:
            self.process.stdin.close()  # the dead one's pipe
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, start_new_session=True)
        self.started_at = time.monotonic()
        self.restart_at = None

    def check(self) -> None:
        """Restart the process if it has died and its pause is over."""
        if self.process is None or self.process.poll() is None:
            return
        now = time.monotonic()
        if self.restart_at is None:
            if now - self.started_at >= FRONTEND_STABLE_S:
                self.pause = FRONTEND_BACKOFF_S[0]
            self.restart_at = now + self.pause
            message = f"dspark serve: the OpenAI frontend exited with status {self.process.returncode}"
            print(f"{message}; restarting it in {self.pause:.0f}s", file=sys.stderr, flush=True)
            self.pause = min(2 * self.pause, FRONTEND_BACKOFF_S[1])
        elif now >= self.restart_at:
            self.start()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: no new requests; open ones get FRONTEND_STOP_S to end)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self) -> None:
        """Stop it and wait until it is gone (killed if it outstays FRONTEND_STOP_S)."""
        if self.process is None:
            return
        self.terminate()
        try:
            self.process.wait(FRONTEND_STOP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdin.close()


def start_server(server: Server, args: argparse.Namespace, admin_key: str, number: int) -> ServerRun:
    """Start tritonserver in its own process group, with its own shared-memory prefix."""
    shm_prefix = f"dspark_{os.getpid()}_{number}_"
    command = server_command(server, args, admin_key, shm_prefix)
    process = subprocess.Popen(command, env=server_environment(server), start_new_session=True)
    return ServerRun(process, shm_prefix)


def supervise(run: ServerRun, frontend: Frontend | None = None) -> str:
    """Block until the server or one of its backend processes dies; the cause. Meanwhile keep the
    frontend (if any) running."""
    while True:
        cause = run.fault()
        if cause is not None:
            return cause
        if frontend is not None:
            frontend.check()
        time.sleep(SUPERVISE_INTERVAL_S)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dspark serve",
        description="Serve the DSpark model repository with tritonserver (foreground; Ctrl-C stops it).",
    )
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY), help="%(default)s")
    parser.add_argument(
        "--address",
        default="127.0.0.1",
        help="address every endpoint binds to (0.0.0.0: every interface); default %(default)s",
    )
    parser.add_argument("--http-address", help="HTTP bind address (default: --address)")
    parser.add_argument("--grpc-address", help="gRPC bind address (default: --address)")
    parser.add_argument("--metrics-address", help="metrics bind address (default: --address)")
    parser.add_argument("--openai-address", help="OpenAI endpoint bind address (default: --address)")
    parser.add_argument("--http-port", type=int, default=8000, help="%(default)s")
    parser.add_argument("--grpc-port", type=int, default=8001, help="%(default)s")
    parser.add_argument("--metrics-port", type=int, default=8002, help="%(default)s")
    parser.add_argument(
        "--openai-port",
        type=int,
        default=9000,
        help="port of the OpenAI-compatible endpoint (/v1/chat/completions, ...); 0: off. %(default)s",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("DSPARK_ADMIN_KEY", ""),
        help=f"value of the {ADMIN_HEADER} header that opens Triton's {', '.join(RESTRICTED_APIS)} APIs "
        "(default: $DSPARK_ADMIN_KEY, else a random key per run: those APIs are closed)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help=f"restarts after a backend or server crash within {RESTART_WINDOW_S:.0f}s before giving up "
        "(exit status 1); 0: exit at the first crash. Default %(default)s",
    )
    parser.add_argument("--host", help="host polled for readiness and printed (default: from --address)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for readiness")
    parser.add_argument(
        "--exit-timeout", type=int, default=30, help="seconds in-flight requests get at shutdown"
    )
    parser.add_argument("extra", nargs="*", help="more tritonserver flags, after --")
    return parser.parse_args(argv)


def main_serve(argv: list[str] | None = None) -> int:
    """Start tritonserver, wait until ready, print the endpoints, serve (restarting it after a crash)
    until a signal; the exit status."""
    args = parse_args(argv)
    if not Path(args.model_repository).is_dir():
        print(f"dspark serve: no model repository at {args.model_repository}", file=sys.stderr)
        return 2
    server = find_server()
    admin_key = args.admin_key or secrets.token_urlsafe(24)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:  # a second Ctrl-C while stopping must not cut the shutdown short
            stopping = True
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http_url = f"http://{poll_host(args)}:{args.http_port}"
    restarts: list[float] = []
    run: ServerRun | None = None
    frontend = Frontend(frontend_command(args)) if args.openai_port else None
    try:
        if frontend is not None:
            frontend.start()  # it answers 503 until the server is ready
        for number in range(sys.maxsize):
            print(f"dspark serve: starting {server.binary}", flush=True)
            started = time.monotonic()
            run = start_server(server, args, admin_key, number)
            run.guard = start_guard(run, http_url, args.exit_timeout, admin_key)
            tick = frontend.check if frontend is not None else None
            if not wait_ready(run.process, f"{http_url}/v2/health/ready", args.startup_timeout, tick):
                print("dspark serve: tritonserver did not become ready", file=sys.stderr)
                return stop(run.process, exit_timeout=args.exit_timeout) or 1
            run.stubs = backend_stubs(run.process.pid)
            _print_ready(args, http_url, time.monotonic() - started)
            cause = supervise(run, frontend)
            now = time.monotonic()
            restarts = [at for at in restarts if now - at < RESTART_WINDOW_S] + [now]
            if len(restarts) > args.max_restarts:
                message = f"dspark serve: {cause}; giving up (--max-restarts {args.max_restarts})"
                print(message, file=sys.stderr)
                return 1
            print(f"dspark serve: {cause}; restarting tritonserver", file=sys.stderr, flush=True)
            run.end()
        return 1
    except KeyboardInterrupt:
        print("dspark serve: shutting down", flush=True)
        if frontend is not None:
            frontend.terminate()  # takes no new request; the drain below ends its open ones
        status = 0 if run is None else stop(run.process, http_url, args.exit_timeout, admin_key)
        return 0 if stopping else status
    finally:
        if run is not None:
            run.end()
        if frontend is not None:
            frontend.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_ready(args: argparse.Namespace, http_url: str, elapsed: float) -> None:
    host = poll_host(args)
    print(
        f"dspark serve: ready in {elapsed:.1f}s, model repository {args.model_repository}\n"
        f"  HTTP     {http_url}  (/v2/models/dspark/generate, generate_stream)\n"
        f"  gRPC     {host}:{args.grpc_port}\n"
        f"  metrics  http://{host}:{args.metrics_port}/metrics",
        flush=True,
    )
    if args.openai_port:
        openai_host = poll_host(args, args.openai_address or args.address)
        endpoints = "(/v1/chat/completions, /v1/completions, /v1/models)"
        print(f"  OpenAI   http://{openai_host}:{args.openai_port}/v1  {endpoints}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == [GUARD_FLAG]:
        raise SystemExit(guard_main(sys.argv[2:]))
    raise SystemExit(main_serve())
