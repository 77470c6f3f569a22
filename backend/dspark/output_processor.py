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
        # Token ids that end the request, and the sequence length at which it ends for length.
        eos = set() if seq.params.ignore_eos else set(eos_token_ids)
        self.stop_ids = eos | set(seq.params.stop_token_ids)
        self.length_limit = min(seq.num_prompt_tokens + seq.params.max_tokens, max_model_len)

    def commit(self, new_token_ids: list[int]) -> tuple[list[int], str, str | None]:
        """Append tokens to the sequence until one finishes it.

        Returns (tokens actually appended, new text, finish reason or None).
        """
        if self.stops is not None:
            return self._commit_matching_stops(new_token_ids)
        # Without stop strings no text decides the finish, so the tokens up to the finishing one are
        # turned into text in one detokenizer call (a speculative step commits several at once).
        token_ids = self.seq.token_ids
        appended = new_token_ids
        reason: str | None = None
        for i, token in enumerate(new_token_ids):
            token_ids.append(token)
            reason = self._finish_reason(token)
            if reason is not None:
                appended = new_token_ids[: i + 1]
                break
        text = self.detokenizer.push(appended)
        if reason is not None:
            text += self._flush()
        return appended, text, reason

    def _commit_matching_stops(self, new_token_ids: list[int]) -> tuple[list[int], str, str | None]:
        """`commit` for a request with stop strings: token by token, each one's text fed to the matcher
        (a stop string ends the request at the token that completes it)."""
        assert self.stops is not None
        seq = self.seq
        appended: list[int] = []
        text: list[str] = []
        for token in new_token_ids:
            seq.token_ids.append(token)
            appended.append(token)
            piece, stopped = self.stops.feed(self.detokenizer.push([token]))
            text.append(piece)
            if stopped:
                return appended, "".join(text), "stop"
            reason = self._finish_reason(token)
            if reason is not None:
                text.append(self._flush())
                return appended, "".join(text), reason
        return appended, "".join(text), None

    def _finish_reason(self, token: int) -> str | None:
        """Why the request ends at `token`, just appended (None: it goes on)."""
        if token in self.stop_ids:
            return "stop"
        if len(self.seq.token_ids) >= self.length_limit:
            return "length"
        return None

    def _flush(self) -> str:
        tail = self.detokenizer.flush()
        if self.stops is None:
            return tail
        piece, stopped = self.stops.feed(tail)
        return piece if stopped else piece + self.stops.flush()
