"""OutputProcessor: per-request finish checks and incremental, stop-aware text."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

from dspark.outputs import LogprobsLog, LogprobsPrefix, RequestDelta, TokenLogprobs
from dspark.sequence import Sequence
from dspark.tokenizer import DeltaText, IncrementalDetokenizer, StopStringMatcher, Tokenizer


class OutputProcessor:
    """Takes one request's committed tokens one at a time, decides when it finishes (EOS, stop
    token ids, stop strings, max_tokens, context length) and yields only new, safe text.
    """

    def __init__(
        self, seq: Sequence, tokenizer: Tokenizer, eos_token_ids: list[int], max_model_len: int
    ) -> None:
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
        )
        self.stops = StopStringMatcher(seq.params.stop) if seq.params.stop else None
        self._ids_text = DeltaText(self.detokenizer)  # the text of requests the ids end (`text_of`)
        # Token ids that end the request, and the sequence length at which it ends for length.
        eos = set() if seq.params.ignore_eos else set(eos_token_ids)
        self.stop_ids = eos | set(seq.params.stop_token_ids)
        self.length_limit = min(seq.num_prompt_tokens + seq.params.max_tokens, max_model_len)
        # Stop ids and strings end the request only once it has min_tokens output tokens (vLLM's rule;
        # the engine masks EOS and stop ids before that, so only stop strings can come early).
        self.min_tokens = seq.params.min_tokens
        self._min_length = seq.num_prompt_tokens + self.min_tokens  # the sequence's, once past min_tokens
        # Per output token, for requests that ask (append-only: deltas hold prefixes of it).
        self.logprobs = LogprobsLog() if seq.params.logprobs is not None else None
        self._logprobs_reported = 0  # entries the previous delta's prefix held
        self.cumulative_logprob: float | None = 0.0 if seq.params.logprobs is not None else None

    def add_logprobs(self, entries: list[TokenLogprobs], chosen: list[float]) -> None:
        """Record the logprobs of tokens just committed (their entries, their chosen log probabilities)."""
        assert self.logprobs is not None and self.cumulative_logprob is not None
        self.logprobs.entries.extend(entries)
        self.cumulative_logprob += sum(chosen)

    def logprobs_so_far(self, final: bool) -> LogprobsPrefix | None:
        """Every output token's entry so far, as an O(1) view that later steps leave unchanged (final:
        for the request's last delta)."""
        log = self.logprobs
        if log is None:
            return None
        start, self._logprobs_reported = self._logprobs_reported, len(log.entries)
        return LogprobsPrefix(log, len(log.entries), start, final)

    @property
    def text_decides_finish(self) -> bool:
        """True when a stop string may end the request: its tokens' text must be made as they commit
        (`commit`); otherwise the ids decide (`commit_ids`) and the text may be made later (`text_of`)."""
        return self.stops is not None

    def commit(self, new_token_ids: Seq[int]) -> tuple[Seq[int], str, str | None]:
        """Append tokens to the sequence until one finishes it.

        Returns (tokens actually appended, new text, finish reason or None).
        """
        if self.stops is not None:
            return self._commit_matching_stops(new_token_ids)
        appended, reason = self.commit_ids(new_token_ids)
        return appended, self.text_of(appended, reason), reason

    def commit_ids(self, new_token_ids: Seq[int]) -> tuple[Seq[int], str | None]:
        """`commit` without the text, for a request whose text cannot end it (no stop strings): append
        tokens until one finishes it; returns (tokens appended: `new_token_ids` or a slice of it, finish
        reason or None). Their text is `text_of`, taken before the next commit."""
        assert self.stops is None, "stop strings decide the finish from the text: use commit"
        token_ids = self.seq.token_ids
        for i, token in enumerate(new_token_ids):
            token_ids.append(token)
            reason = self._finish_reason(token)
            if reason is not None:
                return new_token_ids[: i + 1], reason
        return new_token_ids, None

    def text_of(self, appended: list[int], reason: str | None) -> str:
        """The new text of tokens `commit_ids` appended (in one detokenizer call: a speculative step
        commits several at once), flushed when they finished the request; a stop id (EOS included)
        that ends the request is kept among the ids, not in the text (vLLM)."""
        return self._ids_text.text_of(appended, reason)

    def _commit_matching_stops(self, new_token_ids: Seq[int]) -> tuple[list[int], str, str | None]:
        """`commit` for a request with stop strings: token by token, each one's text fed to the matcher
        (a stop string ends the request at the token that completes it)."""
        assert self.stops is not None
        seq = self.seq
        appended: list[int] = []
        text: list[str] = []
        for token in new_token_ids:
            seq.token_ids.append(token)
            appended.append(token)
            if self._ends_on_stop_id(token):  # kept among the ids, not in the text (vLLM)
                text.append(self._flush())
                return appended, "".join(text), "stop"
            piece = self.detokenizer.push([token])
            if seq.num_output_tokens <= self.min_tokens:
                # vLLM matches stop strings only past min_tokens: this text is passed, never matched.
                text.append(piece)
                reason = self._finish_reason(token)
                if reason is not None:
                    text.append(self.detokenizer.flush())
                    return appended, "".join(text), reason
                continue
            piece, stopped = self.stops.feed(piece)
            text.append(piece)
            if stopped:
                return appended, "".join(text), "stop"
            reason = self._finish_reason(token)
            if reason is not None:
                text.append(self._flush())
                return appended, "".join(text), reason
        return appended, "".join(text), None

    def _ends_on_stop_id(self, token: int) -> bool:
        """True when `token`, just appended, is a stop id (EOS included) that ends the request."""
        # Lengths, not counts through properties: this runs per token of every request on every step.
        return token in self.stop_ids and len(self.seq.token_ids) >= self._min_length

    def _finish_reason(self, token: int) -> str | None:
        """Why the request ends at `token`, just appended (None: it goes on)."""
        if self._ends_on_stop_id(token):
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


class PendingDelta(NamedTuple):
    """One request's delta for one step, committed but not yet made: its tokens are in the sequence,
    its text (when the ids decided the finish) is still to be detokenized. `make` turns it into the
    RequestDelta; the deltas of a request are made in the order they were committed. (A named tuple,
    made per request and step: a frozen dataclass took twice as long to make.)"""

    processor: OutputProcessor
    tokens: tuple[int, ...]
    finish_reason: str | None
    text: str | None = None  # made already (stop strings, errors, aborts): None makes it now
    error: str | None = None

    def make(self, defer_text: bool = False) -> RequestDelta:
        """The RequestDelta (reads the request's counts and logprobs as they are now: no later step
        may have committed to this request in between). defer_text: leave text not made yet to the
        receiver (`RequestDelta.text_pending`) instead of detokenizing here."""
        processor = self.processor
        seq = processor.seq
        pending = self.text is None and defer_text
        text = (
            self.text
            if self.text is not None
            else ""
            if pending
            else processor.text_of(list(self.tokens), self.finish_reason)
        )
        finished = self.finish_reason is not None
        # Positional, in RequestDelta's field order: keywords took ~2.4x as long (per request and step).
        return RequestDelta(
            seq.request_id,
            list(self.tokens),
            text,
            finished,
            self.finish_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.spec_stats,
            self.error,
            processor.logprobs_so_far(final=finished),
            processor.cumulative_logprob,
            pending,
        )
