"""Per-request generation parameters and their validation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any


class InvalidParameterError(ValueError):
    """A request parameter is missing, of the wrong type or out of range; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class SamplingParams:
    """How one request is decoded.

    `temperature == 0` means greedy. `num_draft_tokens` caps this request's verify window
    (None: the engine's block size; 0: speculation off for this request).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax."""
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidParameterError naming the first bad field."""
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidParameterError("temperature", f"must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameterError("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidParameterError("stop_token_ids", "must be a list of token ids")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if self.num_draft_tokens is not None:
            _check_int("num_draft_tokens", self.num_draft_tokens, minimum=0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys are an error naming the key."""
        if not isinstance(values, dict):
            raise InvalidParameterError("sampling_parameters", "must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise InvalidParameterError(
                    key, f"unknown sampling parameter (known: {', '.join(sorted(known))})"
                )
        clean = {k: v for k, v in values.items() if v is not None}
        for name in ("temperature", "top_p"):
            if name in clean and isinstance(clean[name], int) and not isinstance(clean[name], bool):
                clean[name] = float(clean[name])
        return cls(**clean)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        """Parse the `sampling_parameters` JSON string of the Triton interface."""
        try:
            values = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidParameterError("sampling_parameters", f"invalid JSON: {exc}") from exc
        return cls.from_dict(values)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidParameterError(name, f"must be >= {minimum}, got {value}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, f"must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidParameterError(name, f"must be finite, got {value!r}")
