"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) read into one GenerationRequest.

Only what the frontend itself interprets is checked here (types of `stream`, `n`, `messages`, the
logprobs switches, parameters this server does not implement). Sampling values go to the dspark
model as they came, and its validation, which names the field, is the one that holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark.sampling_params import MAX_INT
from dspark.serving.openai_frontend.errors import invalid

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat `top_logprobs`
# vLLM-style extras an OpenAI client may send (extra_body); the dspark model takes them by these names.
PASSTHROUGH = (
    "top_k",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "repetition_penalty",
    "num_draft_tokens",
)
PENALTIES = ("presence_penalty", "frequency_penalty")  # passed on unless 0, OpenAI's neutral value
# Parameters with no implementation here: any value but the ones that ask for nothing is a 400.
UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix (insertion) is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}
NOTHING = (None, [], {}, "", "none", "auto")


@dataclass
class GenerationRequest:
    """One OpenAI request as the dspark model will be asked it."""

    chat: bool
    model: str
    prompt: str | list[int] | list[dict[str, str]]  # completion text or token ids; chat messages
    sampling: dict[str, Any]  # the dspark model's sampling_parameters
    param_names: dict[str, str] = field(default_factory=dict)  # model field -> the client's parameter
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token (0: the chosen token's only); None: none
    echo: bool = False

    @property
    def prompt_param(self) -> str:
        """The client's parameter that holds the prompt."""
        return "messages" if self.chat else "prompt"


def parse_chat(body: Any) -> GenerationRequest:
    """A `/v1/chat/completions` body."""
    body = _object(body)
    request = _common(body, chat=True, prompt=_messages(body.get("messages")))
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    _max_tokens(request, body, limit, MAX_INT)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid("top_logprobs", "requires logprobs to be true")
    request.logprobs = (top or 0) if logprobs else None
    response_format = body.get("response_format")
    if response_format not in (None, {}) and response_format != {"type": "text"}:
        raise invalid("response_format", "only {'type': 'text'} is supported")
    if body.get("tool_choice") not in NOTHING:
        raise invalid("tool_choice", "tool calling is not supported")
    if body.get("modalities") not in (None, ["text"]):
        raise invalid("modalities", "only ['text'] is supported")
    return request


def parse_completion(body: Any) -> GenerationRequest:
    """A `/v1/completions` body."""
    body = _object(body)
    request = _common(body, chat=False, prompt=_prompt(body.get("prompt")))
    _max_tokens(request, body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    request.logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    request.echo = bool(_bool(body, "echo"))
    if request.echo and request.logprobs is not None:
        raise invalid(
            "echo", "echo with logprobs needs the prompt's log probabilities, which are not available"
        )
    best_of = _int(body, "best_of", 1, MAX_INT)
    if best_of not in (None, 1):
        raise invalid("best_of", "only 1 is supported (one completion per request)")
    return request


def _common(body: dict[str, Any], chat: bool, prompt: str | list) -> GenerationRequest:
    """What both endpoints share: model, stream options, n, sampling values, refused parameters."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the name of a model from /v1/models")
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    if options and not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    include_usage = bool(_bool(options or {}, "include_usage", "stream_options.include_usage"))
    n = _int(body, "n", 1, MAX_INT)
    if n not in (None, 1):
        raise invalid("n", "only 1 is supported (one completion per request)")
    for name, reason in UNSUPPORTED.items():
        if body.get(name) not in NOTHING:
            raise invalid(name, reason)
    sampling: dict[str, Any] = {
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
    }
    for name in ("seed", "stop", *PASSTHROUGH):
        if body.get(name) is not None:
            sampling[name] = body[name]
    for name in PENALTIES:
        if body.get(name) not in (None, 0):
            sampling[name] = body[name]
    return GenerationRequest(chat, model, prompt, sampling, stream=stream, include_usage=include_usage)


def _max_tokens(request: GenerationRequest, body: dict[str, Any], name: str, default: int) -> None:
    """The output limit, from the client's parameter `name` (default when absent)."""
    value = body.get(name)
    request.sampling["max_tokens"] = default if value is None else value
    request.param_names["max_tokens"] = name


def _messages(value: Any) -> list[dict[str, str]]:
    """Chat messages with their content as plain text (text parts of a content list joined)."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{index}]", "must be an object with a string 'role'")
        messages.append({"role": message["role"], "content": _content(message.get("content"), index)})
    return messages


def _content(content: Any, index: int) -> str:
    """One message's content as text: a string, null, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"messages[{index}].content", "only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{index}].content", "must be a string or a list of text parts")


def _prompt(value: Any) -> str | list[int]:
    """A completion prompt: text or token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        return value
    raise invalid("prompt", "must be a string or a list of token ids (one prompt per request)")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    return body


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(param or name, f"must be a boolean, got {value!r}")
    return value


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise invalid(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return value
