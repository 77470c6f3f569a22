"""Loading the Triton-language kernel modules, compiled for CUDA or run by Triton's CPU interpreter.

Triton fixes interpreted-vs-compiled per process: `@triton.jit` reads TRITON_INTERPRET when a function
is decorated, which for Triton's own library (tl.sum, tl.max, tl.cdiv, ...) happens at `import
triton`, and Triton later imports parts of itself lazily that check the same variable again. So the
mode is chosen before Triton is first imported and kept for the life of the process; only this
module imports the kernel modules, and the engine's CPU path never calls it (ops.py sends CPU tensors
to the torch references), which keeps Triton an optional dependency on CPU.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import SimpleNamespace

KERNEL_MODULES = (
    "common",
    "attention",
    "norm",
    "activation",
    "rotary_store",
    "accept",
    "planner",
    "sampling",
    "layout",
    "markov",
    "gemv",
)

_lock = threading.Lock()
_loaded: tuple[bool, SimpleNamespace] | None = None


def load_kernels(interpret: bool | None = None) -> SimpleNamespace:
    """The kernel modules as attributes (`.attention`, `.norm`, ...), imported on the first call.

    interpret: True runs the kernels in Triton's interpreter (CPU tensors: tests, --tiny benchmarks)
    and sets TRITON_INTERPRET=1 for the rest of the process; False compiles them for the GPU; None
    follows TRITON_INTERPRET. The first call fixes the mode: asking for the other one later, or
    asking for one that an earlier `import triton` already ruled out, raises RuntimeError.
    """
    global _loaded
    loaded = _loaded
    if loaded is not None and interpret in (None, loaded[0]):
        return loaded[1]  # the per-op fast path: no lock once loaded
    with _lock:
        if _loaded is None:
            _loaded = _import_all(interpret)
        mode, modules = _loaded
        if interpret is not None and interpret != mode:
            raise RuntimeError(f"kernels were already loaded {_mode_name(mode)} in this process")
        return modules


def _mode_name(interpret: bool) -> str:
    return "interpreted" if interpret else "compiled"


def _import_all(interpret: bool | None) -> tuple[bool, SimpleNamespace]:
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if "triton" in sys.modules:
        from triton.language import standard

        triton_mode = type(standard.cdiv).__name__ == "InterpretedFunction"
        if triton_mode != interpret:
            raise RuntimeError(
                f"triton was imported {_mode_name(triton_mode)} before the kernels were asked for "
                f"{_mode_name(interpret)}: set TRITON_INTERPRET before anything imports triton"
            )
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    stale = [m for m in KERNEL_MODULES if f"dspark.kernels.{m}" in sys.modules]
    if stale:
        raise RuntimeError(f"kernel modules imported outside load_kernels(): {stale}")
    modules = {m: importlib.import_module(f"dspark.kernels.{m}") for m in KERNEL_MODULES}
    return interpret, SimpleNamespace(**modules)
