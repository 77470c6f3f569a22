"""Per-request generation parameters and their validation.

Every bound a request is held to is a constant here, so that the README, the validation and the tests
read the same numbers.

Parameters are read as Triton's vLLM backend reads them (from the `sampling_parameters` JSON, request
parameters or the HTTP generate endpoint's top-level keys alike): a string given for a number or
boolean parameter is converted to the type the field is annotated with (`"max_tokens": "32"`,
`"temperature": "0"`, `"ignore_eos": "true"`); `max_tokens` defaults to vLLM's 16; vLLM parameters
this engine lacks (`n`, `best_of`, `use_beam_search`, structured output) are accepted only at the
value that asks for nothing and otherwise refused naming the parameter, like any unknown key.
"""

from __future__ import annotations

import json
import re
import types
import typing
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any

MAX_INT = 2**31 - 1  # max_tokens, top_k, num_draft_tokens and token ids fit an int32
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes [0, 2**64 - 1] (and negatives, wrapped)
GREEDY_BELOW_TEMPERATURE = 1e-5  # a temperature below this decodes greedily (as vLLM's _SAMPLING_EPS)
MAX_TEMPERATURE = 100.0  # far past uniform; fp32 logits / temperature stay finite
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256  # the stop matcher holds back up to this many characters of text
MAX_STOP_TOKEN_IDS = 256
MAX_JSON_BYTES = 64 * 1024  # sampling_parameters (and request parameters) JSON text, UTF-8
MAX_JSON_DEPTH = 8  # nesting of that JSON: the object itself is depth 1, `{"stop": ["a"]}` depth 2
_MAX_INT_DIGITS = 40  # JSON integers longer than this are not converted (Python's own limit is 4300)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (vLLM's range)
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty lies in (0, MAX_REPETITION_PENALTY] (vLLM's range)
MAX_LOGPROBS = 20  # most top tokens `logprobs` may ask for a token (vLLM's default max_logprobs)
DEFAULT_MAX_TOKENS = 16  # vLLM's default, which clients of Triton's vLLM backend rely on
_INTEGER_TEXT = re.compile(r"\s*[+-]?\d+\s*")
_ONE_COMPLETION = "only 1 is supported (one completion per request)"
_NO_STRUCTURED_OUTPUT = "structured (guided) output is not supported"
# vLLM sampling parameters this engine does not implement: the value that asks for nothing (accepted and
# ignored; null is too) and why any other value is refused.
UNSUPPORTED_PARAMETERS: dict[str, tuple[Any, str]] = {
    "n": (1, _ONE_COMPLETION),
    "best_of": (1, _ONE_COMPLETION),
    "use_beam_search": (False, "beam search is not supported"),
    "structured_outputs": (None, _NO_STRUCTURED_OUTPUT),
    "guided_decoding": (None, _NO_STRUCTURED_OUTPUT),
    "guided_json": (None, _NO_STRUCTURED_OUTPUT),
    "guided_regex": (None, _NO_STRUCTURED_OUTPUT),
    "guided_choice": (None, _NO_STRUCTURED_OUTPUT),
    "guided_grammar": (None, _NO_STRUCTURED_OUTPUT),
    "guided_decoding_backend": (None, _NO_STRUCTURED_OUTPUT),
    "guided_whitespace_pattern": (None, _NO_STRUCTURED_OUTPUT),
}


class InvalidParameterError(ValueError):
    """A request parameter is missing, of the wrong type or out of range; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class HugeInteger:
    """A JSON integer too long to convert: validation rejects it as out of range."""

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"a {len(self.digits.lstrip('-'))}-digit integer"


@dataclass
class SamplingParams:
    """How one request is decoded.

    `temperature` below GREEDY_BELOW_TEMPERATURE (0 included) means greedy. `top_p` keeps at least
    the most likely token. `num_draft_tokens` caps how many drafts this request verifies per step, a
    per-request limit on its verify window and not the draft block size, which the engine's
    `block_size` alone sets (None: up to the block size; 0: speculation off for this request).
    `skip_special_tokens` leaves special tokens (EOS, chat markers) out of the text, as vLLM does by
    default; the token ids keep them.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    num_draft_tokens: int | None = None
    skip_special_tokens: bool = True
    # vLLM's penalties and min_tokens, applied to the target's logits wherever they are judged (each
    # verify position sees the drafts before it as history), and `logprobs`: the top-N tokens' log
    # probabilities (0: the chosen token's only; None: none) under the target's raw distribution.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """True when presence, frequency or repetition penalties change this request's logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        """Raise InvalidParameterError naming the first bad field."""
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT)
        _check_number("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidParameterError(
                "temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, 0, MAX_INT)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        self._validate_stop()
        if not isinstance(self.stop_token_ids, list):
            raise InvalidParameterError("stop_token_ids", "must be a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameterError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, MAX_INT)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if self.num_draft_tokens is not None:
            _check_int("num_draft_tokens", self.num_draft_tokens, 0, MAX_INT)
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidParameterError(
                "skip_special_tokens", f"must be a boolean, got {self.skip_special_tokens!r}"
            )
        self._validate_penalties_and_logprobs()

    def _validate_penalties_and_logprobs(self) -> None:
        """The penalties, `min_tokens` and `logprobs` within vLLM's ranges."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                bounds = f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
                raise InvalidParameterError(name, f"must be in {bounds}, got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidParameterError(
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
            )
        _check_int("min_tokens", self.min_tokens, 0, MAX_INT)
        if isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    def _validate_stop(self) -> None:
        """`stop`: a list of at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_STRING_CHARS."""
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameterError("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidParameterError(
                "stop", f"each string at most {MAX_STOP_STRING_CHARS} characters, got {longest}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict, as Triton's vLLM backend reads one (see the module's notes)."""
        if not isinstance(values, dict):
            raise InvalidParameterError("sampling_parameters", "must be a JSON object")
        kinds = _scalar_kinds(cls)
        clean: dict[str, Any] = {}
        for key, value in values.items():
            if key in UNSUPPORTED_PARAMETERS:
                _check_unsupported(key, value)
            elif key not in kinds:
                raise InvalidParameterError(
                    key, f"unknown sampling parameter (known: {', '.join(sorted(kinds))})"
                )
            elif value is not None:
                clean[key] = _as_kind(key, value, kinds[key])
        return cls(**clean)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        """Parse the `sampling_parameters` JSON string of the Triton interface."""
        return cls.from_dict(parse_json_object(text, "sampling_parameters"))


def parse_json_object(text: str, field_name: str) -> dict[str, Any]:
    """A request's JSON object text as a dict ({} when blank), held to MAX_JSON_BYTES and
    MAX_JSON_DEPTH; any fault is an InvalidParameterError naming `field_name`."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_JSON_BYTES:
        raise InvalidParameterError(field_name, f"JSON of {size} bytes, at most {MAX_JSON_BYTES}")
    if not text.strip():
        return {}
    try:
        values = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise InvalidParameterError(field_name, f"JSON nested deeper than {MAX_JSON_DEPTH}") from None
    except ValueError as exc:  # json.JSONDecodeError, or a number Python will not convert
        raise InvalidParameterError(field_name, f"invalid JSON: {exc}") from None
    if _depth(values) > MAX_JSON_DEPTH:
        raise InvalidParameterError(field_name, f"JSON nested deeper than {MAX_JSON_DEPTH}")
    if not isinstance(values, dict):
        raise InvalidParameterError(field_name, "must be a JSON object")
    return values


def _parse_int(digits: str) -> int | HugeInteger:
    return int(digits) if len(digits) <= _MAX_INT_DIGITS else HugeInteger(digits)


@cache
def _scalar_kinds(cls: type) -> dict[str, type | None]:
    """Each field of `cls` with the one scalar type it takes (bool, int or float; None allowed beside
    it), or None when it takes something else (a list, a string, a union of several)."""
    hints = typing.get_type_hints(cls)
    kinds: dict[str, type | None] = {}
    for f in fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
        kinds[f.name] = options[0] if len(options) == 1 and options[0] in (bool, int, float) else None
    return kinds


def _as_kind(name: str, value: Any, kind: type | None) -> Any:
    """`value` for a parameter of this scalar kind: a string converted (as Triton's vLLM backend does:
    genai-perf and the backend's own clients send `"max_tokens": "32"`), an integer for a float field
    made a float; anything else as it is, for validation to judge."""
    if isinstance(value, str) and kind is not None:
        return _from_string(name, value, kind)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _from_string(name: str, text: str, kind: type) -> bool | int | float | HugeInteger:
    """A number or boolean given as a string. Unlike the vLLM backend's `bool(text)`, "false" is false:
    only "true" and "false" (any case) are booleans."""
    if kind is bool:
        word = text.strip().lower()
        if word not in ("true", "false"):
            raise InvalidParameterError(name, f"must be a boolean (true or false), got {text!r}")
        return word == "true"
    if kind is int:
        if not _INTEGER_TEXT.fullmatch(text):
            raise InvalidParameterError(name, f"must be an integer, got {text!r}")
        return _parse_int(text.strip().lstrip("+"))
    try:
        return float(text)
    except ValueError:
        raise InvalidParameterError(name, f"must be a number, got {text!r}") from None


def _check_unsupported(name: str, value: Any) -> None:
    """Accept a parameter this engine lacks only at the value that asks for nothing (or null)."""
    accepted, reason = UNSUPPORTED_PARAMETERS[name]
    if value is None:
        return
    if isinstance(value, str) and accepted is not None:
        value = _from_string(name, value, type(accepted))
    if accepted is None:
        raise InvalidParameterError(name, reason)
    if type(value) is not type(accepted) or value != accepted:
        raise InvalidParameterError(name, f"{reason}, got {value!r}")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar 0, `{}` 1, `{"a": [1]}` 2), counted up to MAX_JSON_DEPTH + 1."""
    depth, level = 0, [value]
    while depth <= MAX_JSON_DEPTH:
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]
    return depth


def _check_int(name: str, value: Any, minimum: int, maximum: int) -> None:
    if isinstance(value, HugeInteger):
        raise InvalidParameterError(name, f"must be <= {maximum}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidParameterError(name, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise InvalidParameterError(name, f"must be <= {maximum}, got {value}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, f"must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidParameterError(name, f"must be finite, got {value!r}")
