"""What a client of the engine holds without loading it: the callbacks it hands over and the error a
dead engine raises (torch-free: Triton's backend stub imports these and runs the engine in another
process, `dspark.serving.engine_process`)."""

from __future__ import annotations

from collections.abc import Callable

from dspark.outputs import RequestDelta

DeltaCallback = Callable[[RequestDelta], None]
DeathCallback = Callable[[BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; no request can be served."""
