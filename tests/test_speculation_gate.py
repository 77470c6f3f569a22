"""The speculation gate: it follows the measured speed of earlier steps, per batch tier, re-probes the
losing side, and the engine behind it stays lossless whichever way it decides."""

from __future__ import annotations

import collections
import random

import pytest
from tiny_models import emulated_graphs_config, tiny_engine_config, use_emulated_graphs

from dspark import LLM, EngineConfig, SamplingParams
from dspark.engine.llm_engine import WAVE_STEPS
from dspark.outputs import gate_rows
from dspark.spec.gate import (
    BATCH_DRAFT_MARGIN,
    BATCH_MARGIN_REQUESTS,
    DRAFT_MARGIN,
    FIRST_PRIOR,
    HISTORY_LEAST_STEPS,
    LATER_TIER_WARM_UP_STEPS,
    PROBE_BACKOFF,
    PROBE_CLEAR_LOSS,
    PROBE_INTERVAL,
    PROBE_MOST_STEPS,
    RUN_EDGES,
    SMOOTHING,
    WARM_UP_STEPS,
    WARM_UP_TRIES,
    SpeculationGate,
    draft_lengths,
    draft_margin,
)


class _Clock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_steps(
    gate: SpeculationGate, clock: _Clock, requests: int, steps: int, seconds, accepted, draining=None
) -> list[int]:
    """Drive `steps` decode steps; seconds(length) says how long a step of each draft length takes and
    accepted(step) how many drafts each request would accept of an unbounded window (it commits
    1 + min(accepted, length)); `draining` goes to `draft_length`. Returns the lengths chosen."""
    decisions = []
    for step in range(steps):
        length = gate.draft_length(requests, draining)
        gate.start_step(length)
        clock.now += seconds(length)
        gate.finish_step([1 + min(a, length) for a in accepted(step)])
        decisions.append(length)
    return decisions


def _cycle(counts: dict[int, int], requests: int = 1, seed: int = 0):
    """accepted(step) for _run_steps: a shuffled cycle holding each accepted count `counts[a]` times,
    dealt `requests` at a time (so the rates are exact over the cycle, not up to sampling noise)."""
    pool = [a for a, k in counts.items() for _ in range(k)]
    random.Random(seed).shuffle(pool)
    return lambda step: [pool[(step * requests + r) % len(pool)] for r in range(requests)]


def test_draft_lengths() -> None:
    assert draft_lengths(1) == (0, 1)
    assert draft_lengths(3) == (0, 1, 2, 3)
    assert draft_lengths(4) == (0, 1, 2, 4)
    assert draft_lengths(7) == (0, 1, 2, 4, 7)


def test_gate_tries_every_length_then_follows_the_fastest_and_probes_the_others() -> None:
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    # 8 requests accepting 3, 1, 1, 0, ... drafts; a step of length n takes 1 + 0.5 n ms and commits
    # 8 / 11 / 12 / 13 tokens: 8000 / 7333 / 6000 / 5200 tokens/s for n = 0..3, so plain wins.
    decisions = _run_steps(
        gate, clock, 8, 400, lambda n: 0.001 * (1 + 0.5 * n), lambda step: [3, 1, 1, 0, 0, 0, 0, 0]
    )
    warm = 4 * WARM_UP_STEPS
    assert (
        decisions[:warm]
        == [3] * WARM_UP_STEPS + [2] * WARM_UP_STEPS + [1] * WARM_UP_STEPS + [0] * WARM_UP_STEPS
    )
    settled = decisions[warm:]
    probes = [n for n in settled if n != 0]
    assert 0 < len(probes) <= len(settled) // PROBE_INTERVAL + 1
    assert set(probes) == {1, 2, 3}  # every loser is probed in turn
    rates = gate.rates(8)
    # Within the prior's share: PRIOR_REQUESTS requests against ~160 a position in the faded counts
    # (fewer at the positions plain steps between probes do not verify, which fade slowly).
    assert rates == pytest.approx({0: 8000, 1: 11 / 0.0015, 2: 6000, 3: 5200}, rel=0.025)


def test_gate_picks_a_short_window_where_it_pays() -> None:
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    # One row costs as much as two (a CPU's BLAS), more rows cost more; drafts survive 0.55 / 0.26 /
    # 0.13 of the time: length 1 wins (1.55 tokens per 1 ms against 1 for plain and 1.81 / 1.94 for
    # 1.3 / 1.6 ms).
    cost = [1.0, 1.0, 1.3, 1.6]
    accepted = _cycle({0: 45, 1: 29, 2: 13, 3: 13})
    decisions = _run_steps(gate, clock, 1, 400, lambda n: 0.001 * cost[n], accepted)
    settled = decisions[4 * WARM_UP_STEPS :]
    assert settled.count(1) >= 0.9 * len(settled)


def test_gate_tells_lengths_apart_by_their_shared_acceptance() -> None:
    """One request, every length as fast as the others but plain: the block's extra 7% of tokens per
    step must win nearly always, although one step's acceptance (1 to 4 tokens) varies far more."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    accepted = _cycle({0: 45, 1: 29, 2: 13, 3: 13}, seed=5)
    decisions = _run_steps(gate, clock, 1, 1000, lambda n: 0.00134 if n else 0.00117, accepted)
    settled = decisions[4 * WARM_UP_STEPS :]
    assert settled.count(3) >= len(settled) - len(settled) // PROBE_INTERVAL - 20


def test_a_warm_up_whose_drafts_all_failed_does_not_rule_out_the_longer_lengths() -> None:
    """One request whose first 12 steps accept nothing (an answer's first tokens are the hardest to
    draft), then 0 / 1 / 2 / 3 drafts 50 / 22 / 14 / 14% of the time, windows nearly as cheap as plain
    decoding (oneDNN on a CPU): the block (1.92 tokens for 1.12 ms) beats 2 (1.78 / 1.10), 1 (1.5 /
    1.06) and plain. The positions the warm-up never reached must not count as never accepted (they
    did, and the gate then followed length 1 or plain for hundreds of steps)."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    mix = _cycle({0: 50, 1: 22, 2: 14, 3: 14}, seed=3)
    cost = [1.0, 1.06, 1.10, 1.12]
    decisions = _run_steps(
        gate, clock, 1, 400, lambda n: 0.001 * cost[n], lambda s: [0] if s < 12 else mix(s)
    )
    settled = decisions[100:]
    assert settled.count(3) >= 0.8 * len(settled), collections.Counter(settled)


def test_positions_a_request_did_not_verify_are_not_counted_as_failed() -> None:
    """Steps of length 3 whose requests verified only 1 draft (a copied block shorter than the length,
    `spec.lookup`) and accepted it: positions 2-3 were never verified, so they keep their prior, not a
    rate of 0; told nothing of what was verified, the gate counts them failed (as before)."""
    told, untold = SpeculationGate(3, _Clock()), SpeculationGate(3, _Clock())
    for gate, verified in ((told, [1, 1]), (untold, None)):
        for _ in range(50):
            gate.start_step(3)
            gate.finish_step([2, 2], verified)
    assert told._acceptance.tokens_per_request(3) > 3.5 > 2.1 > untold._acceptance.tokens_per_request(3)
    assert told._acceptance.tokens_per_request(1) == pytest.approx(untold._acceptance.tokens_per_request(1))


def test_gate_turns_speculation_off_where_it_loses_and_keeps_tiers_apart() -> None:
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    # At 64 requests speculation loses (90 tokens against 64, for 2x the time); at 1 request it wins
    # (2 tokens for 1.2x the time).
    loses = _run_steps(
        gate, clock, 64, 200, lambda n: 0.002 if n else 0.001, lambda step: [1] * 26 + [0] * 38
    )
    wins = _run_steps(gate, clock, 1, 200, lambda n: 0.0012 if n else 0.001, lambda step: [1])
    assert sum(loses[2 * WARM_UP_STEPS :]) <= len(loses) // PROBE_INTERVAL + 1
    assert sum(wins[2 * WARM_UP_STEPS :]) >= len(wins) - 2 * WARM_UP_STEPS - len(wins) // PROBE_INTERVAL - 1


@pytest.mark.parametrize("num_requests", [1, 8])
@pytest.mark.parametrize("share", [0.5, 1.5])
def test_drafting_must_beat_plain_decoding_by_the_margin(num_requests: int, share: float) -> None:
    """Near a tie plain decoding stays (a batch that does not refill waits for its slowest request,
    which drafting makes slower than the mean); a clear gain drafts."""
    ahead = share * draft_margin(num_requests)
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    # Half of the requests accepting the draft: 1.5x the tokens of a plain step (one request: every
    # other step accepts).
    drafting_s = 0.001 * 1.5 / (1.0 + ahead)
    accepted = (lambda step: [step % 2]) if num_requests == 1 else (lambda step: [1] * 4 + [0] * 4)
    decisions = _run_steps(gate, clock, num_requests, 400, lambda n: drafting_s if n else 0.001, accepted)
    assert gate.rates(num_requests)[1] / gate.rates(num_requests)[0] == pytest.approx(1.0 + ahead, rel=0.02)
    settled = decisions[2 * WARM_UP_STEPS :]
    drafted = sum(settled)
    probes = len(settled) // PROBE_INTERVAL + 1
    if share < 1.0:
        assert drafted <= probes * PROBE_MOST_STEPS, decisions  # probes only (each until measured)
    else:
        assert drafted >= len(settled) - probes * PROBE_MOST_STEPS, decisions


@pytest.mark.parametrize("drafting_s", [0.0017, 0.0014])
def test_a_length_a_probe_finds_clearly_behind_is_probed_less_often(drafting_s: float) -> None:
    """64 requests, plain 1 ms a step, drafting 1.3 tokens a request: at 1.7 ms (0.76x plain's rate,
    under PROBE_CLEAR_LOSS) probes come PROBE_BACKOFF times as seldom (in a batch run to its end each
    one spreads the requests' progress); at 1.4 ms (0.93x) as often as before."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    accepted = _cycle({0: 70, 1: 30}, requests=64)
    decisions = _run_steps(gate, clock, 64, 3000, lambda n: drafting_s if n else 0.001, accepted)
    settled = decisions[4 * WARM_UP_STEPS :]
    probes = sum(settled)
    if 1.3 / drafting_s < PROBE_CLEAR_LOSS / 0.001:  # clearly behind
        assert 1 <= probes <= len(settled) // (PROBE_INTERVAL * PROBE_BACKOFF) + 2, probes
    else:
        assert probes >= len(settled) // (PROBE_INTERVAL + 1) - 2, probes


def test_the_margin_grows_with_the_requests_a_batch_waits_for() -> None:
    """One request alone: DRAFT_MARGIN; from BATCH_MARGIN_REQUESTS up: BATCH_DRAFT_MARGIN; between,
    rising with the request count."""
    margins = [draft_margin(n) for n in (1, 2, 4, BATCH_MARGIN_REQUESTS, 64, 256)]
    assert margins[0] == DRAFT_MARGIN
    assert margins[0] < margins[1] < margins[2] < margins[3]
    assert margins[3:] == [BATCH_DRAFT_MARGIN] * 3


def _progress(accepted_per_request: list[int], block: int, steps: int, remaining: int):
    """`draining` for the gate: each request verified `block` drafts on `steps` steps and accepted its
    first accepted_per_request[r] of them on each, with `remaining` tokens left."""

    def progress():
        for a in accepted_per_request:
            yield remaining, [steps] * block, [steps if k < a else 0 for k in range(block)]

    return progress


@pytest.mark.parametrize("spread", [True, False])
def test_a_batch_run_to_its_end_is_judged_by_the_requests_it_drafts_worst_for(spread: bool) -> None:
    """64 requests, plain 1 ms a step, a window of 3 drafts 1.4 ms. Spread: half accept every draft,
    half none (200 steps each have shown it): the mean commits 2.5 tokens a request a step (1.8x plain's
    rate), but a batch run to its end waits for the requests at 1 token a step (0.7x): draining, plain
    decoding; otherwise (a server's batch, whose freed seats are taken), drafting. Alike: every request
    accepts 2 of 3, and drafting pays either way."""
    accepted = [3] * 32 + [0] * 32 if spread else [2] * 64
    chosen = {}
    for draining in (None, _progress(accepted, 3, 200, 100)):
        clock = _Clock()
        gate = SpeculationGate(3, clock)
        decisions = _run_steps(
            gate, clock, 64, 400, lambda n: 0.0014 if n else 0.001, lambda step: accepted, draining
        )
        settled = decisions[8 * WARM_UP_STEPS :]
        chosen[draining is not None] = sum(1 for n in settled if n) / len(settled)
    assert chosen[False] > 0.9  # the mean: drafting
    if spread:
        assert chosen[True] < 0.1, chosen  # plain, but for probes
    else:
        assert chosen[True] > 0.9, chosen


def test_a_draining_batch_s_requests_few_steps_measured_count_as_the_mean() -> None:
    """Requests whose drafts no step verified yet (the gate ran plain steps) are judged by the shared
    acceptance, not as requests that accept nothing: drafting that pays for every request stays."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    unmeasured = _progress([0] * 64, 3, 0, 100)
    decisions = _run_steps(
        gate, clock, 64, 300, lambda n: 0.0014 if n else 0.001, lambda step: [2] * 64, unmeasured
    )
    settled = decisions[8 * WARM_UP_STEPS :]
    assert sum(1 for n in settled if n) / len(settled) > 0.9


@pytest.mark.parametrize("told", ["spread", "too few drafts", "nothing"])
def test_a_draining_batch_s_unknown_requests_are_spread_as_finished_requests_were(told: str) -> None:
    """64 requests, plain 1 ms a step, a window of 3 drafts 1.4 ms; half accept every draft, half none,
    so the mean commits 2.5 tokens a request a step. A new batch run to its end whose requests no step
    measured yet: told that finished requests spread so (each drafted 200 steps), the gate takes half
    of the batch's requests at 1 token a step (the batch's end: 100 steps either way, at 1.4 ms drafting),
    and decodes plainly from the batch's first step; told of requests that drafted too few steps to say,
    or of none, it judges them all by the mean: drafting."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    seconds = lambda n: 0.0014 if n else 0.001  # noqa: E731
    _run_steps(gate, clock, 64, 300, seconds, lambda step: [3] * 32 + [0] * 32)  # a server's batch: drafting
    steps = {"spread": 200, "too few drafts": HISTORY_LEAST_STEPS - 1, "nothing": 0}[told]
    for r in range(64 if steps else 0):
        gate.request_finished([steps] * 3, [steps if r < 32 else 0] * 3)
    mix = lambda step: [3] * 32 + [0] * 32  # noqa: E731
    decisions = _run_steps(gate, clock, 64, 40, seconds, mix, _progress([0] * 64, 3, 0, 100))
    drafting = sum(1 for n in decisions if n) / len(decisions)
    if told == "spread":
        assert drafting < 0.1, decisions
    else:
        assert drafting > 0.9, decisions


@pytest.mark.parametrize("tail_ms", [1.4, 0.7])
def test_a_draining_batch_s_end_is_timed_at_the_tiers_its_requests_leave_running(tail_ms: float) -> None:
    """64 requests of 100 tokens, every one known (200 drafting steps each): half commit ~3.8 tokens a
    step at 3 drafts and finish after ~26 steps, half ~1.45 and need ~69. Plain: 100 steps at 1 ms.
    Drafting: 1.4 ms a step at 64 requests; the last ~43 steps run 32 requests, at tier 32's drafting
    time: at 1.4 ms too the end comes at ~97 ms (3% ahead, under the margin): plain; at 0.7 ms (a tail
    that costs less, as on a host-bound GPU) at ~67 ms: drafting."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    costs = {64: 1.4e-3, 32: tail_ms * 1e-3}
    for tier in (64, 32):  # each tier's times measured (its warm-up), half accepting every draft
        seconds = lambda n, d=costs[tier]: d if n else 1e-3  # noqa: E731
        _run_steps(gate, clock, tier, 40, seconds, lambda step, t=tier: [3, 0] * (t // 2))

    def progress():
        for r in range(64):
            yield 100, [200, 200, 200], [200, 200, 200] if r < 32 else [50, 0, 0]

    decisions = _run_steps(
        gate, clock, 64, 12, lambda n: costs[64] if n else 1e-3, lambda step: [3, 0] * 32, progress
    )
    expected = 0 if tail_ms > 1.0 else 3
    assert decisions.count(expected) >= 9, decisions


def test_a_warm_up_begun_as_a_batch_ended_does_not_run_on_into_the_next_batch() -> None:
    """A batch's last request alone starts tier 1's warm-up (drafting); the next batch of 8 comes at once,
    where drafting loses: the warm-up ends there (its steps would be measured in tier 8, never in its
    own), and tier 8 decodes plainly. Across a tier's edge (8 <-> 16 requests) a run goes on."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    seconds = lambda n: 0.0015 if n else 0.001  # noqa: E731
    _run_steps(gate, clock, 8, 40, seconds, lambda step: [0] * 8)  # tier 8 warmed up: plain wins
    assert _run_steps(gate, clock, 1, 1, seconds, lambda step: [0]) == [3]  # tier 1's warm-up, longest first
    assert _run_steps(gate, clock, 8, 4, seconds, lambda step: [0] * 8) == [0] * 4
    # A tier's first step starts its warm-up; the count moving to the next tier keeps it going.
    assert _run_steps(gate, clock, 16, 1, seconds, lambda step: [0] * 16) == [3]
    assert _run_steps(gate, clock, 9, 1, seconds, lambda step: [0] * 9) == [3]


def test_a_warm_up_choice_on_a_prefill_step_is_made_again() -> None:
    """Served, requests arrive one by one and many steps carry a prefill chunk, which the gate does
    not measure. Here every plain step of the warm-up carries one: plain must be tried until it is
    measured, and then win (it is the fastest), not stay unmeasured and never chosen."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    decisions = []
    for step in range(200):
        length = gate.draft_length(8)
        gate.start_step(length)
        clock.now += 0.001 * (1 + 0.5 * length)  # 8 / 7.3 / 6 / 5.2k tokens/s: plain wins
        prefill = length == 0 and step < 4 * WARM_UP_STEPS
        gate.finish_step([] if prefill else [1 + min(a, length) for a in (3, 1, 1, 0, 0, 0, 0, 0)])
        decisions.append(length)
    assert decisions[: 4 * WARM_UP_STEPS].count(0) == WARM_UP_STEPS  # all three on prefill steps
    assert 0 in gate.rates(8)  # measured since
    # Tried again at once, measured, and followed from then on (not only once a probe finds it).
    after = decisions[5 * WARM_UP_STEPS : 5 * WARM_UP_STEPS + 20]
    assert after.count(0) >= len(after) - 1, decisions[: 6 * WARM_UP_STEPS]


def test_no_drafting_while_plain_decoding_is_unmeasured_in_the_tier() -> None:
    """Plain decoding's warm-up can end unmeasured (every plain step carried a prefill chunk, or sat at
    a run's edge): drafting then was chosen on no comparison with plain (H100, 64 requests, after three
    runs). Here plain's steps carry a chunk for the first 60 steps, drafting loses (1.3 tokens for
    1.5 ms against 1 for 1 ms): plain is probed until measured, not left for drafting, and then wins."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    decisions = []
    for step in range(200):
        length = gate.draft_length(8)
        gate.start_step(length, prefill=length == 0 and step < 60)
        clock.now += 0.0015 if length else 0.001
        prefill = length == 0 and step < 60
        gate.finish_step([] if prefill else [1 + min(a, length) for a in (1, 1, 1, 0, 0, 0, 0, 0)])
        decisions.append(length)
    warm = WARM_UP_STEPS + RUN_EDGES  # length 1's warm-up, then plain's
    assert sum(decisions[warm:60]) == 0, decisions[:60]
    assert 0 in gate.rates(8)
    assert sum(decisions[70:]) <= len(decisions[70:]) // PROBE_INTERVAL + 1, decisions


def test_a_later_tier_warms_up_in_two_steps_a_length_on_the_shared_acceptance() -> None:
    """Served, the request count moves between tiers; acceptance is the drafter's, not the batch's, so
    a tier met after the first times each length twice and decides on the acceptance measured so far."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    accepted = _cycle({0: 45, 1: 29, 2: 13, 3: 13})
    cost = [1.0, 1.0, 1.3, 1.6]  # length 1 wins at any request count (see the test above)
    _run_steps(gate, clock, 8, 100, lambda n: 0.001 * cost[n], lambda step: [accepted(step)[0]] * 8)
    later = _run_steps(gate, clock, 3, 60, lambda n: 0.001 * cost[n], lambda step: [accepted(step)[0]] * 3)
    warm = len(gate.lengths) * LATER_TIER_WARM_UP_STEPS
    assert later[:warm] == [n for n in (3, 2, 1, 0) for _ in range(LATER_TIER_WARM_UP_STEPS)]
    assert later[warm:].count(1) >= len(later) - warm - len(later) // PROBE_INTERVAL - 1


def _paused(seconds, pauses: set[int], pause_s: float = 0.03):
    """seconds(length) for _run_steps, with the host paused (a garbage collection, a descheduled thread)
    for `pause_s` inside the steps whose index is in `pauses`."""
    count = [0]

    def step_seconds(length: int) -> float:
        count[0] += 1
        return seconds(length) + (pause_s if count[0] - 1 in pauses else 0.0)

    return step_seconds


@pytest.mark.parametrize("tier", ["first", "later"])
def test_a_pause_in_one_timed_step_does_not_decide_the_length(tier: str) -> None:
    """The host pauses now and then for tens of milliseconds in one step (on the H200 host a batch-128
    plain step takes 1.4 ms). A pause in the one or few steps that time a length, in its warm-up, must
    not make the gate shun it: plain decoding, the faster here, is followed from the warm-up's end."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    accepted = lambda step: [1, 0, 0, 0, 0, 0, 0, 0]  # noqa: E731 - 8 / 9 / 9 / 9 tokens a step
    cost = lambda n: 0.001 * (1 + 0.5 * n)  # noqa: E731 - plain wins: 8000 against 6000 tokens/s
    if tier == "later":  # the first tier warms up on another request count, unpaused
        _run_steps(gate, clock, 3, 40, cost, lambda step: [1, 0, 0])
        warm = len(gate.lengths) * LATER_TIER_WARM_UP_STEPS
    else:
        warm = len(gate.lengths) * WARM_UP_STEPS
    first_plain = warm - (LATER_TIER_WARM_UP_STEPS if tier == "later" else WARM_UP_STEPS)
    decisions = _run_steps(gate, clock, 8, 200, _paused(cost, {first_plain}), accepted)
    assert decisions[first_plain:warm] == [0] * (warm - first_plain)  # the paused step was plain's
    after = decisions[warm:]
    assert after.count(0) >= len(after) - len(after) // PROBE_INTERVAL - 1, decisions


def test_a_pause_in_the_followed_length_does_not_hand_the_choice_to_a_slower_one() -> None:
    """Pauses land in whichever length runs, most often the one followed: one of 20x a step now and
    then must not make it look slower than a length that loses by 25%."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    cost = lambda n: 0.001 if n == 0 else 0.0015  # noqa: E731 - 4 tokens in 1 ms against 5 in 1.5 ms
    decisions = _run_steps(
        gate, clock, 4, 600, _paused(cost, set(range(30, 600, 40)), 0.02), lambda step: [1, 0, 0, 0]
    )
    settled = decisions[2 * WARM_UP_STEPS :]
    assert settled.count(0) >= len(settled) - 2 * (len(settled) // PROBE_INTERVAL + 1), decisions


def test_gate_follows_a_change_of_regime() -> None:
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    _run_steps(gate, clock, 4, 100, lambda n: 0.0015 if n else 0.001, lambda step: [1, 1, 1, 1])
    # Acceptance collapses: speculation now commits barely more than plain for 1.5x the time.
    after = _run_steps(gate, clock, 4, 300, lambda n: 0.0015 if n else 0.001, lambda step: [1, 0, 0, 0])
    assert sum(after[-100:]) <= 100 // PROBE_INTERVAL + 1


@pytest.mark.parametrize("graphs", [False, True])
def test_gated_engine_is_lossless_and_speculates_on_some_steps_only(
    tiny_target_dir, tiny_drafter_dir, graphs
) -> None:
    """On the CPU, where the test's clock decides. graphs: the steps replay emulated CUDA graphs, drafting
    inside the target step, and go ahead of each other (a GPU's path: a step is timed only between
    neighbours of its length)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 20))] for _ in range(4)]
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    base = emulated_graphs_config(tiny_target_dir, tiny_drafter_dir, kv_page_size=4, device="cpu")
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompts)
    llm = LLM(base.replace(adaptive_speculation=True))
    if graphs:
        use_emulated_graphs(llm.engine)
    clock = _Clock()
    gate = llm.engine.gate = SpeculationGate(llm.engine.limits.block_size, clock)
    # Steps are timed by the test's clock: a plain step "takes" 1 ms and a drafting one 10 ms, charged
    # when it finishes (steps finish in launch order), so drafting is made to look slow.
    launched: collections.deque[int] = collections.deque()
    # Every launched step's request count and length (a launch given up asks the gate again).
    started: list[tuple[int, int]] = []
    asked = [0]  # the request count of the gate's last decision
    real_start, real_finish = gate.start_step, gate.finish_burst

    def start(length: int, at: float | None = None, prefill: bool = False) -> None:
        launched.append(length)
        started.append((asked[0], length))
        real_start(length, at, prefill)

    def finish(committed: list[list[int]], verified: list[list[int]] | None = None) -> None:
        clock.now += (0.010 if launched.popleft() else 0.001) * len(committed)
        real_finish(committed, verified)

    decisions: list[int] = []
    real_decide = gate.draft_length

    def decide(num_requests: int, draining=None) -> int:
        asked[0] = num_requests
        decisions.append(real_decide(num_requests, draining))
        return decisions[-1]

    gate.start_step = start  # type: ignore[method-assign]
    gate.finish_burst = finish  # type: ignore[method-assign]
    gate.draft_length = decide  # type: ignore[method-assign]
    gated = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in gated] == [o.token_ids for o in plain]
    stats = llm.engine.total_spec_stats
    assert stats.drafted_tokens > 0, "the gate's warm-up drafts"
    assert 0 < stats.drafting_steps < stats.steps  # what dspark_spec_drafting_steps_total publishes
    # Speculation, 10x slower here, is switched off after the warm-up, but for the probes: while all
    # four requests run (the first tier; as they end, smaller tiers warm up in turn), past the warm-up
    # of every length (WARM_UP_STEPS measured steps each; where steps overlap, on a GPU, a run's first
    # and last are not measured: RUN_EDGES), only probes draft: at most PROBE_MOST_STEPS steps per
    # PROBE_INTERVAL steps.
    assert decisions[:WARM_UP_STEPS] == [gate.lengths[-1]] * WARM_UP_STEPS
    edges = RUN_EDGES if llm.engine.loop_counters.ahead_steps else 0
    warm_up = len(gate.lengths) * (WARM_UP_STEPS + edges)
    first_tier = [length for count, length in started if count == len(prompts)]
    steady = first_tier[warm_up:]
    assert len(steady) >= PROBE_INTERVAL, started
    assert bool(llm.engine.loop_counters.ahead_steps) == graphs
    drafting = sum(1 for n in steady if n)
    assert drafting <= PROBE_MOST_STEPS * (len(steady) // PROBE_INTERVAL + 1), started


def test_the_engine_s_load_shows_the_gate_s_view_once_no_request_runs(
    tiny_target_dir, tiny_drafter_dir, monkeypatch
) -> None:
    """The view `load` carries is remade at most every GATE_VIEW_INTERVAL_S while requests run, and once
    more when none does: a load shorter than the interval (48 tokens on an H100) left its first steps'."""
    import dspark.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "GATE_VIEW_INTERVAL_S", 1e9)  # only the end of the load remakes it
    base = emulated_graphs_config(tiny_target_dir, tiny_drafter_dir, kv_page_size=4, device="cpu")
    llm = LLM(base.replace(adaptive_speculation=True))
    assert llm.engine.load().gate == ()
    llm.generate(params=SamplingParams(max_tokens=24, ignore_eos=True), prompt_token_ids=[[1, 2, 3]])
    chosen = sum(row["chosen_steps"] for row in gate_rows(llm.engine.gate.view()))
    assert chosen > 0 and llm.engine.load().gate == llm.engine.gate.view()


def test_seeded_sampling_stays_reproducible_under_the_gate(tiny_target_dir, tiny_drafter_dir) -> None:
    # The gate follows wall time, which differs run to run; a step with a seeded sampling request follows
    # spec_mode instead, so the request's stream is the same every time, whatever the gate would say.
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    config = EngineConfig(
        model=str(tiny_target_dir), draft_model=str(tiny_drafter_dir), num_kv_pages=128, kv_page_size=4
    )
    streams = []
    for speculate in (True, False):
        llm = LLM(config)
        block = llm.engine.limits.block_size
        llm.engine.gate.draft_length = lambda num_requests, draining=None, s=speculate, b=block: b if s else 0  # type: ignore[method-assign]
        out = llm.generate(params=params, prompt_token_ids=[[1, 2, 3, 4]])[0]
        assert out.spec_stats.drafted_tokens > 0
        streams.append(out.token_ids)
    assert streams[0] == streams[1]


def _run_overlapped(
    gate: SpeculationGate,
    clock: _Clock,
    requests,
    steps: int,
    prepare,
    accepted,
    prefill=lambda step: False,
) -> list[int]:
    """Drive `steps` steps as the engine's overlap scheduling runs them where the host sets the pace:
    each call prepares and launches a step (prepare(length) seconds) and then finishes the step launched
    by the call before, whose device work is long done. requests: a count, or requests(step) one.
    Returns the lengths chosen."""
    decisions = []
    in_flight: tuple[int, bool, int] | None = None
    for step in range(steps):
        count = requests(step) if callable(requests) else requests
        length = gate.draft_length(count)
        began = clock.now
        clock.now += prepare(length)
        gate.start_step(length, began, prefill(step))
        if in_flight is not None:
            earlier, chunk, earlier_count = in_flight
            committed = [1 + min(a, earlier) for a in accepted(step)[:earlier_count]]
            gate.finish_step([] if chunk else committed)
        in_flight = (length, prefill(step), count)
        decisions.append(length)
    return decisions


def test_overlapped_steps_are_timed_between_neighbours_of_their_own_length() -> None:
    """With overlap scheduling the wall time a step adds holds the host's preparation of the step behind
    it. Here the host sets the pace: a plain step costs 1 ms to prepare, a drafting one 2 ms for 1.3
    tokens a request, so plain decoding is the faster (1000 against 650 tokens/s a request). A probe of
    plain between drafting steps must not be charged their preparation (the gate then kept drafting)."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    accepted = _cycle({0: 70, 1: 30}, requests=128)
    decisions = _run_overlapped(gate, clock, 128, 600, lambda n: 0.002 if n else 0.001, accepted)
    assert gate.rates(128)[0] == pytest.approx(128 / 0.001)
    assert gate.rates(128)[3] == pytest.approx(128 * 1.3 / 0.002, rel=0.05)
    settled = decisions[200:]
    # Only probes draft: 3 steps each under overlap, each followed by 3 * PROBE_INTERVAL steps without.
    drafting = len(settled) - settled.count(0)
    assert drafting <= 3 * (len(settled) // (3 * PROBE_INTERVAL) + 1), decisions[:100]


def test_overlapped_warm_up_measures_each_length_without_its_edges_and_probes_until_measured() -> None:
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    # Drafting (2 tokens a request for 1.5 ms) beats plain (1 token for 1 ms).
    decisions = _run_overlapped(gate, clock, 4, 200, lambda n: 0.0015 if n else 0.001, lambda s: [1] * 4)
    # Runs of WARM_UP_STEPS measured steps and their two unmeasured edges, longest first (the very first
    # step has no neighbour before it, and the step launched behind it makes it unmeasured too).
    run = WARM_UP_STEPS + 2
    assert decisions[: 2 * run] == [1] * run + [0] * run
    # Every draft accepted: within the prior's share (PRIOR_REQUESTS requests at FIRST_PRIOR).
    assert gate.rates(4) == pytest.approx({0: 4000, 1: 8 / 0.0015}, rel=0.01)
    settled = decisions[2 * run :]
    # Each probe of plain runs three steps in a row: the middle one is measured.
    probes = "".join(str(n) for n in settled).replace("1", " ").split()
    assert probes and all(p == "000" for p in probes), settled


def test_a_neighbour_with_a_prefill_chunk_leaves_a_step_unmeasured() -> None:
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    # Every other step carries a prefill chunk (5 ms more to prepare): no decode step has two decode-only
    # neighbours, so nothing is measured, however long the warm-up tries.
    _run_overlapped(
        gate,
        clock,
        4,
        100,
        lambda n: 0.001,
        lambda s: [1] * 4,
        prefill=lambda step: step % 2 == 0,
    )
    assert gate.rates(4) == {}


def test_a_run_of_one_length_goes_on_across_tiers_so_that_alternating_tiers_still_measure_every_length():
    """Under launch-ahead the decoding count can move between tiers from one step to the next (requests
    sit a step out). A warm-up or probe run that stopped at the tier's change never had two neighbours
    of its length; here the count alternates 8 / 9 (tiers 8 and 16) and plain, 3x faster to prepare,
    must still be measured in both tiers and win."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    accepted = _cycle({0: 70, 1: 30}, requests=9)
    decisions = _run_overlapped(
        gate, clock, lambda step: 8 + step % 2, 600, lambda n: 0.003 if n else 0.001, accepted
    )
    assert 0 in gate.rates(8) and 0 in gate.rates(9)
    settled = decisions[200:]
    assert settled.count(0) >= 0.9 * len(settled), decisions[:120]


def test_a_choice_counts_once_its_step_starts():
    """A launch given up and tried again (a drafting step that cannot go ahead eagerly) asks the gate
    twice for one step: the warm-up's tries are steps, not questions. Here no step is measured (each
    carries a prefill chunk), so each length is tried its whole bound of steps, longest first."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    decisions = []
    for _ in range(4 * 5 * WARM_UP_STEPS):
        length = gate.draft_length(4)
        assert gate.draft_length(4) == length  # asked again for the same step
        gate.start_step(length, prefill=True)
        clock.now += 0.001
        gate.finish_step([])
        decisions.append(length)
    tries = WARM_UP_TRIES * (WARM_UP_STEPS + RUN_EDGES)
    assert decisions[: 2 * tries] == [1] * tries + [0] * tries


def test_a_stretch_of_rejections_past_the_first_draft_does_not_lock_the_gate_into_length_1() -> None:
    """One request whose first 150 steps accept no draft or one (the second always rejected), then
    every draft, windows of 2-3 much dearer than 1: while the gate runs length 1, its steps never
    verify positions 2-3, so what the stretch said of them must fade (towards their prior) rather
    than stand until enough probes of the block outweigh it (it took ~80 steps here)."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    cost = [1.0, 1.05, 1.3, 1.4]
    mix = _cycle({0: 1, 1: 1})
    decisions = _run_steps(
        gate, clock, 1, 200, lambda n: 0.001 * cost[n], lambda s: mix(s) if s < 150 else [3]
    )
    assert decisions[100:150].count(1) >= 45  # the stretch made length 1 the best
    assert decisions[150:].count(3) >= 35, decisions[150:]


def test_a_burst_whose_last_steps_had_no_requests_left_counts_the_others() -> None:
    # A burst's requests can all finish (EOS, max_tokens) before its last steps: those steps committed
    # nothing for anyone, and the steps before them still count.
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    gate.start_step(3)
    clock.now += 0.004
    gate.finish_burst([[1], [2], [2], []], [[3], [3], [3], []])
    keep = 1.0 - SMOOTHING  # three steps reached position 1, the last two passed it
    assert gate._acceptance.reached[1] == pytest.approx(keep * keep + keep + 1)
    assert gate._acceptance.passed[1] == pytest.approx(keep + 1)


@pytest.mark.parametrize("prefill", [True, False])
@pytest.mark.parametrize("neighbour_length", [2, 0])
@pytest.mark.parametrize("burst", [4, 1])
def test_a_burst_between_steps_that_take_prompts_in_is_measured(neighbour_length, burst, prefill) -> None:
    """Under a server's steady arrivals steps that take prompts in alternate with bursts (each launched
    behind the one before): a burst between two such steps is measured, its time split over its steps,
    whatever their length (the scheduler shortens a prompt-taking step's windows); a single step there
    is not, nor a burst between chunkless steps of another length."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    gate.start_step(neighbour_length, at=0.0, prefill=prefill)
    gate.start_step(2, at=0.1)  # launched behind the first
    clock.now = 1.0
    gate.finish_step([] if prefill else [1, 1])  # a step with a prefill chunk commits no measured tokens
    gate.start_step(neighbour_length, at=1.1, prefill=prefill)  # behind the burst
    clock.now = 5.0
    gate.finish_burst([[2, 1]] * burst, [[2, 2]] * burst)
    seconds = gate._tier(2).seconds
    # (A single step is measured only between chunkless neighbours of its length.)
    measured = (prefill or neighbour_length == 2) if burst > 1 else (not prefill and neighbour_length == 2)
    assert gate._tier(2).measured(2) == int(measured)
    if measured:
        assert seconds[2].value == pytest.approx((5.0 - 1.0) / burst)


def _burst_tokens(length: int, requests: int) -> list[list[int]]:
    """What each of a burst's 4 steps commits per request: 1 token, plus the draft for two requests in
    five when the burst drafts (each draft accepted with probability 0.4)."""
    return [[1 + (length > 0 and r % 5 < 2) for r in range(requests)]] * 4


def _alternating_calls(
    gate: SpeculationGate,
    clock: _Clock,
    requests: int,
    count: int,
    prepare_s: dict[int, float],
    complete_s: dict[int, float],
) -> list[int]:
    """`count` bursts of 4 steps alternating with steps that take prompts in, driven as the engine's
    overlapped calls run them where the host sets the pace: a call prepares and launches the next step
    or burst (prepare_s[n] seconds a burst of length n, prepare_s[-1] a prompt-taking step, whose
    windows draft nothing), then accepts and emits the one launched by the call before (complete_s, the
    same keys) and tells the gate; every draft is accepted with probability 0.4 (`_burst_tokens`).
    Returns the bursts' lengths."""
    lengths: list[int] = []
    in_flight: int | None = None  # the kind launched by the call before: a burst's length, -1 a prompt step
    for call in range(2 * count):
        length = gate.draft_length(requests)
        kind = length if call % 2 else -1
        began = clock.now
        clock.now += prepare_s[kind]
        gate.start_step(max(kind, 0), at=began, prefill=kind < 0)
        if kind >= 0:
            lengths.append(kind)
        if in_flight is not None:
            clock.now += complete_s[in_flight]
            if in_flight < 0:
                gate.finish_step([])
            else:
                gate.finish_burst(_burst_tokens(in_flight, requests), [[in_flight] * requests] * 4)
        in_flight = kind
    return lengths


def _lull_bursts(
    gate: SpeculationGate, clock: _Clock, requests: int, count: int, step_s: dict[int, float]
) -> list[int]:
    """`count` bursts of 4 steps back to back with no prompt waiting (each launched behind the one
    before), timed and accepted as in `_alternating_calls` (the last one too)."""
    lengths = []
    in_flight = None
    for _ in range(count + 1):
        length = gate.draft_length(requests)
        gate.start_step(length, at=clock.now)
        if in_flight is not None:
            clock.now += 4 * step_s[in_flight]
            gate.finish_burst(_burst_tokens(in_flight, requests), [[in_flight] * requests] * 4)
            lengths.append(in_flight)
        in_flight = length
    clock.now += 4 * step_s[in_flight]
    gate.finish_burst(_burst_tokens(in_flight, requests), [[in_flight] * requests] * 4)
    return lengths


def test_drafting_bursts_under_steady_arrivals_are_measured_where_the_prompt_steps_draft_nothing() -> None:
    """Session 47 (H100, 256 streams): through the server the serve default drafted in ~73% of its steps
    and ran 0.87x served plain decoding. In a lull drafting bursts paid (1.4 tokens in 1.2 ms a step
    against plain's 1 in 1.0); under steady arrivals they cost 2.0 ms a step. The prompt-taking steps
    between the bursts draft nothing (their windows shortened), so a drafting burst between them was
    never measured, and the gate followed its lull time for good; now it is re-measured there and the
    gate turns to plain bursts."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    requests = 200
    # (1.1 ms here: at 1.2 the lull's gain, 17%, is under the margin at this many requests)
    lull = _lull_bursts(gate, clock, requests, 40, {0: 0.0010, 1: 0.0011})
    assert lull[-20:].count(1) >= 15  # drafting pays in the lull (a probe of plain aside)
    # Under arrivals, a prompt-taking step (launched ahead) between bursts: 3 ms to accept it, a
    # burst's four steps 1.0 ms each plain, 2.0 drafting, the host's time all after the launches.
    served = _alternating_calls(
        gate, clock, requests, 120, dict.fromkeys((-1, 0, 1), 0.0), {-1: 0.003, 0: 0.004, 1: 0.008}
    )
    assert served[-60:].count(0) >= 50, served  # plain, but for a probe now and then
    rates = gate.rates(requests)
    assert rates[0] > rates[1]


def test_the_view_holds_each_tier_s_measured_times_choices_and_the_tokens_a_request() -> None:
    """`view()` (published as `dspark_spec_gate_*` gauges through `EngineLoad.gate`): per tier and
    length it measured or chose, the median step time, its measured and chosen steps, and the tokens a
    request commits (shared by the tiers)."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    assert gate.view() == ()
    accepted = _cycle({0: 50, 1: 50}, requests=8)
    _run_steps(gate, clock, 8, 40, lambda n: 0.002 if n else 0.001, accepted)
    rows = {(row["tier"], row["length"]): row for row in gate_rows(gate.view())}
    assert set(rows) == {(8, 0), (8, 1)}
    assert rows[8, 0]["step_seconds"] == pytest.approx(0.001)
    assert rows[8, 1]["step_seconds"] == pytest.approx(0.002)
    assert rows[8, 0]["chosen_steps"] + rows[8, 1]["chosen_steps"] == 40
    assert rows[8, 0]["measured_steps"] == rows[8, 0]["chosen_steps"]  # without overlap: every step
    assert rows[8, 0]["tokens_per_request"] == 1.0
    assert rows[8, 1]["tokens_per_request"] == pytest.approx(1 + gate._acceptance.chance(1, FIRST_PRIOR))


def test_a_burst_between_prompt_taking_steps_is_charged_its_own_preparation() -> None:
    """Under a server's steady arrivals, overlapped, the wall time a burst adds holds the preparation of
    the prompt-taking step launched behind it, and its own preparation lands in that step's time. A
    drafting burst's extra host work is mostly preparation (session 48, H100, 256 streams: 1.08 against
    0.63 ms of a step's host time before the launch, 0.70 against 0.60 after it): here a plain burst
    costs 1.6 ms to prepare and 2.4 ms to accept and emit (1.0 ms a step for 1 token a request), a
    drafting one 4.0 and 3.2 ms (1.8 ms a step for 1.4 tokens): plain is the faster. Charged the
    prompt step's preparation (1.0 ms) in place of its own, drafting looked faster (1.05 against 0.85 ms
    a step) and the gate drafted on ~80% of its steps at 0.94x served plain."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    requests = 200
    lengths = _alternating_calls(
        gate, clock, requests, 200, {-1: 0.0010, 0: 0.0016, 1: 0.0040}, {-1: 0.0005, 0: 0.0024, 1: 0.0032}
    )
    rates = gate.rates(requests)
    assert rates[0] == pytest.approx(requests / 0.0010)
    assert rates[1] < rates[0]
    assert lengths[-100:].count(0) >= 90, lengths


def test_a_warm_up_slower_than_later_steps_of_its_length_does_not_keep_it_losing() -> None:
    """A length's warm-up steps can run slow (its first runs at that shape; on the H100 plain decoding's
    warm-up steps at 128 requests took 2.5-2.7 ms, its later steps ~2.0): a losing length is re-measured
    only by probes, and a median over its slow warm-up times outvoted the probe. Here plain costs 1.6 ms
    a step in its warm-up and 1.0 ms afterwards, drafting 1.3 ms for 1.2 tokens a request: once a probe
    measures plain, it must win."""
    clock = _Clock()
    gate = SpeculationGate(3, clock)
    steps = collections.Counter()

    def prepare(length: int) -> float:
        steps["all"] += 1
        if length == 0:
            return 0.0016 if steps["all"] <= 4 * (WARM_UP_STEPS + RUN_EDGES) else 0.001
        return 0.0013

    accepted = _cycle({0: 80, 1: 20}, requests=128)
    decisions = _run_overlapped(gate, clock, 128, 900, prepare, accepted)
    assert gate.rates(128)[0] == pytest.approx(128 / 0.001)
    settled = decisions[-300:]
    assert settled.count(0) >= 0.9 * len(settled), "".join(map(str, decisions))


def test_a_probe_begun_beside_prefill_chunks_runs_until_its_length_is_measured() -> None:
    """Served, requests arrive all the time and many steps carry a prefill chunk (unmeasured, and so
    are their neighbours). A probe whose three steps met one ended unmeasured, and the losing length's
    estimate stood for another PROBE_INTERVAL steps a probe step: here a chunk comes every fourth step,
    and every probe must still measure its length."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    # Drafting (2 tokens a request for 1.5 ms) beats plain (1 token for 1 ms).
    _run_overlapped(
        gate,
        clock,
        4,
        1200,
        lambda n: 0.0015 if n else 0.001,
        lambda s: [1] * 4,
        prefill=lambda step: step % 4 == 0,
    )
    stats = gate._tiers[4]
    assert stats.probes >= 3
    # The warm-up's measured steps, then one for each probe but perhaps the last (still running).
    assert stats.measured(0) >= WARM_UP_STEPS + stats.probes - 1, (stats.measured(0), stats.probes)


def test_warm_up_times_give_way_to_two_later_faster_ones_not_to_one() -> None:
    """Under overlap a step timed right after a late-recorded finish reads short: one such time must
    not set a length's estimate alone. Two later times below a warm-up's drop it."""
    from dspark.spec.gate import _RecentMedian

    times = _RecentMedian()
    for value in (3.0, 3.1, 2.9):
        times.add(value, provisional=True)
    times.add(1.0)
    assert times.value == 2.9  # one fast time: the warm-up's still count
    times.add(3.05)  # 1.0 and 3.05 lie below 3.1 alone: it goes, 3.0 and 2.9 stay
    assert sorted(times.recent) == [(1.0, False), (2.9, True), (3.0, True), (3.05, False)]
    times.add(1.1)
    assert times.value == 1.1 and len(times.recent) == 3  # 1.0, 3.05, 1.1: the warm-up's are gone


def test_a_withdrawn_choice_is_no_try_of_its_length():
    """A step whose requests may verify no draft (each at its last token, or asking for none) runs
    plain whatever the gate chose as it was scheduled: withdrawn, such steps use up none of the
    warm-up's tries, and the longest length is still tried first once drafting is possible."""
    clock = _Clock()
    gate = SpeculationGate(1, clock)
    for _ in range(4 * WARM_UP_TRIES * (WARM_UP_STEPS + RUN_EDGES)):
        assert gate.draft_length(4) == 1
        gate.withdraw()
        gate.start_step(0, prefill=True)
        clock.now += 0.001
        gate.finish_step([])
    assert gate.draft_length(4) == 1


def test_the_engine_tells_the_gate_each_request_s_counts_as_it_ends(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    """Each request that ends (finished or aborted) hands the gate its own per-position counts, the
    spread a later draining batch is judged by."""
    config = tiny_engine_config(tiny_target_dir, tiny_drafter_dir, device="cpu")
    llm = LLM(config.replace(adaptive_speculation=True))
    told: list[tuple[list[int], list[int]]] = []
    real = llm.engine.gate.request_finished

    def record(verified, accepted) -> None:
        told.append((list(verified), list(accepted)))
        real(verified, accepted)

    llm.engine.gate.request_finished = record  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = llm.generate(params=params, prompt_token_ids=[[1, 2, 3], [4, 5]])
    stats = [o.spec_stats for o in outs]
    assert sorted(told) == sorted((s.verified_per_position, s.accepted_per_position) for s in stats)


def test_the_engine_hands_the_gate_a_batch_s_progress_only_while_it_runs_to_its_end(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    """Prompts of one `generate()` (one wave) with none waiting: the gate gets each decoding request's
    tokens left and per-position counts, once every prompt is in; while prompts wait for seats, or once
    a request has come later than the rest (a server's requests come and go), it gets none."""
    config = tiny_engine_config(tiny_target_dir, tiny_drafter_dir, device="cpu", max_num_seqs=2)
    llm = LLM(config.replace(adaptive_speculation=True))
    engine = llm.engine
    seen: list[tuple[int, list | None]] = []
    real_decide = engine.gate.draft_length

    def decide(num_requests: int, draining=None) -> int:
        seen.append((num_requests, None if draining is None else list(draining())))
        # Nor is the gate asked while such a batch takes its prompts in (no length is timed then).
        assert draining is None or not any(s.in_prefill for s in engine.scheduler.running)
        return real_decide(num_requests, draining)

    engine.gate.draft_length = decide  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate(params=params, prompt_token_ids=[[1, 2, 3], [4, 5], [6, 7, 1], [2, 2]])
    # Two seats: the first two decode while the others wait, then the last two run to their end (one
    # request decoding alone is handed nothing: its own pace is the batch's).
    assert any(d is None for _, d in seen) and any(d is not None for _, d in seen)
    assert all(d is None for n, d in seen if n < 2)
    for num_requests, progress in seen:
        if progress is not None:
            assert len(progress) == num_requests
            assert all(0 < left <= 12 and len(v) == len(a) for left, v, a in progress)
    handed = [sum(left for left, _, _ in d) for _, d in seen if d is not None]
    assert all(a > b for a, b in zip(handed, handed[1:], strict=False)), handed  # as the requests move on
    # Each request's own per-position counts (they are the ones its output reports).
    last_two = [o.spec_stats for o in outs[2:]]
    first = next(d for _, d in seen if d is not None)
    assert [(v, a) for _, v, a in first] == [
        (s.verified_per_position, s.accepted_per_position) for s in last_two
    ]
    # A request that comes while others run: none is handed over until the earlier ones are done.
    seen.clear()
    for name in ("early", "early too"):
        engine.add_request(name, [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(2 * WAVE_STEPS):
        engine.step()
    assert any(n == 2 and d is not None for n, d in seen)  # the two of one wave
    seen.clear()
    engine.add_request("late", [4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # Two seats: it waits, then runs beside a request of the earlier wave; nothing is handed over.
    assert any(n == 2 for n, _ in seen) and all(d is None for _, d in seen)
