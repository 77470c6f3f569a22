"""OutputProcessor: per-request finish checks and incremental, stop-aware text."""

from __future__ import annotations

from dspark.sequence import Sequence
from dspark.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class OutputProcessor:
    """Takes one request's committed tokens one at a time, decides when it finishes (EOS, stop
    token ids, stop strings, max_tokens, context length) and yields only new, safe text.
    """

    def __init__(
        self, seq: Sequence, tokenizer: Tokenizer, eos_token_ids: list[int], max_model_len: int
    ) -> None:
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
        self.stops = StopStringMatcher(seq.params.stop) if seq.params.stop else None
        self.eos = set() if seq.params.ignore_eos else set(eos_token_ids)
        self.stop_ids = set(seq.params.stop_token_ids)
        self.max_model_len = max_model_len

    def commit(self, new_token_ids: list[int]) -> tuple[list[int], str, str | None]:
        """Append tokens to the sequence until one finishes it.

        Returns (tokens actually appended, new text, finish reason or None).
        """
        seq = self.seq
        appended: list[int] = []
        text: list[str] = []
        reason: str | None = None
        for token in new_token_ids:
            seq.token_ids.append(token)
            appended.append(token)
            piece = self.detokenizer.push([token])
            if self.stops is not None:
                piece, stopped = self.stops.feed(piece)
                text.append(piece)
                if stopped:
                    return appended, "".join(text), "stop"
            else:
                text.append(piece)
            if token in self.eos or token in self.stop_ids:
                reason = "stop"
            elif seq.num_output_tokens >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason:
                text.append(self._flush())
                return appended, "".join(text), reason
        return appended, "".join(text), None

    def _flush(self) -> str:
        tail = self.detokenizer.flush()
        if self.stops is None:
            return tail
        piece, stopped = self.stops.feed(tail)
        return piece if stopped else piece + self.stops.flush()
