"""Engine behaviour: KV page accounting, preemption, chunked prefill, batch invariance, finishing, errors."""

from __future__ import annotations

import random

import pytest
from tiny_models import decaying_sps_table

from dspark import LLM, EngineConfig, InvalidParameterError, SamplingParams
from dspark.engine.async_engine import AsyncEngine
from dspark.outputs import STEP_PHASES


def _config(target_dir, draft_dir, **changes) -> EngineConfig:
    base = EngineConfig(
        model=str(target_dir),
        draft_model=str(draft_dir),
        spec_mode="compact",
        num_kv_pages=128,
        kv_page_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        adaptive_speculation=False,  # these tests are about speculation: draft on every step
    )
    return base.replace(**changes)


def _prompts(count: int, seed: int | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 8) for _ in range(rng.randrange(3, 12))] for _ in range(count)]


GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_drafter_dir):
    """Greedy outputs of a prompt set with a roomy cache and a large step budget."""
    prompts = _prompts(6)
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="off"))
    return prompts, [o.token_ids for o in llm.generate(params=GREEDY, prompt_token_ids=prompts)]


def test_a_tight_token_budget_shortens_the_windows_and_stays_lossless(
    tiny_target_dir, tiny_drafter_dir, reference
) -> None:
    # 6 requests' windows of 5 tokens (blocks of 4) need 30 tokens a step; 16 fit: every request
    # still decodes each step, on shorter windows, and prompts keep a share while they prefill.
    # Every step waits for the one before and none bursts: launched ahead (on a GPU), a request near
    # its end sits a step out whatever the budget, and a burst after a prompt-taking step runs only the
    # requests already decoding while the others' prompts wait (`_defers_prompts`), neither of which
    # is what this counts.
    prompts, expected = reference
    # No prompt lookup: its copies commit more a step, so prefill steps would weigh more in the count.
    config = _config(
        tiny_target_dir,
        tiny_drafter_dir,
        spec_mode="static",
        max_num_batched_tokens=16,
        launch_ahead=False,
        decode_burst=1,
        prompt_lookup=False,
    )
    llm = LLM(config)
    outs = llm.generate(params=GREEDY, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_stats.verified_tokens for o in outs) > 0  # shorter windows still draft
    loop = llm.engine.load().loop
    # Most steps run every request (6) at once: windows of 5 tokens would fit 3 (16 // 5). The steps
    # that prefill run fewer: over 60 draws of the random prompts the mean was 3.96-5.5 a step.
    assert loop.step_requests / loop.steps > 3.5


def test_pages_are_freed_after_every_request_finishes(tiny_target_dir, tiny_drafter_dir, reference) -> None:
    prompts, expected = reference
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir))
    assert [o.token_ids for o in llm.generate(params=GREEDY, prompt_token_ids=prompts)] == expected
    assert llm.engine.allocator.num_used == 0
    assert llm.engine.load().num_running == llm.engine.load().num_waiting == 0


def test_preemption_recomputes_without_changing_output(tiny_target_dir, tiny_drafter_dir, reference) -> None:
    prompts, expected = reference
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, num_kv_pages=24))
    outs = llm.generate(params=GREEDY, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.allocator.num_used == 0


def test_chunked_prefill_gives_the_same_tokens(tiny_target_dir, tiny_drafter_dir, reference) -> None:
    prompts, expected = reference
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, max_num_batched_tokens=6, spec_mode="static"))
    assert [o.token_ids for o in llm.generate(params=GREEDY, prompt_token_ids=prompts)] == expected


def test_request_output_does_not_depend_on_its_neighbours(
    tiny_target_dir, tiny_drafter_dir, reference
) -> None:
    prompts, expected = reference
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir))
    alone = llm.generate(params=GREEDY, prompt_token_ids=[prompts[0]])[0].token_ids
    crowd = _prompts(5) + [prompts[0]]
    params = [SamplingParams(max_tokens=random.randrange(4, 30), ignore_eos=True) for _ in crowd[:-1]] + [
        GREEDY
    ]
    together = llm.generate(params=params, prompt_token_ids=crowd)[-1].token_ids
    assert alone == together == expected[0]


def test_abort_frees_pages_and_ends_with_reason_abort(tiny_target_dir, tiny_drafter_dir) -> None:
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir))
    engine = llm.engine
    for i, prompt in enumerate(_prompts(3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.allocator.num_used > 0
    engine.abort_request("r1")
    finished = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                finished[delta.request_id] = delta.finish_reason
    assert finished == {"r0": "length", "r1": "abort", "r2": "length"}
    assert engine.allocator.num_used == 0


def test_finish_reasons_eos_stop_ids_stop_strings_and_length(
    tiny_target_dir, tiny_drafter_dir, reference
) -> None:
    prompts, expected = reference
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir))
    output = expected[0]
    stop_token = output[5]
    first = output.index(stop_token)
    by_id = llm.generate(
        params=SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
        prompt_token_ids=[prompts[0]],
    )[0]
    assert (by_id.token_ids, by_id.finish_reason) == (output[: first + 1], "stop")
    word = f"w{stop_token}"
    by_text = llm.generate(
        params=SamplingParams(max_tokens=20, ignore_eos=True, stop=[word]), prompt_token_ids=[prompts[0]]
    )[0]
    assert by_text.finish_reason == "stop"
    assert word not in by_text.text
    by_length = llm.generate(
        params=SamplingParams(max_tokens=3, ignore_eos=True), prompt_token_ids=[prompts[0]]
    )[0]
    assert (by_length.token_ids, by_length.finish_reason) == (output[:3], "length")
    eos = llm.generate(params=SamplingParams(max_tokens=200), prompt_token_ids=_prompts(8, seed=3))
    for out in eos:
        assert out.finish_reason == "length" or (out.finish_reason == "stop" and out.token_ids[-1] == 0)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"max_tokns": 4}, "max_tokns"),
    ],
)
def test_bad_sampling_parameter_names_the_field(values, field) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_dict(values)
    assert info.value.field == field
    assert field in str(info.value)


def test_bad_json_names_sampling_parameters() -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_json("{not json")
    assert info.value.field == "sampling_parameters"


def test_bad_prompts_name_the_field(tiny_target_dir, tiny_drafter_dir) -> None:
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, max_model_len=32))
    cases = [
        ("", None, "prompt"),
        (None, [], "prompt_token_ids"),
        (None, [1, 99], "prompt_token_ids"),
        ("w1 " * 40, None, "prompt"),
    ]
    for prompt, ids, field in cases:
        with pytest.raises(InvalidParameterError) as info:
            llm.engine.prepare_prompt(prompt, ids, GREEDY)
        assert info.value.field == field


def test_async_engine_streams_deltas_that_add_up(tiny_target_dir, tiny_drafter_dir, reference) -> None:
    prompts, expected = reference
    engine = AsyncEngine(_config(tiny_target_dir, tiny_drafter_dir))
    engine.start()
    try:
        deltas = list(engine.stream("a", GREEDY, prompt_token_ids=prompts[1]))
        assert [t for d in deltas for t in d.new_token_ids] == expected[1]
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert not any(d.finished for d in deltas[:-1])
        with pytest.raises(InvalidParameterError):
            engine.submit("b", GREEDY, lambda d: None, prompt="")
        assert engine.healthy
    finally:
        engine.shutdown()
    assert not engine.healthy


@pytest.mark.parametrize("spec_mode,decode_burst", [("compact", 1), ("off", 4)])
def test_step_timer_splits_each_step_into_phases(
    tiny_target_dir, tiny_drafter_dir, spec_mode, decode_burst
) -> None:
    config = _config(tiny_target_dir, tiny_drafter_dir, spec_mode=spec_mode, decode_burst=decode_burst)
    llm = LLM(config)
    llm.engine.timer.enabled = True
    outs = llm.generate(params=GREEDY, prompt_token_ids=_prompts(3, seed=1))
    phases = llm.engine.timer.summary()
    steps = max(o.spec_stats.steps for o in outs)
    # A burst's steps count one by one (a GPU bursts speculative steps too, a CPU plain ones only).
    assert (llm.engine.load().loop.burst_steps > 0) == (decode_burst > 1)
    assert phases["steps"] >= steps
    for phase in ("schedule", "draft", "plan", "layout", "target", "accept", "emit"):
        assert phases[phase] > 0, phase
    llm.engine.timer.reset()
    assert llm.engine.timer.summary() == {"steps": 0.0}


def test_loop_totals_count_steps_requests_and_where_their_time_went(
    tiny_target_dir, tiny_drafter_dir, tmp_path
):
    # A table under which verifying costs: `compact` plans from the confidences, drafting apart.
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, sps_table=decaying_sps_table(tmp_path)))
    outs = llm.generate(params=GREEDY, prompt_token_ids=_prompts(3, seed=2))
    loop = llm.engine.load().loop
    steps = max(o.spec_stats.steps for o in outs)
    assert loop.steps >= steps
    # Three requests ran together for most steps; every counted step ran one at least.
    assert loop.steps <= loop.step_requests <= 3 * loop.steps
    assert loop.step_requests > 2 * steps
    assert 0 < loop.accept_seconds < loop.step_seconds
    assert loop.idle_seconds == 0  # offline, the loop never waits for requests
    # Graphs replay only on CUDA (a step with a small prefill chunk may replay one too); the first step
    # prefills; `compact` drafts apart: nothing goes ahead.
    assert 1 <= loop.prefill_steps < loop.steps
    assert 0 < loop.prefill_step_seconds < loop.step_seconds
    if llm.engine.limits.device.type == "cuda":
        assert 0 < loop.graph_steps <= loop.steps
    else:
        assert loop.graph_steps == 0
    assert loop.ahead_steps == 0
    # `compact` without the gate drafts on its decode steps: at most a block a request (the tiny
    # drafter's 4 drafts), fewer where its plan stops early or a request is near its end.
    assert 0 < loop.verify_tokens < llm.engine.limits.block_size * loop.step_requests
    # The host's time by phase: every phase ran, and together they are the step calls' time but for the
    # moments before a step's first phase.
    phases = [getattr(loop, f"host_{phase}_seconds") for phase in STEP_PHASES]
    assert all(seconds > 0 for seconds in phases)
    assert 0.9 * loop.step_seconds < sum(phases) <= loop.step_seconds
    # Another run adds to the totals.
    llm.generate(params=GREEDY, prompt_token_ids=_prompts(1, seed=3))
    again = llm.engine.load().loop
    assert again.steps > loop.steps and again.step_seconds > loop.step_seconds
    # One step at a time (bursts of eager steps wait for the step before instead).
    plain = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="off", decode_burst=1))
    plain.generate(params=GREEDY, prompt_token_ids=_prompts(3, seed=2))
    ahead = plain.engine.load().loop
    assert 0 < ahead.ahead_steps < ahead.steps  # plain decode steps go ahead of the acceptance
    assert ahead.verify_tokens == 0


def test_a_smaller_engine_block_counts_only_its_own_drafts(tiny_target_dir, tiny_drafter_dir) -> None:
    # The drafter was trained on blocks of 4 positions; an engine block of 2 drafts a block of 2,
    # verifies and counts them, and greedy output stays the target's. (No prompt lookup: its copies may
    # be shorter than a block.)
    prompts = _prompts(3, seed=2)
    llm = LLM(
        _config(tiny_target_dir, tiny_drafter_dir, spec_mode="static", block_size=2, prompt_lookup=False)
    )
    outs = llm.generate(params=GREEDY, prompt_token_ids=prompts)
    plain = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="off"))
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in plain.generate(params=GREEDY, prompt_token_ids=prompts)
    ]
    for out in outs:
        stats = out.spec_stats
        assert stats.drafting_steps > 0
        # Blocks of 2, but for a last step with a single token left, which drafts only 1.
        assert 2 * stats.drafting_steps - 1 <= stats.drafted_tokens <= 2 * stats.drafting_steps
        assert stats.verified_tokens <= stats.drafted_tokens


def test_generate_makes_each_completion_text_once_as_the_engine_would_step_by_step(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    # LLM.generate leaves the text of requests without stop strings to the end (`defer_text`); it must
    # be the text the engine makes at every step: EOS kept out, max_tokens flushed, stop strings cut.
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static"))
    prompts = _prompts(5, seed=3)
    params = [
        SamplingParams(max_tokens=17, ignore_eos=True),
        SamplingParams(max_tokens=30),  # may end on EOS (w0)
        SamplingParams(max_tokens=25, stop=["w3 w1", "w5"]),  # the text decides the finish
        SamplingParams(max_tokens=12, ignore_eos=True, skip_special_tokens=False),
        SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=11),
    ]
    assert llm.engine.defer_text
    deferred = llm.generate(params=params, prompt_token_ids=prompts)
    llm.engine.defer_text = False
    per_step = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in deferred] == [o.token_ids for o in per_step]
    assert [o.finish_reason for o in deferred] == [o.finish_reason for o in per_step]
    assert [o.text for o in deferred] == [o.text for o in per_step]
    assert all(o.text for o in deferred[:2]), "the texts compared are not empty"
