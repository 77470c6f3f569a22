"""The speculation gate: it follows the measured speed of earlier steps, per batch tier, re-probes the
losing side, and the engine behind it stays lossless whichever way it decides."""

from __future__ import annotations

import random

from dspark import LLM, EngineConfig, SamplingParams
from dspark.spec.gate import PROBE_INTERVAL, WARM_UP_STEPS, SpeculationGate


class _Clock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_steps(
    gate: SpeculationGate, clock: _Clock, requests: int, steps: int, seconds, tokens
) -> list[bool]:
    """Drive `steps` decode steps; seconds(spec) and tokens(spec) say how each kind of step goes."""
    decisions = []
    for _ in range(steps):
        gate.start_step()
        speculate = gate.should_speculate(requests)
        clock.now += seconds(speculate)
        gate.finish_step(requests, speculate, tokens(speculate))
        decisions.append(speculate)
    return decisions


def test_gate_tries_both_kinds_then_follows_the_faster_and_probes_the_slower() -> None:
    clock = _Clock()
    gate = SpeculationGate(clock)
    # Speculation commits 2.5 tokens a request in 2 ms, plain 1 in 1 ms: speculation wins (1.25x).
    decisions = _run_steps(gate, clock, 8, 200, lambda s: 0.002 if s else 0.001, lambda s: 20 if s else 8)
    assert decisions[:WARM_UP_STEPS] == [True] * WARM_UP_STEPS
    assert decisions[WARM_UP_STEPS : 2 * WARM_UP_STEPS] == [False] * WARM_UP_STEPS
    settled = decisions[2 * WARM_UP_STEPS :]
    plain_probes = settled.count(False)
    assert 0 < plain_probes <= len(settled) // PROBE_INTERVAL + 1
    plain, spec = gate.rates(8)
    assert spec > plain


def test_gate_turns_speculation_off_where_it_loses_and_keeps_tiers_apart() -> None:
    clock = _Clock()
    gate = SpeculationGate(clock)
    # At 64 requests speculation loses (1.4 tokens for 2x the time); at 1 request it wins.
    loses = _run_steps(gate, clock, 64, 200, lambda s: 0.004 if s else 0.002, lambda s: 90 if s else 64)
    wins = _run_steps(gate, clock, 1, 200, lambda s: 0.002 if s else 0.001, lambda s: 3 if s else 1)
    assert sum(loses[2 * WARM_UP_STEPS :]) <= len(loses) // PROBE_INTERVAL + 1
    assert sum(wins[2 * WARM_UP_STEPS :]) >= len(wins) - 2 * WARM_UP_STEPS - len(wins) // PROBE_INTERVAL - 1


def test_gate_follows_a_change_of_regime() -> None:
    clock = _Clock()
    gate = SpeculationGate(clock)
    _run_steps(gate, clock, 4, 100, lambda s: 0.002 if s else 0.001, lambda s: 12 if s else 4)
    # Acceptance collapses: speculation now commits barely more than plain for twice the time.
    after = _run_steps(gate, clock, 4, 300, lambda s: 0.002 if s else 0.001, lambda s: 5 if s else 4)
    assert sum(after[-100:]) <= 100 // PROBE_INTERVAL + 1


def test_gated_engine_is_lossless_and_speculates_on_some_steps_only(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 20))] for _ in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    base = EngineConfig(
        model=str(tiny_target_dir), draft_model=str(tiny_drafter_dir), num_kv_pages=256, kv_page_size=4
    )
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompts)
    llm = LLM(base.replace(adaptive_speculation=True))
    clock = _Clock()
    gate = llm.engine.gate = SpeculationGate(clock)
    # Steps are timed by the test's clock: every step "takes" 1 ms, so plain (1 token a request) and
    # speculation (more) are told apart by tokens alone, and a drafting step is made to look slow.
    real_finish = gate.finish_step

    def finish(num_requests: int, speculative: bool, committed_tokens: int) -> None:
        clock.now += 0.010 if speculative else 0.001
        real_finish(num_requests, speculative, committed_tokens)

    decisions: list[bool] = []
    real_decide = gate.should_speculate

    def decide(num_requests: int) -> bool:
        decisions.append(real_decide(num_requests))
        return decisions[-1]

    gate.finish_step = finish  # type: ignore[method-assign]
    gate.should_speculate = decide  # type: ignore[method-assign]
    gated = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in gated] == [o.token_ids for o in plain]
    stats = llm.engine.total_spec_stats
    assert stats.drafted_tokens > 0, "the gate's warm-up drafts"
    assert 0 < stats.drafting_steps < stats.steps  # what dspark_spec_drafting_steps_total publishes
    # Speculation, 10x slower here, is switched off after the warm-up, but for the probes.
    assert decisions[:WARM_UP_STEPS] == [True] * WARM_UP_STEPS
    assert sum(decisions) <= 2 * WARM_UP_STEPS + len(decisions) // PROBE_INTERVAL + 2, decisions


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
        llm.engine.gate.should_speculate = lambda num_requests, s=speculate: s  # type: ignore[method-assign]
        out = llm.generate(params=params, prompt_token_ids=[[1, 2, 3, 4]])[0]
        assert out.spec_stats.drafted_tokens > 0
        streams.append(out.token_ids)
    assert streams[0] == streams[1]
