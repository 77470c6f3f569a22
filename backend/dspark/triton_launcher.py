"""`dspark serve`: run tritonserver on the model repository, in the foreground, until Ctrl-C / SIGTERM.

The server is the system `tritonserver` when one is on PATH (the Triton container), else the one in
the nvidia-pytriton wheel. For the wheel's server a backend directory is prepared once under
`.cache/tritonserver/` holding its Python backend and the stub built for the running Python. The
Python backend's stub embeds libpython and, with no program name set, finds its interpreter as
`python3` on PATH: putting this interpreter's bin/ first on PATH (and its base libpython on
LD_LIBRARY_PATH) makes model.py run inside this virtual environment, so `import dspark, torch` works.
tritonserver runs in its own process group; shutdown signals the server, then clears the group, so
no stub process outlives it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.config import REPO_ROOT
from dspark.triton_config import DEFAULT_MODEL_REPOSITORY

BACKEND_CACHE = REPO_ROOT / ".cache" / "tritonserver"
KILL_MARGIN_S = 5.0  # after tritonserver's own exit timeout, before its process group is killed
DRAIN_TIMEOUT_S = 30.0
CANCEL_ALL = "*"  # the dspark model's cancel_request_id for every request in flight
PR_SET_PDEATHSIG = 1


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
    try:
        import pytriton
    except ImportError:
        raise SystemExit(
            "no tritonserver on PATH and nvidia-pytriton is not installed (pip install -e '.[serve]')"
        ) from None
    root = Path(pytriton.__file__).resolve().parent
    dist = root / "tritonserver"
    return Server(
        dist / "bin" / "tritonserver", _wheel_backends(dist), [root.parent / "nvidia_pytriton.libs"]
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


def server_command(server: Server, args: argparse.Namespace) -> list[str]:
    """The tritonserver command line."""
    command = [
        str(server.binary),
        f"--model-repository={Path(args.model_repository).resolve()}",
        f"--http-port={args.http_port}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-port={args.metrics_port}",
        "--exit-on-error=true",
        f"--exit-timeout-secs={args.exit_timeout}",
    ]
    if server.backend_dir is not None:
        command.append(f"--backend-directory={server.backend_dir}")
    return command + list(args.extra)


def wait_ready(process: subprocess.Popen, url: str, timeout: float) -> bool:
    """Poll Triton's readiness endpoint until it answers 200, the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    return False


def drain(http_url: str, timeout: float = DRAIN_TIMEOUT_S) -> None:
    """Cancel every request in flight on each decoupled model that takes `cancel_request_id`.

    Needed before tritonserver stops: it finalizes a model only after every request holding it has
    sent its last response, and once shutdown has begun, responses to streaming clients stall. The
    cancel answers after the cancelled requests' final responses (finish_reason "abort").
    """
    try:
        models = _http_json(f"{http_url}/v2/repository/index", {}, timeout=5)
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


def _http_json(url: str, body: dict | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def stop(process: subprocess.Popen, http_url: str | None = None, exit_timeout: float = 30.0) -> int:
    """Drain the models, ask tritonserver to shut down (models unload, finalize runs), then clear its
    process group so no stub outlives it.

    tritonserver gives in-flight work `exit_timeout` seconds; past that it can hang on its way out
    (a client's gRPC stream left open holds the model), so the group is killed a little later.
    """
    if process.poll() is None and http_url is not None:
        drain(http_url)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(exit_timeout + KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            print("dspark serve: tritonserver did not exit in time; killing it", file=sys.stderr, flush=True)
    _kill_group(process.pid)
    return process.wait()


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies without cleaning up (Linux prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dspark serve",
        description="Serve the DSpark model repository with tritonserver (foreground; Ctrl-C stops it).",
    )
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY), help="%(default)s")
    parser.add_argument("--http-port", type=int, default=8000, help="%(default)s")
    parser.add_argument("--grpc-port", type=int, default=8001, help="%(default)s")
    parser.add_argument("--metrics-port", type=int, default=8002, help="%(default)s")
    parser.add_argument("--host", default="localhost", help="host name printed and polled for readiness")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for readiness")
    parser.add_argument(
        "--exit-timeout", type=int, default=30, help="seconds in-flight requests get at shutdown"
    )
    parser.add_argument("extra", nargs="*", help="more tritonserver flags, after --")
    return parser.parse_args(argv)


def main_serve(argv: list[str] | None = None) -> int:
    """Start tritonserver, wait until ready, print the endpoints, serve until a signal; exit status."""
    args = parse_args(argv)
    if not Path(args.model_repository).is_dir():
        print(f"dspark serve: no model repository at {args.model_repository}", file=sys.stderr)
        return 2
    server = find_server()
    command = server_command(server, args)
    print(f"dspark serve: starting {server.binary}", flush=True)
    process = subprocess.Popen(
        command, env=server_environment(server), start_new_session=True, preexec_fn=_die_with_parent
    )
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:  # a second Ctrl-C while stopping must not cut the shutdown short
            stopping = True
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http_url = f"http://{args.host}:{args.http_port}"
    try:
        started = time.monotonic()
        if not wait_ready(process, f"{http_url}/v2/health/ready", args.startup_timeout):
            print("dspark serve: tritonserver did not become ready", file=sys.stderr)
            return stop(process, exit_timeout=args.exit_timeout) or 1
        elapsed = time.monotonic() - started
        print(
            f"dspark serve: ready in {elapsed:.1f}s, model repository {args.model_repository}\n"
            f"  HTTP     {http_url}  (/v2/models/dspark/generate, generate_stream)\n"
            f"  gRPC     {args.host}:{args.grpc_port}\n"
            f"  metrics  http://{args.host}:{args.metrics_port}/metrics",
            flush=True,
        )
        status = process.wait()
        _kill_group(process.pid)
        return status
    except KeyboardInterrupt:
        print("dspark serve: shutting down", flush=True)
        status = stop(process, http_url, args.exit_timeout)
        return 0 if stopping else status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main_serve())
