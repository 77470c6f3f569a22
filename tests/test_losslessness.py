"""Speculation changes speed, never output: greedy tokens equal plain greedy decoding; sampled tokens
follow the target's exact distribution."""

from __future__ import annotations

import json
import random

import pytest
import torch
from penalty_reference import penalized_row
from proposers import OracleProposer, TrapProposer
from tiny_models import decaying_sps_table, drafter_with_vocab, tiny_engine_config

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.models.dense import dense_logits
from dspark.runner.models.loader import load_target_model
from dspark.spec import planner as planner_module
from dspark.spec.proposer import DSparkProposer
from dspark.spec.sps_table import SpsTable

SPEC_SETTINGS = [("static", "sync"), ("compact", "sync"), ("compact", "lagged"), ("cap-accept", "sync")]
BLOCK = 4


def _planned_config(target_dir, draft_dir, mode: str, policy: str, tmp_path) -> EngineConfig:
    """The tiny engine in a speculation mode and planner policy, planning with `decaying_sps_table`."""
    return tiny_engine_config(
        target_dir, draft_dir, spec_mode=mode, planner_policy=policy, sps_table=decaying_sps_table(tmp_path)
    )


def _prompts(count: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 9))] for _ in range(count)]


@pytest.fixture(scope="module")
def greedy_truth(tiny_target_dir):
    """Plain greedy continuations of a fixed prompt set (the oracle's truth and the expected output)."""
    rng = random.Random(1234)
    prompts = _prompts(7, rng)
    llm = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off"))
    outs = llm.generate(params=SamplingParams(max_tokens=24, ignore_eos=True), prompt_token_ids=prompts)
    return prompts, [o.token_ids for o in outs]


@pytest.mark.parametrize(("mode", "policy"), SPEC_SETTINGS)
def test_greedy_output_unchanged_by_speculation_for_every_acceptance_pattern(
    tiny_target_dir, greedy_truth, mode, policy, tmp_path
) -> None:
    prompts, expected = greedy_truth
    truth = {tuple(p): p + out for p, out in zip(prompts, expected, strict=True)}
    rng = random.Random()
    # Request 0 always fully accepted, request 1 never (position 0 corrupted), requests 2..4 rejected at
    # block positions 1..3, the rest at a random position (or none) each step.
    fixed = {0: None, 1: 0, 2: 1, 3: 2, 4: 3}

    def corrupt(seq, step):
        index = prompts.index(seq.prompt_token_ids)
        return fixed[index] if index in fixed else rng.choice([None, *range(BLOCK)])

    confidences = {}

    def confidence(seq, k):
        return confidences.setdefault((seq.request_id, len(seq.token_ids), k), rng.uniform(0.3, 1.0))

    proposer = OracleProposer(truth, 8, BLOCK, corrupt, confidence)
    llm = LLM(
        _planned_config(tiny_target_dir, None, mode, policy, tmp_path),
        proposer=proposer,
    )
    outs = llm.generate(params=SamplingParams(max_tokens=24, ignore_eos=True), prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert outs[0].spec_stats.accepted_tokens > 0
    assert outs[1].spec_stats.accepted_tokens == 0
    for position, out in zip((1, 2, 3), outs[2:5], strict=True):
        per_position = out.spec_stats.accepted_per_position + [0] * BLOCK
        assert per_position[position:BLOCK] == [0] * (BLOCK - position)
        if mode == "static":  # every draft is verified, so the one before the corruption is accepted
            assert per_position[position - 1] > 0


@pytest.mark.parametrize(("mode", "policy"), SPEC_SETTINGS)
def test_greedy_output_unchanged_with_the_real_drafter(
    tiny_target_dir, tiny_drafter_dir, greedy_truth, mode, policy, tmp_path
) -> None:
    prompts, expected = greedy_truth
    llm = LLM(_planned_config(tiny_target_dir, tiny_drafter_dir, mode, policy, tmp_path))
    outs = llm.generate(params=SamplingParams(max_tokens=24, ignore_eos=True), prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_stats.drafted_tokens for o in outs) > 0


def test_num_draft_tokens_zero_turns_speculation_off_for_that_request(
    tiny_target_dir, tiny_drafter_dir, greedy_truth
) -> None:
    prompts, expected = greedy_truth
    llm = LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static"))
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, num_draft_tokens=0 if i % 2 else None)
        for i in range(len(prompts))
    ]
    outs = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert all(o.spec_stats.verified_tokens == 0 for o in outs[1::2])
    assert all(o.spec_stats.verified_tokens > 0 for o in outs[0::2])


# Penalties and min_tokens: every verify row is judged with the drafts before it as history, so a
# penalized request decodes as it does without speculation.

TINY_EOS = 0
PENALTY_VARIANTS = [
    SamplingParams(
        max_tokens=24, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.4
    ),
    SamplingParams(max_tokens=24, min_tokens=9, ignore_eos=True),
    SamplingParams(max_tokens=24, repetition_penalty=0.7, frequency_penalty=-0.4, min_tokens=4),
    SamplingParams(max_tokens=24, presence_penalty=-1.0, stop_token_ids=[3], min_tokens=6),
    SamplingParams(max_tokens=24, ignore_eos=True),
]


@pytest.fixture(scope="module")
def penalized_truth(tiny_target_dir):
    """Plain greedy continuations of distinct prompts, each under one of PENALTY_VARIANTS."""
    rng = random.Random(4321)
    prompts: list[list[int]] = []
    while len(prompts) < 10:
        prompt = _prompts(1, rng)[0]
        if prompt not in prompts:
            prompts.append(prompt)
    params = [PENALTY_VARIANTS[i % len(PENALTY_VARIANTS)] for i in range(len(prompts))]
    outs = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off")).generate(
        params=params, prompt_token_ids=prompts
    )
    plain = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off")).generate(
        params=SamplingParams(max_tokens=24), prompt_token_ids=prompts
    )
    changed = sum(a.token_ids != b.token_ids for a, b in zip(outs, plain, strict=True))
    assert changed >= 6, "the penalties must change most outputs, or equality below proves little"
    return prompts, params, [o.token_ids for o in outs]


@pytest.mark.parametrize(("mode", "policy"), SPEC_SETTINGS)
def test_penalized_greedy_output_unchanged_by_speculation_for_every_acceptance_pattern(
    tiny_target_dir, penalized_truth, mode, policy, tmp_path
) -> None:
    prompts, params, expected = penalized_truth
    truth = {tuple(p): p + out + [1] * BLOCK for p, out in zip(prompts, expected, strict=True)}
    rng = random.Random()
    # Request 0 drafts its true (penalized) continuation and is always fully accepted, so its later
    # verify rows must see the drafts before them; request 1 never; the rest at random positions.
    fixed = {0: None, 1: 0, 2: 2}

    def corrupt(seq, step):
        index = prompts.index(seq.prompt_token_ids)
        return fixed[index] if index in fixed else rng.choice([None, *range(BLOCK)])

    def confidence(seq, k):
        # Request 0 is sure of its drafts, so every planner verifies windows of two or more for it (random
        # confidences let the decaying SPS table cut its windows to one draft in an unlucky run).
        return 1.0 if prompts.index(seq.prompt_token_ids) == 0 else rng.uniform(0.3, 1.0)

    proposer = OracleProposer(truth, 8, BLOCK, corrupt, confidence)
    llm = LLM(
        _planned_config(tiny_target_dir, None, mode, policy, tmp_path),
        proposer=proposer,
    )
    outs = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert outs[0].spec_stats.accepted_per_position[1] > 0  # two drafts accepted in one window
    assert outs[1].spec_stats.accepted_tokens == 0


@pytest.mark.parametrize(("mode", "policy"), SPEC_SETTINGS)
def test_penalized_greedy_output_unchanged_with_the_real_drafter(
    tiny_target_dir, tiny_drafter_dir, penalized_truth, mode, policy, tmp_path
) -> None:
    prompts, params, expected = penalized_truth
    llm = LLM(_planned_config(tiny_target_dir, tiny_drafter_dir, mode, policy, tmp_path))
    outs = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_stats.accepted_tokens for o in outs) > 0


# Sampling -------------------------------------------------------------------------------------------

PROMPT = [3, 5]
NUM_SAMPLES = 3000
# Total-variation bound on the joint law of generated tokens 2 and 3 (64 outcomes); sampling noise
# at NUM_SAMPLES is about 0.05, a look-ahead planner's bias here is several times that.
TV_BOUND = 0.1


def _exact_joint(target_dir, params: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(x2, x3) of the target after `prompt` under `params`, by enumerating x1, x2 and summing x1 out:
    [8, 8]."""
    from dspark.sampling.sampler import filtered_probs

    model = load_target_model(target_dir)

    def dist(prefix: list[int]) -> torch.Tensor:
        logits = dense_logits(model, prefix)[-1]
        # Penalties and min_tokens (the tiny target's EOS is 0) as vLLM applies them, token by token.
        stop_ids = [TINY_EOS, *params.stop_token_ids]
        logits = penalized_row(logits, prompt, prefix[len(prompt) :], params, stop_ids)
        return filtered_probs(logits[None], params)[0].double()

    joint = torch.zeros(8, 8, dtype=torch.float64)
    p1 = dist(prompt)
    for x1 in range(8):
        p2 = dist(prompt + [x1])
        for x2 in range(8):
            joint[x2] += p1[x1] * p2[x2] * dist(prompt + [x1, x2])
    return joint


def _empirical_joint(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    seeds = random.Random().sample(range(10**9), NUM_SAMPLES)
    batch = [SamplingParams(**{**params.__dict__, "seed": s}) for s in seeds]
    outs = llm.generate(params=batch, prompt_token_ids=[prompt] * NUM_SAMPLES)
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for out in outs:
        counts[out.token_ids[1], out.token_ids[2]] += 1
    return counts / NUM_SAMPLES


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


class LookaheadPlanner:
    """Deliberately broken: verifies the argmax budget of THIS step's confidences (look-ahead, no early
    stop). It plans each request as if it ran alone (batch size 1), so that thousands of samples can
    share a batch without their budgets averaging the bias away."""

    verifies_all = False

    def __init__(self, sps: SpsTable) -> None:
        self.sps = sps

    def plan(self, survivals: torch.Tensor, max_lens: torch.Tensor) -> torch.Tensor:
        lens = []
        for r in range(survivals.shape[0]):
            one, cap = survivals[r : r + 1], max_lens[r : r + 1]
            budget = planner_module.global_argmax_budget(one, cap, self.sps)
            lens.append(planner_module.split_budget(one, cap, budget))
        return torch.cat(lens)


def _sps_file(tmp_path, name: str, points: list[tuple[int, float]]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(
        json.dumps({"version": 1, "points": [{"tokens": t, "steps_per_second": s} for t, s in points]})
    )
    return str(path)


# Verifying one draft never pays and two pay only when the second looks likely: a look-ahead planner
# then verifies draft 1 exactly when draft 1 is the trigger token, which biases it.
TRAP_SPS = [(1, 1.0), (2, 0.5), (3, 0.45)]
# Draft 1 always pays, draft 2 only after a trigger: sync and lagged make ragged, causal plans.
RAGGED_SPS = [(1, 1.0), (2, 0.8), (3, 0.7)]
TRIGGER = 5


def _sampling_llm(target_dir, tmp_path, sps: list[tuple[int, float]], **changes) -> LLM:
    cfg = tiny_engine_config(
        target_dir,
        spec_mode="compact",
        max_num_seqs=512,
        num_kv_pages=1024,
        max_num_batched_tokens=2048,
        block_size=2,
        sps_table=_sps_file(tmp_path, "sps", sps),
        **changes,
    )
    return LLM(cfg, proposer=TrapProposer(load_target_model(target_dir), TRIGGER, block_size=2))


# Four tokens: x1 comes from prefill, x2 and x3 are the first speculative block (x4 keeps its window open).
SAMPLING = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def exact_joint(tiny_target_dir) -> torch.Tensor:
    return _exact_joint(tiny_target_dir, SAMPLING)


@pytest.mark.parametrize(
    ("policy", "sps"), [("sync", RAGGED_SPS), ("lagged", TRAP_SPS), ("lagged", RAGGED_SPS)]
)
def test_sampled_tokens_follow_target_distribution(
    tiny_target_dir, exact_joint, policy, sps, tmp_path
) -> None:
    llm = _sampling_llm(tiny_target_dir, tmp_path, sps, planner_policy=policy)
    tv = _tv(_empirical_joint(llm, SAMPLING), exact_joint)
    print(f"total variation {tv:.4f}")
    assert tv < TV_BOUND
    stats = llm.engine.total_spec_stats
    assert 0 < stats.verified_tokens < stats.drafted_tokens


def test_lookahead_planner_is_caught_by_the_distribution_test(tiny_target_dir, exact_joint, tmp_path) -> None:
    llm = _sampling_llm(tiny_target_dir, tmp_path, TRAP_SPS)
    llm.engine.planner = LookaheadPlanner(SpsTable(TRAP_SPS))
    tv = _tv(_empirical_joint(llm, SAMPLING), exact_joint)
    print(f"total variation {tv:.4f}")
    assert tv > TV_BOUND


@pytest.mark.parametrize(
    ("mode", "stop"), [("static", 0.0), ("compact", 0.05), ("compact", 0.5), ("cap-accept", 0.0)]
)
def test_sampling_with_the_real_drafter_and_filters_follows_target(
    tiny_target_dir, tiny_drafter_dir, mode, stop, tmp_path
) -> None:
    # stop 0.5: most blocks end early (the random drafter's confidences are about 1/2), so the law of
    # the output under early-stopped drafting is what is measured.
    params = SamplingParams(max_tokens=4, temperature=0.8, top_k=6, top_p=0.9, ignore_eos=True)
    llm = LLM(
        tiny_engine_config(
            tiny_target_dir,
            tiny_drafter_dir,
            spec_mode=mode,
            max_num_seqs=512,
            num_kv_pages=1024,
            max_num_batched_tokens=4096,
            draft_stop_survival=stop,
            # compact stops drafting early only under a table where verifying costs (a flat one
            # verifies whole blocks).
            sps_table=decaying_sps_table(tmp_path) if mode == "compact" else "",
        )
    )
    assert _tv(_empirical_joint(llm, params), _exact_joint(tiny_target_dir, params)) < TV_BOUND
    if stop >= 0.5:
        stats = llm.engine.total_spec_stats
        assert stats.drafted_tokens < stats.steps * llm.engine.limits.block_size


def test_sampling_with_a_draft_vocabulary_follows_target(tiny_target_dir, tiny_drafter_dir, tmp_path) -> None:
    """Drafts drawn from 3 of the 8 tokens: the target's other tokens come only from rejections'
    residual draws, which must make up exactly their share."""
    params = SamplingParams(max_tokens=4, temperature=0.8, top_k=6, ignore_eos=True)
    order = random.sample(range(8), 8)
    llm = LLM(
        tiny_engine_config(
            tiny_target_dir,
            drafter_with_vocab(tiny_drafter_dir, tmp_path, order),
            spec_mode="static",
            draft_vocab_size=3,
            max_num_seqs=512,
            num_kv_pages=1024,
            max_num_batched_tokens=4096,
        )
    )
    tv = _tv(_empirical_joint(llm, params), _exact_joint(tiny_target_dir, params))
    assert tv < TV_BOUND, f"order={order} tv={tv:.4f}"
    assert llm.engine.total_spec_stats.accepted_tokens > 0


# 5 followed by every token, and 5 last: whatever x1, the first block (x2, x3) is copied from the prompt
# (`dspark.spec.lookup`): x2's draft is always 5, a certain choice.
LOOKUP_PROMPT = [t for k in range(8) for t in (5, k)] + [5]


@pytest.mark.parametrize("honest", [True, False])
def test_sampling_with_copied_drafts_follows_target(
    tiny_target_dir, tiny_drafter_dir, honest: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied drafts are drawn from a one-hot distribution: accepted with the target's probability of
    them, else the target's law without them. A proposer that claimed another draft law for them (here
    uniform, so a copy is accepted 8x too often) is caught by the same bound."""
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    changes = {"max_num_seqs": 512, "num_kv_pages": 2048, "max_num_batched_tokens": 4096}
    llm = LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static", **changes))
    proposer = llm.engine.proposer
    copies = []
    real = DSparkProposer._with_copies

    def with_copies(self, seqs, copied, drafted, inner):  # noqa: ANN001, ANN202
        copies.append(sum(bool(c) for c in copied))
        drafts = real(self, seqs, copied, drafted, inner)
        if not honest:
            for probs in drafts.probs:
                if probs is not None:
                    probs.fill_(1.0 / probs.shape[1])
        return drafts

    monkeypatch.setattr(DSparkProposer, "_with_copies", with_copies)
    tv = _tv(
        _empirical_joint(llm, params, LOOKUP_PROMPT), _exact_joint(tiny_target_dir, params, LOOKUP_PROMPT)
    )
    print(f"total variation {tv:.4f}")
    assert isinstance(proposer, DSparkProposer) and sum(copies) >= NUM_SAMPLES  # every first block copied
    assert (tv < TV_BOUND) if honest else (tv > TV_BOUND)
    assert llm.engine.total_spec_stats.accepted_tokens > 0


# x1 and x2 may not be EOS (min_tokens), and every token seen is pushed down: far from SAMPLING's law.
PENALIZED_SAMPLING = SamplingParams(
    max_tokens=4,
    temperature=1.0,
    ignore_eos=True,
    presence_penalty=0.8,
    frequency_penalty=0.5,
    repetition_penalty=1.5,
    min_tokens=2,
)


@pytest.mark.parametrize("drafter", ["trap", "real"])
def test_penalized_sampling_follows_the_penalized_target_distribution(
    tiny_target_dir, tiny_drafter_dir, exact_joint, drafter, tmp_path
) -> None:
    exact = _exact_joint(tiny_target_dir, PENALIZED_SAMPLING)
    assert _tv(exact, exact_joint) > 2 * TV_BOUND  # the test tells the penalized law from the plain one
    if drafter == "trap":
        llm = _sampling_llm(tiny_target_dir, tmp_path, RAGGED_SPS, planner_policy="sync")
    else:
        changes = {"max_num_seqs": 512, "num_kv_pages": 1024, "max_num_batched_tokens": 4096}
        llm = LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static", **changes))
    tv = _tv(_empirical_joint(llm, PENALIZED_SAMPLING), exact)
    print(f"total variation {tv:.4f}")
    assert tv < TV_BOUND
    assert llm.engine.total_spec_stats.accepted_tokens > 0


def test_early_stopped_drafting_keeps_greedy_output_and_verifies_only_drafts(
    tiny_target_dir, tiny_drafter_dir, tmp_path
) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7], [2, 2], [7, 1, 3, 3, 5]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off")).generate(
        params=params, prompt_token_ids=prompts
    )
    llm = LLM(
        tiny_engine_config(
            tiny_target_dir,
            tiny_drafter_dir,
            spec_mode="compact",
            draft_stop_survival=0.4,
            sps_table=decaying_sps_table(tmp_path),
        )
    )
    outs = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.engine.total_spec_stats
    assert 0 < stats.drafted_tokens < stats.steps * llm.engine.limits.block_size
    assert stats.verified_tokens <= stats.drafted_tokens


def test_seeded_sampling_is_reproducible(tiny_target_dir, tiny_drafter_dir) -> None:
    llm = LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, spec_mode="compact"))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    first, second = (llm.generate(params=params, prompt_token_ids=[PROMPT])[0].token_ids for _ in range(2))
    assert first == second
