"""Spawning Python processes from wherever dspark runs, Triton's backend stub included (torch-free:
the stub imports it without loading the engine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def python_executable() -> str:
    """The interpreter spawned processes (the engine process, tensor-parallel ranks) run. Not blindly
    sys.executable: inside Triton's Python backend that may be the stub binary. This environment's own
    python (a virtual environment's, whose site-packages make `dspark` importable) comes first, then
    sys.executable, then the base install."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    names = (version, "python3", "python")
    candidates = [Path(sys.prefix) / "bin" / name for name in names]
    if Path(sys.executable).name.startswith("python"):
        candidates.append(Path(sys.executable))
    candidates += [Path(sys.base_prefix) / "bin" / name for name in names]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    looked = ", ".join(str(p) for p in candidates)
    raise RuntimeError(f"no Python interpreter to spawn the engine process or ranks with ({looked})")


@contextmanager
def spawning_with(context: mp.context.SpawnContext, executable: str) -> Iterator[None]:
    """Spawn with `executable`, and without the parent's `__main__`: spawn would otherwise re-run the
    user's script (or whatever hosts us: pytest, Triton's stub) in every child, which needs nothing
    from it. Both settings are process-wide, so they are restored afterwards."""
    from multiprocessing import spawn

    previous = spawn.get_executable()
    main = sys.modules["__main__"]
    context.set_executable(executable)
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main
        context.set_executable(previous)
