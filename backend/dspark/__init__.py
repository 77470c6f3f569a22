"""dspark: DSpark speculative decoding engine (block drafting + confidence-scheduled verification)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dspark.config import EngineConfig
from dspark.outputs import CompletionOutput, RequestDelta, SpecStats
from dspark.sampling_params import InvalidParameterError, SamplingParams

if TYPE_CHECKING:
    from dspark.engine.async_engine import AsyncEngine
    from dspark.engine.llm_engine import LLMEngine
    from dspark.llm import LLM

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "InvalidParameterError",
    "LLMEngine",
    "RequestDelta",
    "SamplingParams",
    "SpecStats",
]


def __getattr__(name: str) -> Any:
    # The engine pulls in torch; keep `import dspark` light for the config/parameter users.
    if name == "LLM":
        from dspark.llm import LLM

        return LLM
    if name == "LLMEngine":
        from dspark.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncEngine":
        from dspark.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
