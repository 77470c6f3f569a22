"""The CPU linear paths a machine measured (`layers.measure_cpu_linear_paths`), kept in this process and in
a file beside the CPU kernel's build, so that the next process on the machine takes the same choice
without timing it again.

Why: the measurement is ~10 s of every CPU model load on a 2-core host (SmolLM2: 10.7 of 12 s), paid by
each engine process, tensor-parallel rank and server restart; and each path sums a row its own way, so
two processes that chose differently on a near-tie could decode different greedy tokens. With the file,
every process of a machine (a server after a restart, the ranks of a group) takes one choice.

An entry is keyed by what decides the choice: the machine (CPU model, logical CPUs), torch's threads and
version, the kernel's build (its vector width and sources) and the weights' shapes and dtype. Delete the
file to measure again (e.g. after measuring on a busy host: `dspark` logs where the choice came from).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from dspark.kernels.cpu import linear as cpu_linear

logger = logging.getLogger(__name__)

FILE_NAME = "dspark_cpu_linear_paths.json"


def default_file() -> Path | None:
    """The machine's file: in torch's extension root, where the CPU kernel is built and kept
    (`cpu_linear.extension_root`). None where torch's extension builder cannot be imported (no kernel is
    built there either), so the choice stays in the process."""
    try:
        return cpu_linear.extension_root() / FILE_NAME
    except ImportError:
        return None


def machine() -> str:
    """This machine's CPU model and logical CPU count (what a choice measured here holds for)."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            name = next(
                (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name
            )
    except OSError:
        pass
    return f"{name or platform.machine()} x{os.cpu_count()}"


class MeasuredPaths:
    """Measured choices by key: in memory, and in `file` when one is given (None: this process only; a
    callable: the file it returns, asked on first use, so that importing the layers asks nothing of the
    machine, e.g. on a GPU, where nothing is measured)."""

    def __init__(self, file: Path | Callable[[], Path | None] | None = None) -> None:
        self._file = file
        self._memory: dict[str, dict] = {}

    @property
    def file(self) -> Path | None:
        """The file the choices are kept in (None: none)."""
        if callable(self._file):
            self._file = self._file()
        return self._file

    def key(self, shapes: tuple, kernel: str | None) -> str:
        """The key of a choice for weights of these (shape, dtype) pairs with this kernel build (None:
        the kernel not measured): a digest of everything the choice depends on."""
        described = {
            "machine": machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "kernel": kernel,
            "weights": [[list(shape), str(dtype)] for shape, dtype in shapes],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]

    def get(self, key: str) -> dict | None:
        """The choice stored under `key` (this process's, else the file's), or None."""
        if key in self._memory:
            return self._memory[key]
        stored = self._read().get(key)
        if isinstance(stored, dict):
            self._memory[key] = stored
            logger.info("CPU linear paths as measured on this machine before (%s)", self.file)
            return stored
        return None

    def put(self, key: str, choice: dict) -> None:
        """Keep `choice` under `key` here and, where there is a file, in it (written whole under a
        temporary name, then renamed: ranks loading at once never read half a file). A file that
        cannot be written is logged, never raised: the process keeps its own choice."""
        self._memory[key] = choice
        if self.file is None:
            return
        entries = self._read()
        entries[key] = choice
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w",
                dir=self.file.parent,
                prefix=self.file.name,
                suffix=".tmp",
                delete=False,
                encoding="utf-8",
            ) as out:
                json.dump(entries, out, indent=1, sort_keys=True)
            os.chmod(out.name, 0o644)  # a temporary file's 0600 would keep other users' processes out
            os.replace(out.name, self.file)
        except OSError as exc:
            logger.warning("CPU linear paths not kept in %s: %s", self.file, exc)

    def _read(self) -> dict:
        """The file's entries ({} without a file, or one that is missing or unreadable)."""
        if self.file is None:
            return {}
        try:
            entries = json.loads(self.file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}
