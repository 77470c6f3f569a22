"""SPS tables: measured target steps per second as a function of the batch's token count.

The verify planner weighs expected committed tokens against the speed of a target forward
over ``B`` tokens; this module holds that speed curve.

JSON format (version 1)::

    {
      "version": 1,
      "model": "SmolLM2-135M-Instruct",
      "device": "NVIDIA H200",
      "dtype": "bfloat16",
      "points": [
        {"tokens": 1, "steps_per_second": 41.2},
        {"tokens": 64, "steps_per_second": 40.7},
        {"tokens": 512, "steps_per_second": 22.9}
      ]
    }

- ``version``: the integer 1.
- ``model``, ``device``, ``dtype``: strings describing where the table was measured (informational,
  may be empty).
- ``points``: a non-empty list; ``tokens`` is an integer >= 1, strictly increasing from point to point;
  ``steps_per_second`` is a finite number > 0.

No other keys are allowed, so a misspelt key is an error rather than silently ignored. Between points
SPS is interpolated linearly; below the first and above the last point it is clamped to that point's
value. A table whose points all share one SPS is *flat*, which the planner reads as "verify everything".
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dspark.kernels import reference

FORMAT_VERSION = 1
_TOP_KEYS = ("version", "model", "device", "dtype", "points")
_POINT_KEYS = ("tokens", "steps_per_second")


class SpsTableError(ValueError):
    """A malformed SPS table; the message starts with the offending field."""


class SpsPoint(NamedTuple):
    """One measurement: a target forward over ``tokens`` tokens runs ``steps_per_second`` times a second."""

    tokens: int
    steps_per_second: float


class SpsTable:
    """Measured target steps per second by batch token count, piecewise-linear between points."""

    def __init__(
        self,
        points: list[SpsPoint] | list[tuple[int, float]],
        model: str = "",
        device: str = "",
        dtype: str = "",
    ) -> None:
        """Validate and store ``points``: ``(tokens, steps_per_second)`` pairs, tokens strictly increasing."""
        self.points: tuple[SpsPoint, ...] = _validate_points(
            [{"tokens": t, "steps_per_second": s} for t, s in points]
        )
        for name, value in (("model", model), ("device", device), ("dtype", dtype)):
            if not isinstance(value, str):
                raise SpsTableError(f"{name}: must be a string, got {type(value).__name__}")
        self.model = model
        self.device = device
        self.dtype = dtype
        # Tensor copies for the vectorized lookup; float64 so the planner's objective is not
        # perturbed by the table's rounding.
        self._xs = torch.tensor([p.tokens for p in self.points], dtype=torch.float64)
        self._ys = torch.tensor([p.steps_per_second for p in self.points], dtype=torch.float64)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def flat(cls) -> SpsTable:
        """A table with constant SPS: the planner then verifies every admissible draft."""
        return cls([SpsPoint(1, 1.0)], model="flat")

    @classmethod
    def from_dict(cls, doc: Any) -> SpsTable:
        """Build from a parsed JSON document; raises SpsTableError naming the bad field."""
        if not isinstance(doc, dict):
            raise SpsTableError(f"<root>: must be a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(_TOP_KEYS))
        if unknown:
            raise SpsTableError(f"{unknown[0]}: unknown key (allowed: {', '.join(_TOP_KEYS)})")
        version = doc.get("version")
        # bool is an int subclass; `true` is not a version.
        if isinstance(version, bool) or version != FORMAT_VERSION:
            raise SpsTableError(f"version: must be {FORMAT_VERSION}, got {version!r}")
        if "points" not in doc:
            raise SpsTableError("points: missing")
        points = _validate_points(doc["points"])
        return cls(
            list(points),
            model=doc.get("model", ""),
            device=doc.get("device", ""),
            dtype=doc.get("dtype", ""),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON document for this table."""
        return {
            "version": FORMAT_VERSION,
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "points": [{"tokens": p.tokens, "steps_per_second": p.steps_per_second} for p in self.points],
        }

    @classmethod
    def load(cls, path: str | Path) -> SpsTable:
        """Read a table from a JSON file."""
        text = Path(path).read_text(encoding="utf-8")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpsTableError(f"<root>: not valid JSON ({path}): {exc}") from exc
        return cls.from_dict(doc)

    def save(self, path: str | Path) -> None:
        """Write the table as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @property
    def is_flat(self) -> bool:
        """True when every point has the same SPS (the planner then verifies everything)."""
        return all(p.steps_per_second == self.points[0].steps_per_second for p in self.points)

    def __call__(self, num_tokens: int) -> float:
        """SPS at ``num_tokens`` batch tokens: linear between points, clamped outside them."""
        pts = self.points
        if num_tokens <= pts[0].tokens:
            return pts[0].steps_per_second
        if num_tokens >= pts[-1].tokens:
            return pts[-1].steps_per_second
        i = bisect_right([p.tokens for p in pts], num_tokens)  # pts[i-1].tokens <= n < pts[i].tokens
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (float(num_tokens) - x0) / (x1 - x0)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The points as float64 (tokens, steps_per_second) tensors on `device`, as the planner op takes
        them (copied once per device)."""
        cached = self._on_device.get(device)
        if cached is None:
            cached = self._on_device[device] = (self._xs.to(device), self._ys.to(device))
        return cached

    def at(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """Vectorized ``__call__``: float64 SPS for an integer tensor of token counts (any shape)."""
        return reference.sps_at(num_tokens, *self.tensors(num_tokens.device))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SpsTable):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"SpsTable({len(self.points)} points, model={self.model!r}, device={self.device!r})"


def _validate_points(raw: Any) -> tuple[SpsPoint, ...]:
    """Check the ``points`` list and return it as SpsPoints; errors name e.g. ``points[2].tokens``."""
    if not isinstance(raw, list) or not raw:
        raise SpsTableError("points: must be a non-empty list")
    out: list[SpsPoint] = []
    for i, point in enumerate(raw):
        where = f"points[{i}]"
        if not isinstance(point, dict):
            raise SpsTableError(f"{where}: must be an object with keys {', '.join(_POINT_KEYS)}")
        for key in point:
            if key not in _POINT_KEYS:
                raise SpsTableError(f"{where}.{key}: unknown key (allowed: {', '.join(_POINT_KEYS)})")
        for key in _POINT_KEYS:
            if key not in point:
                raise SpsTableError(f"{where}.{key}: missing")
        tokens, sps = point["tokens"], point["steps_per_second"]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise SpsTableError(f"{where}.tokens: must be an integer >= 1, got {tokens!r}")
        if isinstance(sps, bool) or not isinstance(sps, int | float) or not math.isfinite(sps) or sps <= 0:
            raise SpsTableError(f"{where}.steps_per_second: must be a finite number > 0, got {sps!r}")
        if out and tokens <= out[-1].tokens:
            raise SpsTableError(
                f"{where}.tokens: must be greater than points[{i - 1}].tokens ({out[-1].tokens}), "
                f"got {tokens}"
            )
        out.append(SpsPoint(tokens, float(sps)))
    return tuple(out)
