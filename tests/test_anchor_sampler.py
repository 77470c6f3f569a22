"""AnchorSampler's epochs: every sequence once a epoch in whole batches, and, with length grouping, batches
of like lengths (less padding) that still cover the data in a random order and resume exactly."""

from __future__ import annotations

import collections
import random

from dspark.training.data import AnchorSampler
from dspark.training.records import DistillRecord


def _records(count: int, seed: int) -> list[DistillRecord]:
    rng = random.Random(seed)
    return [
        DistillRecord(f"r{i}", "chat", 0.0, [1] * rng.randrange(2, 30), [2] * rng.randrange(2, 300))
        for i in range(count)
    ]


class _Recording(AnchorSampler):
    """An AnchorSampler that notes which sequences its batches took."""

    def batch(self, picks):  # noqa: ANN001, ANN201
        self.drawn = [*getattr(self, "drawn", []), *picks]
        return super().batch(picks)


def _epoch(sampler: AnchorSampler, batches: int) -> list[list[int]]:
    """The sequence lengths of `batches` batches."""
    return [next(sampler).lengths.tolist() for _ in range(batches)]


def _padding(batches: list[list[int]]) -> float:
    return sum(max(b) * len(b) - sum(b) for b in batches) / sum(max(b) * len(b) for b in batches)


def test_an_epoch_draws_every_sequence_in_whole_batches_and_grouping_cuts_padding() -> None:
    seed = random.randrange(2**31)  # fresh data every run
    records = _records(1000, seed)
    batch, per_epoch = 32, -(-1000 // 32)
    for group in (1, 16):
        sampler = _Recording(records, batch, 4, 1024, seed=seed, length_group=group)
        for _ in range(per_epoch):
            next(sampler)
        drawn = collections.Counter(sampler.drawn)
        assert set(drawn) == set(range(1000)), group  # every sequence, once but for the filler
        assert sum(drawn.values()) == per_epoch * batch and max(drawn.values()) <= 2
        assert sampler._order == []  # the epoch ended with its last whole batch
    random_batches = _epoch(AnchorSampler(records, batch, 4, 1024, seed=seed), per_epoch)
    grouped_batches = _epoch(AnchorSampler(records, batch, 4, 1024, seed=seed, length_group=16), per_epoch)
    assert _padding(grouped_batches) < 0.5 * _padding(random_batches)
    # Batches of one pool are shuffled: their longest sequences do not come in sorted order.
    longest = [max(b) for b in grouped_batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_a_grouped_sampler_resumes_where_it_stopped() -> None:
    records = _records(300, 5)
    sampler = AnchorSampler(records, 16, 4, 1024, seed=9, length_group=4)
    for _ in range(7):
        next(sampler)
    resumed = AnchorSampler(records, 16, 4, 1024, seed=0, length_group=4)
    resumed.load_state(sampler.state())
    for _ in range(30):  # past the epoch's end
        a, b = next(sampler), next(resumed)
        assert a.token_ids.equal(b.token_ids) and a.anchors.equal(b.anchors)
