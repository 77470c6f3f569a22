"""One engine process for all of a model's instances in a server.

Triton runs each instance of a Python model in a backend stub process of its own, and one stub's
interpreter lock bounds what it can take in and send out (on an H200 host, one stub capped the serving
path near 40k tokens/s and 1.7k responses/s at 256 streams; four stubs reached 66k and 8k). So a model
may have several instances (`instance_group { count: N }`) that share one engine, and with it one copy
of the weights and one KV cache: the first instance to start spawns the engine process, listening on a
Unix socket, and the others attach to it (`EngineProcess.attach`). A lock file orders them, so an
instance that starts while the first one still loads the model waits for it. Both files live in a
directory only this user can enter, named after the server's process and the model.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from dspark.config import EngineConfig
from dspark.engine.api import DeathCallback
from dspark.serving.engine_process import EngineProcess


def instance_count(model_config: dict) -> int:
    """How many instances Triton runs of a model, from its (JSON) model config's instance groups."""
    total = 0
    for group in model_config.get("instance_group") or [{}]:
        count = int(group.get("count", 1) or 1)
        gpus = group.get("gpus") or []
        total += count * max(len(gpus), 1) if group.get("kind") == "KIND_GPU" else count
    return max(total, 1)


def rendezvous(model_name: str, version: str, server_pid: int) -> Path:
    """Where a server's instances of a model meet: the socket path (the lock file sits beside it)."""
    directory = Path(tempfile.gettempdir()) / f"dspark-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.stat().st_uid != os.getuid() or directory.stat().st_mode & 0o077:
        raise PermissionError(f"{directory} must belong to this user alone (mode 700)")
    _sweep(directory)
    return directory / f"{server_pid}-{model_name}-{version}.sock"


def _sweep(directory: Path) -> None:
    """Remove what servers that are gone left here (a killed server's engine process could not)."""
    if not Path("/proc/self").exists():  # no way to tell a live server from a gone one
        return
    for entry in directory.iterdir():
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            entry.unlink(missing_ok=True)


def open_engine(
    config: EngineConfig, on_death: DeathCallback | None, socket_path: Path | None
) -> EngineProcess:
    """This instance's engine: its own when it is the only instance (no `socket_path`); else the one
    shared at `socket_path` (`rendezvous`), spawned by the first instance there (`EngineProcess.owner`),
    attached to by the others."""
    if socket_path is None:
        return EngineProcess(config, on_death=on_death)
    with open(socket_path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while the first instance builds the engine
        try:
            if socket_path.exists():
                try:
                    return EngineProcess.attach(str(socket_path), config, on_death=on_death)
                except (OSError, EOFError):  # left by an engine process that is gone
                    socket_path.unlink(missing_ok=True)
            return EngineProcess(config, on_death=on_death, listen=str(socket_path))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def forget(socket_path: Path) -> None:
    """After the spawning instance shut the shared engine down: remove the lock file beside its socket
    (the engine process removed the socket)."""
    socket_path.with_suffix(".lock").unlink(missing_ok=True)
