"""SpeculationGate: how many drafts a step verifies, chosen by the speed of earlier steps (0: none).

Whether speculation pays, and with how long a verify window, depends on the machine, the model, the
drafter's acceptance and the batch: on a small model at a large batch, drafting and verifying cost more
than the extra tokens bring; on a CPU whose BLAS runs a window of 4 rows at 1.6x the cost of one, a
window of 2 can pay where 4 loses. The gate estimates, per power-of-two count of decoding requests (a tier)
and per draft length (0 = plain, then powers of two below the block size, then the block size), the
committed tokens per second of a decode-only step with that length, and picks the fastest (plain
decoding unless a drafting length beats it by `draft_margin`: 10% at one request, 20% from 8). The two
halves of that rate are measured apart:

- seconds, per tier: the median wall time of the latest steps run with that length (a median, not a
  mean: the host's pauses, a garbage collection or a descheduled thread of tens of milliseconds, land
  in single steps; one of them in a moving average made a length look twice its cost until ~15 more
  of its steps were timed, and a losing length is timed only by the occasional probe, so a choice made
  on one pause could stand for thousands of steps: the likely reason, not yet confirmed there, why the
  serve default at 128 requests ran 0.72x plain decoding offline on the H200); a warm-up's times
  are provisional, dropped once two later steps of the length ran faster (a losing length is re-timed
  only by probes, and its slow first steps at a shape outvoted them);
- tokens, shared by the tiers (acceptance is the drafter's and the requests', not the batch's): 1 +
  the sum over positions k <= length of the chance that drafts 1..k are all accepted, the product of
  each position's chance given the ones before it, each from the requests that reached and passed that
  position in every step that verified it (older steps fading; a position a step did not verify
  fades too, more slowly the more requests the step had), plus PRIOR_REQUESTS requests' worth of
  a prior: the chance of the position before it (the first position's: FIRST_PRIOR). A step that
  verified L drafts so says what every shorter length would have committed (acceptance stops at the
  first rejected draft, whatever follows), so the lengths are compared on the same steps' acceptance,
  and a longer length that is not being run keeps the fresh chances of the positions it shares with
  the one that is. (Averaging each step's own tokens per second instead let one request's 1 to 4
  tokens a step decide between lengths a few percent apart.) Without the prior a position that no
  request had reached counted as never accepted: at one request, where a warm-up of three steps a
  length sees three requests, a warm-up whose first drafts were all rejected (an answer's first
  tokens are the hardest to draft) rated the longer lengths no better than the first, and probes,
  one step of a losing length in ~100, seldom reached their later positions again: through the
  server on this project's CPU the serve default then verified 0.6 drafts a request a step against
  the offline engine's 1.9, and committed 1.13 tokens a step against 1.51.

A step's time is measured only where it tells its own length's cost: with overlap scheduling the wall
time a step adds (from the finish of the one before it to its own, a finish counted once the step's
tokens are emitted) holds the host's preparation of the step launched behind it, not its own (made while
the step before ran), so that preparation is swapped for the step's own (`start_step` times each); the
device's time, which overlaps them, is not split that way, so a step is still measured only between
neighbours of its own length that carry no prefill chunk (a burst of steps: between neighbours each of
its length or carrying a prefill chunk, whatever its length). (Timing every step, a probe of plain
decoding between drafting steps was charged the drafting step's preparation, and the drafting step
before it plain's: where the host sets the pace, a losing length looked as fast as the winner and the
gate kept drafting at batch 128-256 on the H200, 0.66-0.81x plain decoding offline.) A step prepared
after the one before it finished (no overlap) is measured alone, if no step was launched behind it.

A warm-up tries each length in the first tier, longest first, until it has a few measured steps (three
in a row without overlap, five with it: the first and last of a run are not measured), and then in
every later tier until it has two (the acceptance is known by then, only the step times are new:
served, the request count moves between tiers as requests come and go, and a full warm-up in each was
most of a short run). A probe re-measures a losing length now and then, in turn, for as many steps in
a row as it takes to measure it once (counting again after a step with a prefill chunk, up to a
bound), and the next comes PROBE_INTERVAL steps later for each step it needs (probes of 3 steps under
overlap, as often as those of 1 step, would run 3x the losing steps), PROBE_BACKOFF times later where the
probe found its length clearly behind (PROBE_CLEAR_LOSS). Plain decoding unmeasured in a tier where a drafting
length would be chosen is probed at once (unmeasured lengths first), so that no drafting choice stands
without the margin's comparison.

A warm-up or probe run keeps its length across neighbouring tiers (a tier's own steps interleaved with
another's would never be neighbours), and ends where the request count jumps further (a new batch after
the last requests of one: it would be measured in its own tier only, and ran on into the new batch);
a choice counts once its step starts (a launch given up and tried again asks twice).
A step that carries a prefill chunk is not measured (the chunk's cost is not the length's): a warm-up
length goes on being chosen, up to a bound, until it is measured, so that under served load, where
requests arrive one by one and many steps carry a chunk, no length stays unmeasured (and so never
chosen) after the warm-up.

A batch that runs to its end (`draining`: two or more decoding requests, every running one came in one
wave and none waits, as in an offline `generate()` of a list of prompts) is done when its last request
is, and a request that ends
early frees a seat no one takes: what counts there is how fast the batch's end comes, not the mean
tokens a step. Drafting spreads the requests' progress (each request's acceptance is its own: the
prompt, the kind of text), so the batch's end comes at the pace of the requests it drafts worst for.
There, a length is rated by when the batch would end running it: each request's steps from its own
acceptance per position (its counts, with DRAIN_PRIOR_STEPS steps' worth of the shared chances added: a
request few steps measured counts as the mean, not as the worst its few steps happened to show), the
batch running its slowest request's steps, each at the measured time of a step of as many requests as
still run then (a batch that drafts thins out as its fast requests end, and its last steps cost what a
smaller tier's do). While a request's own counts are few, the prior's share of its estimate is taken
not at the mean but at a quantile of the spread finished requests showed (`request_finished`: the
lowest-rated request of N at their 1/(2N) quantile, the next at 3/(2N), ...): the batch's first steps
know nothing of its own requests, yet its end comes at the pace of the worst of them. The margin is
then DRAFT_MARGIN at every request count (the batch's end is in the estimate). The engine does not
ask the gate while such a batch still takes its prompts in (`LLMEngine._window_of`: plain steps; a
probe begun there drafts through the whole intake). (H100, SmolLM2, 64 requests of 128 tokens: the
mean rated drafting 11-17% ahead, a batch run to its end drafting took 1.16x plain's time; its
slowest request committed 1.54 tokens a step against a mean near 1.9.)

Lossless: the decision reads only the wall times and token counts of earlier steps, never this step's
drafts, and every length gives a lossless step. (A seeded sampling request keeps its distribution, but
which steps speculated, and so its exact stream, then depends on timing.)
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from dspark.runner.cuda_graphs import next_pow2

WARM_UP_STEPS = 3  # measured steps of each length in the first tier before the averages decide
LATER_TIER_WARM_UP_STEPS = 2  # the same in every later tier (the acceptance is shared, known already;
# two: the lower of two times is right unless both met a pause)
RUN_EDGES = 2  # unmeasured steps of a run of one length under overlap: its first and its last
WARM_UP_TRIES = 3  # most warm-up choices of a length per tier, measured or not, in measured steps' worth
PROBE_INTERVAL = 32  # a tier probes a losing length after this many steps per step of its last probe
# A probe that finds its length clearly behind the tier's choice (its rate under PROBE_CLEAR_LOSS of the
# chosen length's) puts the next probe off PROBE_BACKOFF times as long. A probe costs more than its own
# steps where a batch runs to its end: its drafting steps spread the requests' progress, and the batch
# then waits for the last one (H100, 64 requests of 128 tokens, where a drafting step cost 1.6x a plain
# one: the serve default ran 0.77x plain decoding though its gate rated plain 10% ahead; at 32 steps a
# probe step, a run of 128 tokens in bursts of 4 met a probe of 12 steps).
PROBE_CLEAR_LOSS = 0.8
PROBE_BACKOFF = 4
PROBE_MOST_STEPS = 1 + RUN_EDGES  # a probe runs until its length is measured once, at most this long
# (in steps in a row without a prefill chunk, which cannot be measured nor let their neighbours be: a
# probe begun as requests arrive would end unmeasured; at most PROBE_PREFILL_BOUND times as many in all)
PROBE_PREFILL_BOUND = 4
SMOOTHING = 0.05  # weight of the newest step in each moving average, once it has 1 / SMOOTHING steps
RECENT_STEPS = 9  # step times a length's median is taken over, per tier
PRIOR_REQUESTS = 2.0  # requests' worth of prior added to each position's acceptance counts
FIRST_PRIOR = 0.5  # the prior chance of the first draft
# A drafting length is chosen over plain decoding only where its estimated rate beats plain's by a
# margin (`draft_margin`). The rate is the batch's mean tokens a step; drafting also spreads the steps
# requests need (each request's acceptance is its own: on 64 of the bench prompts, 128 tokens, 51-87
# steps), and a batch that does not refill waits for its slowest request, the more of them the further
# below the mean. Measured (H100, SmolLM2, 128 tokens, a batch run to its end), the gate's rates against
# what drafting ran: 8 requests +29% / +26% -> 1.07x / 1.08x plain, 16: +15% / +30% -> 1.00x / 1.09x,
# 64: +3% / +11% / +12% -> 0.87x / 0.90x / 0.96x, 128: +20% -> 1.02x (sessions 57 and 59), so from 8
# requests up the batch's end cost 15-23% of the estimate; at one request none (+34% -> 1.37x).
DRAFT_MARGIN = 0.10  # at one request: the estimates' noise, near a tie plain decoding is the safe side
BATCH_DRAFT_MARGIN = 0.20  # from BATCH_MARGIN_REQUESTS requests up; between, by log2 of the count
BATCH_MARGIN_REQUESTS = 8
DRAIN_PRIOR_STEPS = 32.0  # steps' worth of the shared chances added to a request's own (draining): a
# request's counts weigh as much as the shared chances once it verified 32 steps. Fewer made the
# estimate pessimistic, the batch's end taken at the worst of many requests' noisy early counts (a
# simulation of batches run to their end, `benchmarks/results/cpu-2026-12-07-s60/gate_batch_sim.py`: at
# 4 steps' worth, 64 requests decoded plainly where drafting gained 11%; at 32, within ~3% of the best
# fixed length or of plain decoding in most cases, and never slower than plain).
# A draining batch's first steps know nothing of its own requests (each is the shared mean until its
# own steps say otherwise, DRAIN_PRIOR_STEPS), yet its end comes at the pace of the worst of them: the
# spread of the requests' acceptance is taken from requests that finished before (the latest
# HISTORY_REQUESTS that verified at least HISTORY_LEAST_STEPS first drafts; none before HISTORY_LEAST of
# them): their own tokens a step over the shared estimate, the lowest-rated of N requests at their
# 1/(2N) quantile, the next at 3/(2N), ..., giving way to the batch's own counts as they come in (H200,
# SmolLM2, 64 requests of 128 tokens: rated from the mean, drafting led plain by 23% and ran 0.85x
# plain; on the CPU the slowest of those requests committed 1.47 tokens a step at 3 drafts, the mean 1.82).
HISTORY_REQUESTS = 256
HISTORY_LEAST = 16
HISTORY_LEAST_STEPS = 8
HISTORY_PRIOR_STEPS = 16.0  # steps' worth of the shared chances added to a finished request's counts:
# a request's counts hold its own luck too, which widens the spread past the requests' true one (at 4
# steps' worth the simulation drafted 3-6% too little where acceptance was high)
DRAIN_REFRESH = 8  # choices between two computations of a draining batch's tokens a step (a pass over
# its requests per length: ~3 us a request on this project's CPU, 0.2 ms at 64 requests and 0.8 at 256,
# a burst's host time being ~3.6 and ~5 ms there on an H100)

# Per running request of a draining batch: the tokens it may still commit, and per draft position
# (0-based) how many of its steps verified a draft there and how many accepted it
# (`dspark.outputs.SpecStats`'s per-position counts).
RequestProgress = tuple[int, Sequence[int], Sequence[int]]


def draft_margin(num_requests: int) -> float:
    """The share by which drafting's estimated rate must beat plain decoding's for this many decoding
    requests: DRAFT_MARGIN at one, BATCH_DRAFT_MARGIN from BATCH_MARGIN_REQUESTS up, by log2 between."""
    reach = math.log2(max(num_requests, 1)) / math.log2(BATCH_MARGIN_REQUESTS)
    return DRAFT_MARGIN + (BATCH_DRAFT_MARGIN - DRAFT_MARGIN) * min(1.0, reach)


def draft_lengths(block_size: int) -> tuple[int, ...]:
    """The lengths a gate chooses among for this block size: 0, the powers of two below it, itself."""
    lengths = [0]
    n = 1
    while n < block_size:
        lengths.append(n)
        n *= 2
    return (*lengths, block_size) if block_size > 0 else (0,)


def _tokens_by_length(chances: Sequence[float]) -> list[float]:
    """Per length 0..len(chances) (the index), the tokens a request commits in a step of that length:
    1 + the sum over positions k <= length of the chance that drafts 1..k are all accepted (the
    product of each position's chance given the ones before it, `chances`)."""
    tokens, survival, out = 1.0, 1.0, [1.0]
    for chance in chances:
        survival *= chance
        tokens += survival
        out.append(tokens)
    return out


def _own_tokens(
    verified: Sequence[int], accepted: Sequence[int], chances: Sequence[float], prior_steps: float
) -> list[float]:
    """`_tokens_by_length` of one request, each position's chance from its own counts with
    `prior_steps` steps' worth of the shared `chances` added."""
    own, before = [], -1
    for k, chance in enumerate(chances):
        reached = verified[k] if k < len(verified) else 0
        if k:  # a position is reached where every draft before it was accepted
            reached = min(reached, before)
        before = accepted[k] if k < len(accepted) else 0
        own.append((before + chance * prior_steps) / (reached + prior_steps))
    return _tokens_by_length(own)


class _RecentMedian:
    """The lower median of the latest RECENT_STEPS values (of two, the smaller): robust to a value far
    off now and then, and following a lasting change within a few values. Values from a warm-up are
    provisional: two later values below one displace it (see `add`)."""

    __slots__ = ("count", "recent", "value")

    def __init__(self) -> None:
        self.count = 0
        self.recent: collections.deque[tuple[float, bool]] = collections.deque(maxlen=RECENT_STEPS)
        self.value = 0.0

    @property
    def settled(self) -> bool:
        """Whether none of the latest values is a warm-up's, still provisional."""
        return not any(p for _, p in self.recent)

    def add(self, value: float, provisional: bool = False) -> None:
        """One more value; `provisional`: measured in a warm-up. A provisional value is dropped once two
        later values that are not lie below it: a warm-up step slower than later steps of its length
        measured the warm-up (the length's first runs at that shape, right after the engine started or
        the batch changed), not the length. Two, not one: a step's time mostly errs long (a pause, the
        host's other work), but under overlap the step after a late-recorded finish reads short. A
        losing length is re-measured only by probes, one in hundreds of steps: its warm-up steps, on
        the H100 1.2-1.5x the later steps of plain decoding, stood against the winner's fresh ones and
        kept the serve default drafting at 128 requests, 0.80x plain."""
        self.count += 1
        if not provisional:
            later = sorted([value, *(v for v, p in self.recent if not p)])
            # A provisional value above the second smallest later one has two below it.
            if len(later) >= 2 and any(p and v > later[1] for v, p in self.recent):
                kept = [(v, p) for v, p in self.recent if not (p and v > later[1])]
                self.recent.clear()
                self.recent.extend(kept)
        self.recent.append((value, provisional))
        ordered = sorted(v for v, _ in self.recent)
        self.value = ordered[(len(ordered) - 1) // 2]


class _Acceptance:
    """Per draft position, how many requests reached it (their drafts before it were accepted) and
    passed it (it was accepted too), summed over the steps that verified it with the older steps'
    counts fading (each step keeps 1 - SMOOTHING of the sums before it)."""

    def __init__(self) -> None:
        self.reached: dict[int, float] = collections.defaultdict(float)
        self.passed: dict[int, float] = collections.defaultdict(float)

    def add(self, position: int, reached: int, passed: int) -> None:
        """One step's counts at a position it verified."""
        keep = 1.0 - SMOOTHING
        self.reached[position] = keep * self.reached[position] + reached
        self.passed[position] = keep * self.passed[position] + passed

    def fade(self, positions: range, rate: float) -> None:
        """Fade these positions' counts by `rate` (positions a step did not verify)."""
        keep = 1.0 - rate
        for position in positions:
            if position in self.reached:
                self.reached[position] *= keep
                self.passed[position] *= keep

    def chance(self, position: int, prior: float) -> float:
        """The chance a request that reached this position passes it: its counts with PRIOR_REQUESTS
        requests' worth of `prior` added (a position few steps reached, or none, is judged mostly by
        the prior, rather than as one never accepted)."""
        reached = self.reached.get(position, 0.0)
        passed = self.passed.get(position, 0.0)
        return (passed + PRIOR_REQUESTS * prior) / (reached + PRIOR_REQUESTS)

    def chances(self, length: int) -> list[float]:
        """Each position's chance up to `length` (`chance`), a position's prior the chance of the one
        before it, the first one's FIRST_PRIOR."""
        chances, chance = [], FIRST_PRIOR
        for position in range(1, length + 1):
            chance = self.chance(position, chance)
            chances.append(chance)
        return chances

    def tokens_per_request(self, length: int) -> float:
        """Tokens a request commits in a step of this length (`_tokens_by_length` of `chances`)."""
        return _tokens_by_length(self.chances(length))[length]

    def tokens_by_length(self, longest: int) -> list[float]:
        """`tokens_per_request` of every length up to `longest` (the index), from one pass."""
        return _tokens_by_length(self.chances(longest))


@dataclass
class _TierStats:
    """One tier's step seconds per draft length, the measured steps each length needs before its warm-up
    ends, and how many steps of each length it chose."""

    warm_up: int
    size: int = 1  # its request counts' power of two
    seconds: dict[int, _RecentMedian] = field(default_factory=lambda: collections.defaultdict(_RecentMedian))
    chosen: collections.Counter = field(default_factory=collections.Counter)
    steps: int = 0
    next_probe: int = PROBE_INTERVAL  # the step count at which the next probe starts
    probes: int = 0

    def measured(self, length: int) -> int:
        """How many steps of this length were measured (without adding the length to `seconds`)."""
        return self.seconds[length].count if length in self.seconds else 0

    def rate(self, length: int, num_requests: int, tokens_per_request: float) -> float:
        """Committed tokens per second of a step of this length whose requests commit these many tokens
        each (0.0 until its time is measured)."""
        if not self.measured(length):
            return 0.0
        return tokens_per_request * num_requests / max(self.seconds[length].value, 1e-9)


@dataclass
class _Run:
    """One length chosen for steps in a row, whatever their tier (a step is measured only between
    neighbours of its length, and a batch's request count can move between tiers from one step to the
    next), until `tier` has `target` measured steps of it or the run has started `most` steps: a
    warm-up (target: the tier's warm-up) or a probe of a losing length (target: one more)."""

    tier: _TierStats
    length: int
    target: int
    most: int
    probe: bool
    steps: int = 0  # steps started (a probe's: in a row without a prefill chunk, since the last with one)
    started: int = 0  # steps started, all

    def going(self) -> bool:
        if self.probe and self.started >= PROBE_PREFILL_BOUND * self.most:
            return False
        return self.steps < self.most and self.tier.measured(self.length) < self.target


@dataclass(frozen=True)
class _Launched:
    """A launched step, until it finishes: when its preparation began, its length, whether it
    carries a prefill chunk, whether a warm-up chose it (its time is then provisional) and how long its
    preparation took (from `began` to its launch)."""

    began: float
    length: int
    prefill: bool
    warm_up: bool = False
    prepared: float = 0.0

    @property
    def kind(self) -> tuple[int, bool]:
        return self.length, self.prefill


class SpeculationGate:
    """Decides, step by step, how many drafts a step verifies (see the module docstring)."""

    def __init__(self, block_size: int, clock: Callable[[], float] = time.perf_counter) -> None:
        """block_size: the longest length (the engine's block); clock: seconds, monotonic (tests pass
        their own)."""
        self.lengths = draft_lengths(block_size)
        self.clock = clock
        self._tiers: dict[int, _TierStats] = {}
        self._acceptance = _Acceptance()
        # The steps launched and not yet finished, oldest first (with overlap scheduling a step is
        # launched before the one before it is accepted); the finish and the kind of the last finished.
        self._started: collections.deque[_Launched] = collections.deque()
        self._last_finish = float("-inf")
        self._last_kind: tuple[int, bool] | None = None
        self._run: _Run | None = None
        self._choice: tuple[_TierStats, int] | None = None  # the last choice, until its step starts
        # A draining batch's tokens a request a step per length, and the choices left until recomputed.
        self._drain_tokens: dict[int, float] | None = None
        self._drain_age = 0
        # Finished requests' own tokens a step per drafting length, over the shared estimate then: the
        # spread a draining batch's end is judged by (`request_finished`, HISTORY_REQUESTS).
        self._finished: collections.deque[dict[int, float]] = collections.deque(maxlen=HISTORY_REQUESTS)
        self._ratios: dict[int, list[float]] = {}  # per length, the finished requests' ratios sorted

    def draft_length(
        self, num_requests: int, draining: Callable[[], Iterable[RequestProgress]] | None = None
    ) -> int:
        """How many drafts a step with this many decoding requests verifies at most (0: a plain step).
        `draining`: given when the batch runs to its end (see the module docstring), its requests'
        progress, read only when a drafting length leads. The choice counts once its step starts
        (`start_step`): a launch given up and tried again asks again."""
        stats = self._tier(num_requests)
        if draining is None:
            self._drain_tokens = None
        run = self._run
        # A run goes on across neighbouring tiers (a served batch's count moves to and fro across a tier's
        # edge), not across a jump: a warm-up begun in a small tier as a batch's last requests ended would
        # be measured in its own tier only, and ran on, drafting, into the next batch's first steps at 8
        # requests, where drafting lost (this CPU, a batch of 8 after one: 11 steps of it).
        if run is not None and (
            not run.going() or max(run.tier.size, stats.size) > 2 * min(run.tier.size, stats.size)
        ):
            if run.probe:
                # Spaced by the steps a probe needs, not by those chunks added (a probe slowed by them
                # would put off the next by up to PROBE_PREFILL_BOUND times as long).
                interval = PROBE_INTERVAL * min(max(run.started, 1), run.most)
                if self._clearly_behind(run.tier, run.length, num_requests):
                    interval *= PROBE_BACKOFF
                run.tier.next_probe = run.tier.steps + interval
            run = self._run = None
        if run is None:
            run = self._run = self._warm_up(stats)
        if run is not None:
            length = run.length
        else:
            length = self._fastest(stats, num_requests, draining)
            # Drafting with plain decoding unmeasured in this tier (its warm-up steps all carried a
            # prefill chunk or sat at a run's edge) is a choice the margin never judged: plain is
            # probed now, until measured (H100, 64 requests after three runs: the gate drafted most
            # steps with no plain time in the tier).
            unjudged = length != 0 and not stats.measured(0)
            if unjudged or stats.steps >= stats.next_probe:
                losers = [n for n in self.lengths if n != length]
                stats.probes += 1
                unmeasured = [n for n in losers if not stats.measured(n)]
                length = unmeasured[0] if unmeasured else losers[stats.probes % len(losers)]
                self._run = _Run(stats, length, stats.measured(length) + 1, PROBE_MOST_STEPS, probe=True)
                stats.next_probe = stats.steps + PROBE_INTERVAL  # moved on when the probe ends
        self._choice = (stats, length)
        return length

    def _fastest(
        self,
        stats: _TierStats,
        num_requests: int,
        draining: Callable[[], Iterable[RequestProgress]] | None = None,
    ) -> int:
        """The length of the highest estimated rate in this tier, plain decoding unless a drafting
        length beats it by `draft_margin` (`draining`: by the batch's end, see the module docstring)."""
        mean = self._acceptance.tokens_by_length(self.lengths[-1])
        rates = {n: stats.rate(n, num_requests, mean[n]) for n in self.lengths}
        best = max(self.lengths, key=rates.__getitem__)
        if best == 0 or not stats.measured(0):
            return best
        margin = draft_margin(num_requests)
        if draining is not None:
            tokens = self._draining_tokens(stats, draining)
            if tokens is not None:
                rates = {n: stats.rate(n, num_requests, tokens[n]) for n in self.lengths}
                best = max(self.lengths, key=rates.__getitem__)
                margin = DRAFT_MARGIN
        if best != 0 and rates[best] < (1.0 + margin) * rates[0]:
            return 0
        return best

    def _draining_tokens(
        self, stats: _TierStats, draining: Callable[[], Iterable[RequestProgress]]
    ) -> dict[int, float] | None:
        """Per length, the tokens a request a step at this tier's step time that bring a draining batch's
        end as soon as the batch would reach it running that length to its end; recomputed every
        DRAIN_REFRESH choices; None when no request has tokens left or plain decoding is unmeasured here.

        The end: each request's steps from its own acceptance (its counts with DRAIN_PRIOR_STEPS steps'
        worth of the shared chances), spread as finished requests' were while its own counts are few
        (`_spread`); the batch runs its slowest request's steps, each at the time of a step of as many
        requests as still run then (their tier's measured time, this tier's where unmeasured)."""
        if self._drain_tokens is not None and self._drain_age > 0:
            self._drain_age -= 1
            return self._drain_tokens
        if not stats.measured(0):
            return None
        chances = self._acceptance.chances(self.lengths[-1])
        shared = _tokens_by_length(chances)
        own: list[tuple[int, float, list[float]]] = []  # tokens left, counts' weight, tokens a step
        for remaining, verified, accepted in draining():
            if remaining > 0:
                first = verified[0] if verified else 0
                weight = first / (first + DRAIN_PRIOR_STEPS)
                own.append((remaining, weight, _own_tokens(verified, accepted, chances, DRAIN_PRIOR_STEPS)))
        self._drain_age = DRAIN_REFRESH - 1
        if not own:
            self._drain_tokens = None
            return None
        left = sum(remaining for remaining, _, _ in own)
        here = {n: stats.seconds[n].value for n in self.lengths if stats.measured(n)}
        tokens = {}
        for n in self.lengths:
            if n not in here:
                tokens[n] = 0.0
                continue
            if n:
                spread = self._spread([t[n] for _, _, t in own], len(own), n)
                # The prior's share of each estimate (the shared mean) taken at its quantile instead.
                steps = [
                    remaining / max(1.0, mine[n] + (1.0 - weight) * shared[n] * (spread[i] - 1.0))
                    for i, (remaining, weight, mine) in enumerate(own)
                ]
            else:
                steps = [float(remaining) for remaining, _, _ in own]
            seconds = self._drain_seconds(steps, n, here)
            tokens[n] = left / seconds * here[n] / len(own)
        self._drain_tokens = tokens
        return tokens

    def _spread(self, estimates: list[float], count: int, length: int) -> list[float]:
        """Per request (in `estimates`' order), the share of its estimate its acceptance comes to while
        its own counts are few: finished requests' own tokens a step at this length over the shared
        estimate, at the quantile of its rank among these requests' estimates (the lowest estimate the
        lowest quantile); all 1.0 before HISTORY_LEAST requests finished."""
        history = self._finished
        if len(history) < HISTORY_LEAST:
            return [1.0] * count
        ratios = self._ratios.get(length)
        if ratios is None:  # sorted once until the next request finishes
            ratios = self._ratios[length] = sorted(h[length] for h in history)
        order = sorted(range(count), key=estimates.__getitem__)
        spread = [1.0] * count
        for rank, i in enumerate(order):
            spread[i] = ratios[min(len(ratios) - 1, int((rank + 0.5) / count * len(ratios)))]
        return spread

    def _drain_seconds(self, steps: list[float], length: int, here: dict[int, float]) -> float:
        """Seconds until the last of these requests' steps at this length (each its own count of steps),
        each step at the time of a step of the requests still running then: their tier's measured
        median; where that tier measured plain decoding only, its plain time times this tier's ratio
        of the length's time to plain's (`here`: this tier's times); where neither, this tier's."""
        seconds, done = 0.0, 0.0
        running = len(steps)
        times: dict[int, float] = {}  # per tier, its step time at this length
        for count in sorted(steps):
            if count > done:
                size = next_pow2(running)
                step = times.get(size)
                if step is None:
                    tier = self._tiers.get(size)
                    if tier is not None and tier.measured(length):
                        step = tier.seconds[length].value
                    elif tier is not None and tier.measured(0):
                        step = tier.seconds[0].value * here[length] / here[0]
                    else:
                        step = here[length]
                    times[size] = step
                seconds += (count - done) * step
                done = count
            running -= 1
        return max(seconds, 1e-9)

    def request_finished(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """A request ended, having verified and accepted these many drafts per position (`SpecStats`'s
        counts): its own tokens a step per drafting length join the spread draining batches are judged
        by (HISTORY_REQUESTS), if it drafted enough to say."""
        if len(self.lengths) < 2 or not verified or verified[0] < HISTORY_LEAST_STEPS:
            return
        chances = self._acceptance.chances(self.lengths[-1])
        own = _own_tokens(verified, accepted, chances, HISTORY_PRIOR_STEPS)
        shared = _tokens_by_length(chances)
        self._finished.append({n: own[n] / shared[n] for n in self.lengths[1:]})
        self._ratios.clear()

    def _clearly_behind(self, stats: _TierStats, length: int, num_requests: int) -> bool:
        """Whether `length`'s estimated rate in this tier is under PROBE_CLEAR_LOSS of the rate of the
        length the tier would choose now, on times of its own that no warm-up's provisional one is among
        (False until both are measured: a slow warm-up is displaced only by the probes' times)."""
        if length not in stats.seconds or not stats.seconds[length].settled:
            return False
        chosen = self._fastest(stats, num_requests)
        tokens = self._acceptance.tokens_per_request
        probed = stats.rate(length, num_requests, tokens(length))
        best = stats.rate(chosen, num_requests, tokens(chosen))
        return chosen != length and 0.0 < probed < PROBE_CLEAR_LOSS * best

    def withdraw(self) -> None:
        """Forget the last choice: the step about to start verifies no drafts whatever was chosen (no
        request in it may), and counts as a plain step of no run."""
        self._choice = None

    def _warm_up(self, stats: _TierStats) -> _Run | None:
        """A warm-up run of the tier's longest length short of its measured steps, if any."""
        tries = WARM_UP_TRIES * (stats.warm_up + RUN_EDGES)
        for length in reversed(self.lengths):  # longest first
            if stats.measured(length) < stats.warm_up and stats.chosen[length] < tries:
                return _Run(stats, length, stats.warm_up, tries - stats.chosen[length], probe=False)
        return None

    def start_step(self, length: int, at: float | None = None, prefill: bool = False) -> None:
        """Mark the launch of an engine step that verified up to `length` drafts (0: plain), whose
        preparation began `at` (the clock's time; None: now) and ends now, once its work is queued on
        the device, with a prefill chunk or not. Each launched step is finished, in launch order."""
        choice, self._choice = self._choice, None
        warm_up = False
        if choice is not None:
            stats, chosen = choice
            stats.steps += 1
            run = self._run
            if run is not None and run.length == chosen:
                run.started += 1
                # A probe's step is measured between neighbours of its length without a chunk: after a
                # chunk it counts its steps in a row again.
                run.steps = 0 if run.probe and prefill else run.steps + 1
                stats = run.tier  # a run's steps count as its tier's tries
                warm_up = not run.probe and length == chosen
            stats.chosen[chosen] += 1
        now = self.clock()
        began = now if at is None else at
        self._started.append(_Launched(began, length, prefill, warm_up, max(now - began, 0.0)))

    def finish_step(self, committed: Sequence[int], verified: Sequence[int] | None = None) -> None:
        """Record the oldest launched step, finished: the tokens each of its decoding requests committed
        (empty for a step with prefill chunks: their cost would skew the step's time) and, where known,
        the drafts each verified (None: the step's length each). Its time is from its launch, or from
        the finish of the step before when that came later (steps overlap): the wall time it added,
        measured only between neighbours like it (see the module docstring)."""
        self.finish_burst([committed], None if verified is None else [verified])

    def finish_burst(
        self, committed: Sequence[Sequence[int]], verified: Sequence[Sequence[int]] | None = None
    ) -> None:
        """`finish_step` of a burst of steps launched as one (`start_step` once, `dspark.engine.burst`):
        per step, the tokens each decoding request committed (and the drafts each verified). Its wall
        time, split evenly among its steps, is measured as one step of its length (a burst's steps share
        the host's work once); each step's tokens count towards the acceptance."""
        now = self.clock()
        step = self._started.popleft() if self._started else None
        previous, self._last_finish = self._last_finish, now
        before, self._last_kind = self._last_kind, (step.kind if step is not None else None)
        if step is None or not committed or not committed[0]:
            return
        length = step.length
        after = self._started[0].kind if self._started else None
        if step.began >= previous:  # prepared after the step before finished: alone, unless another
            steady = after is None  # was launched behind it (then both preparations are in its time)
        elif len(committed) > 1:
            # A burst between neighbours of its length or with a prefill chunk: under a server's steady
            # arrivals steps that take prompts in alternate with bursts (the engine leaves newer prompts
            # waiting for one burst), and a burst measured only between chunkless neighbours was never
            # measured there. Such a neighbour's length is often not the burst's: the scheduler shortens
            # its windows to leave prompts their share of the step's tokens (at 256 requests and 512
            # tokens, no drafts at all), so a drafting burst required to sit between steps of its own
            # length was never measured under steady arrivals, and the gate followed times taken in a
            # lull (without the prompt-taking step's preparation in them) against plain bursts measured
            # with it. A neighbour's preparation, split over the burst's steps, is a small share of each;
            # every length's bursts sit between such steps alike.
            steady = (
                before is not None
                and after is not None
                and (before[0] == length or before[1])
                and (after[0] == length or after[1])
            )
        else:
            steady = before == after == (length, False)
        if steady:
            wall = now - max(step.began, previous)
            if step.began < previous:
                # Overlapped: the wall time holds the preparation of the steps launched behind this one,
                # not its own (done before the step before finished): each step is charged its own. With
                # neighbours of its length the two are alike; between steps that take prompts in they
                # are not, and a drafting burst, whose preparation costs most of its extra host work, was
                # measured with a prompt-taking step's preparation in its place (served at 256 requests
                # on the H100 the gate drafted 74-87% of its steps at 0.94x served plain).
                behind = sum(later.prepared for later in self._started if later.began >= previous)
                wall += step.prepared - behind
            seconds = max(wall, 1e-9) / len(committed)
            self._tier(len(committed[0])).seconds[length].add(seconds, provisional=step.warm_up)
        acceptance = self._acceptance
        for j, step_committed in enumerate(committed):
            if not step_committed:  # a burst's step after its requests had all finished
                continue
            if not length:  # a plain step verified no position: only the fading below (no pass over
                # its requests, which costs ~15 us a step at 64 requests)
                acceptance.fade(range(1, self.lengths[-1] + 1), SMOOTHING / len(step_committed))
                continue
            # One pass over the requests (this runs every step): a request that committed n tokens
            # having verified v drafts reached positions 1..min(n, v) and passed 1..n-1 (v: the step's
            # length when not given). A request that verified fewer than the length (a copied block
            # shorter than it, a cap) did not fail the positions it never verified.
            reached_at = [0] * (length + 1)
            passed_at = [0] * (length + 1)
            lens = verified[j] if verified is not None else None
            for r, n in enumerate(step_committed):
                if n <= 0:
                    continue
                v = length if lens is None else min(lens[r], length)
                reached_at[min(n, v)] += 1
                passed_at[min(n - 1, length)] += 1
            reached = sum(reached_at)  # requests reaching position >= 1 .. then >= k
            passed = sum(passed_at)
            for position in range(1, length + 1):
                reached -= reached_at[position - 1]
                passed -= passed_at[position - 1]
                acceptance.add(position, reached, passed)
            # The positions past this step's length fade too, towards their prior, by SMOOTHING / the
            # step's requests: at one request what a stretch of rejected drafts said of them is one
            # request's luck, and it stood while the gate ran length 1, whose steps never verify them,
            # until enough probes of the longer lengths outweighed it (~80 steps in the gate's test);
            # at many requests a probe's counts pool many requests, and fading them at the full rate
            # between probes would leave the estimate to the prior.
            acceptance.fade(range(length + 1, self.lengths[-1] + 1), SMOOTHING / len(step_committed))

    def view(self) -> tuple[float, ...]:
        """What the gate knows, flat (`dspark.outputs.GATE_FIELDS`, read by `gate_rows`): per tier and
        length it measured or chose, its step time, measured and chosen steps and tokens a request."""
        flat: list[float] = []
        tokens = self._acceptance.tokens_by_length(self.lengths[-1])
        for tier, stats in sorted(self._tiers.items()):
            for length in self.lengths:
                measured, chosen = stats.measured(length), stats.chosen[length]
                if measured or chosen:
                    seconds = stats.seconds[length].value if measured else 0.0
                    flat += (tier, length, seconds, measured, chosen, tokens[length])
        return tuple(flat)

    def rates(self, num_requests: int) -> dict[int, float]:
        """Committed tokens per second estimated for this many requests, per draft length measured."""
        stats = self._tiers.get(next_pow2(num_requests))
        if stats is None:
            return {}
        tokens = self._acceptance.tokens_by_length(self.lengths[-1])
        return {n: stats.rate(n, num_requests, tokens[n]) for n in self.lengths if stats.measured(n)}

    def _tier(self, num_requests: int) -> _TierStats:
        """The tier of this many decoding requests (made on first use: the first one warms up fully)."""
        tier = next_pow2(num_requests)
        stats = self._tiers.get(tier)
        if stats is None:
            warm_up = LATER_TIER_WARM_UP_STEPS if self._tiers else WARM_UP_STEPS
            stats = self._tiers[tier] = _TierStats(warm_up, tier)
        return stats
