"""Prompt lookup: drafts copied from a request's own tokens, where its last few tokens occurred before.

A request that repeats itself or its prompt (code that reuses names, a list, a quoted passage, a
template-like answer) often has its next tokens written already: after the latest earlier occurrence of its
last n tokens (n from MAX_NGRAM down to MIN_NGRAM). Where such an occurrence exists, its continuation
is a block of drafts that costs no drafter pass. On held-out prompts (SmolLM2's greedy answers, blocks
of 3; `benchmarks/results/cpu-2026-12-05-s38/ngram_potential.log`) a 2- or 3-token match was found
before 16-48% of the blocks, and there its drafts committed 1.80 of 3 against the drafter's 0.95.

Lossless as any proposal is: the target verifies every draft. A copied draft is a certain choice, so a
sampling request's draft distribution is one-hot at it (accepted with the target's probability of it;
on rejection the target's distribution without it is sampled).
"""

from __future__ import annotations

from array import array
from weakref import WeakKeyDictionary

from dspark.sequence import Sequence

# Longest and shortest suffix looked up (longest first: a longer match predicts better).
MAX_NGRAM = 3
MIN_NGRAM = 2
# c_k of every copied draft (the confidence the planner and the early stop read): the per-draft
# survival that makes 3 copied drafts commit the 1.80 measured where a match was found (c + c^2 + c^3).
LOOKUP_CONFIDENCE = 0.75
_ITEM = array("i").itemsize


class PromptLookup:
    """Finds each request's copied drafts; keeps its tokens as packed int32 bytes between steps (a
    request's tokens only grow: each step appends its new ones), so a step searches them in C, with
    no copy of the context and no walk over a Python list."""

    def __init__(self) -> None:
        self._tokens: WeakKeyDictionary[Sequence, bytearray] = WeakKeyDictionary()

    def drafts(self, seq: Sequence, count: int) -> list[int]:
        """Up to `count` drafts for `seq`'s next positions: the tokens after the latest earlier occurrence
        of its last MAX_NGRAM..MIN_NGRAM tokens (the longest that occurred), or none."""
        if count <= 0:
            return []
        data = self._packed(seq)
        n = len(data) // _ITEM
        for size in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if n <= size:
                continue
            start = _latest_earlier(data, bytes(data[(n - size) * _ITEM :]), (n - 1) * _ITEM)
            if start is not None:
                follow = start + size  # < n: the occurrence ends before the last token
                end = min(follow + count, n)
                return array("i", data[follow * _ITEM : end * _ITEM]).tolist()
        return []

    def _packed(self, seq: Sequence) -> bytearray:
        data = self._tokens.get(seq)
        known = 0 if data is None else len(data) // _ITEM
        if data is None or known > len(seq.token_ids):
            data = self._tokens[seq] = bytearray(array("i", seq.token_ids).tobytes())
        elif known < len(seq.token_ids):
            data += array("i", seq.token_ids[known:]).tobytes()
        return data


def _latest_earlier(data: bytearray, key: bytes, end: int) -> int | None:
    """The token index of the latest occurrence of `key` within data[:end] that starts on a token
    boundary, or None."""
    while True:
        at = data.rfind(key, 0, end)
        if at < 0:
            return None
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(key) - 1  # a match straddling tokens: look before it
