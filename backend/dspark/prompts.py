"""A request's prompt, checked: the token ids it becomes, or an InvalidParameterError naming the field.

One function for the engine (`LLMEngine.prepare_prompt`) and for the Triton adapter's process
(`EngineProcess.submit`), which checks and tokenizes a request itself so that a submission needs no
round trip to the engine process.
"""

from __future__ import annotations

from dspark.sampling_params import InvalidParameterError, SamplingParams
from dspark.tokenizer import Tokenizer


def check_prompt(
    prompt: str | None,
    token_ids: list[int] | None,
    params: SamplingParams,
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
) -> list[int]:
    """Validate a request's prompt and parameters; its prompt's token ids."""
    params.validate()
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if token_ids is not None:
        field = "prompt_token_ids"
        ids = list(token_ids)
        check_token_ids(field, ids, vocab_size)
    else:
        field = "prompt"
        if not isinstance(prompt, str):
            raise InvalidParameterError(field, "must be a string")
        ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        raise InvalidParameterError(field, "must not be empty")
    if len(ids) >= max_model_len:
        raise InvalidParameterError(
            field, f"{len(ids)} tokens leave no room in the context of {max_model_len}"
        )
    return ids


def check_token_ids(field: str, ids: list[int], vocab: int) -> None:
    """Raise InvalidParameterError naming `field` unless every id is an int in [0, vocab)."""
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise InvalidParameterError(field, f"token ids must be integers in [0, {vocab}), got {token_id}")
