"""Merging a request's deltas (the engine process's batches, the adapter's pending updates): every token
and every character once, in order, the rest as of the last delta, and logprobs that survive the pipe."""

from __future__ import annotations

import dataclasses
import pickle
import random

from dspark.outputs import (
    Logprob,
    LogprobsLog,
    LogprobsPrefix,
    RequestDelta,
    SpecStats,
    merge_by_request,
    merge_deltas,
)


def delta(request_id: str, tokens: list[int], finished: bool = False, **extra: object) -> RequestDelta:
    return RequestDelta(
        request_id,
        tokens,
        "".join(f"<{t}>" for t in tokens),
        finished,
        "length" if finished else None,
        5,
        len(tokens),
        SpecStats(steps=len(tokens)),
        **extra,
    )


def test_a_run_of_deltas_merges_into_one_with_every_token_and_the_last_ones_state():
    rng = random.Random()
    runs = [[rng.randrange(1000) for _ in range(rng.randrange(0, 4))] for _ in range(rng.randrange(1, 6))]
    deltas = [delta("a", tokens) for tokens in runs[:-1]] + [delta("a", runs[-1], finished=True)]
    merged = merge_deltas(deltas)
    assert merged.new_token_ids == [t for tokens in runs for t in tokens]
    assert merged.new_text == "".join(d.new_text for d in deltas)
    assert merged.finished and merged.finish_reason == "length"
    assert merged.spec_stats is deltas[-1].spec_stats and merged.num_output_tokens == len(runs[-1])
    assert merge_deltas(deltas[:1]) is deltas[0]


def test_merge_by_request_keeps_each_requests_order_and_first_position():
    batch = [delta("a", [1]), delta("b", [10]), delta("a", [2]), delta("c", [], finished=True)]
    batch.append(delta("b", [11], finished=True))
    merged = merge_by_request(batch)
    assert [d.request_id for d in merged] == ["a", "b", "c"]
    assert [d.new_token_ids for d in merged] == [[1, 2], [10, 11], []]
    assert [d.finished for d in merged] == [False, True, True]


def test_merged_logprobs_cross_a_pipe_whole_though_the_earlier_delta_was_never_pickled():
    log = LogprobsLog()
    entries = [{t: Logprob(-0.1 * t, 1, f"w{t}")} for t in (3, 4, 5)]
    log.entries.extend(entries[:1])
    first = delta("a", [3], logprobs=LogprobsPrefix(log, 1, 0))
    log.entries.extend(entries[1:])
    second = delta("a", [4, 5], finished=True, logprobs=LogprobsPrefix(log, 3, 1, final=True))
    received = pickle.loads(pickle.dumps(merge_by_request([first, second])))[0]
    assert received.new_token_ids == [3, 4, 5]
    assert received.logprobs.last(3) == entries


def test_deltas_pickle_positionally_with_every_field():
    for value in (
        delta("a", [1, 2], finished=True, error="e", cumulative_logprob=-1.5),
        SpecStats(1, 2, 3, 4, 5, [6, 7], [8, 9]),
    ):
        names = [f.name for f in dataclasses.fields(value)]
        assert len(value.__reduce__()[1]) == len(names)  # a new field must be added to __reduce__ too
        copy = pickle.loads(pickle.dumps(value))
        assert [getattr(copy, n) for n in names] == [getattr(value, n) for n in names]
