"""Log probabilities: the dspark model's vLLM-shaped `logprobs` output in OpenAI's two shapes.

The model (as Triton's vLLM backend) sends, per response, a JSON list with one object per new token:
`{"<token id>": {"logprob": float, "rank": int, "decoded_token": str}, ...}` holding the chosen token
and the top-N alternatives (rank 1 is the most likely). The chosen token is the response's output id
at the same position.
"""

from __future__ import annotations

from typing import Any

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI-compatible servers clamp to this (as vLLM's does)

Entries = list[dict[str, dict[str, Any]]]


def chat_content(entries: Entries, token_ids: list[int], top: int) -> list[dict[str, Any]]:
    """Chat `logprobs.content`: one item per token, each with its `top` most likely alternatives."""
    content = []
    for entry, token_id in zip(entries, token_ids, strict=True):
        chosen = _chosen(entry, token_id)
        content.append({**_chat_token(chosen), "top_logprobs": [_chat_token(e) for e in _top(entry, top)]})
    return content


def completion_logprobs(entries: Entries, token_ids: list[int], top: int, offset: int) -> dict[str, Any]:
    """Completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset from `offset` on)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry, token_id in zip(entries, token_ids, strict=True):
        chosen = _chosen(entry, token_id)
        tokens.append(chosen["decoded_token"])
        token_logprobs.append(_value(chosen))
        tops.append({e["decoded_token"]: _value(e) for e in _top(entry, top)})
        offsets.append(offset)
        offset += len(chosen["decoded_token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chosen(entry: dict[str, dict[str, Any]], token_id: int) -> dict[str, Any]:
    """The chosen token's entry (with its decoded text; `None` decodes as empty)."""
    chosen = entry.get(str(token_id))
    if chosen is None:
        raise ValueError(f"logprobs: no entry for the chosen token {token_id}")
    return {**chosen, "decoded_token": chosen.get("decoded_token") or ""}


def _top(entry: dict[str, dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """The `top` most likely entries, most likely first."""
    ranked = sorted(entry.values(), key=lambda e: e.get("rank") or 0)
    return [
        {**e, "decoded_token": e.get("decoded_token") or ""}
        for e in ranked
        if 0 < (e.get("rank") or 0) <= top
    ]


def _chat_token(entry: dict[str, Any]) -> dict[str, Any]:
    token = entry["decoded_token"]
    return {"token": token, "logprob": _value(entry), "bytes": list(token.encode("utf-8"))}


def _value(entry: dict[str, Any]) -> float:
    return max(float(entry["logprob"]), MIN_LOGPROB)
