"""The DSpark objective trains: the loss falls over a few steps on a tiny model and the engine then commits
more tokens per step, position weights decay, bf16 mixed precision keeps fp32 master gradients, and a run
stopped and resumed from its saved state ends exactly where an uninterrupted run does."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dspark import LLM, EngineConfig, SamplingParams, SpecStats
from dspark.runner.models.loader import load_target_model
from dspark.spec.draft_checkpoint import save_drafter
from dspark.training.data import AnchorSampler, distill, distill_with_engine
from dspark.training.draft_forward import block_hidden
from dspark.training.losses import LossWeights, position_weights
from dspark.training.trainer import TrainConfig, Trainer, block_targets, drafter_loss, new_drafter

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    """The tiny target, loaded once."""
    return load_target_model(tiny_target_dir)


@pytest.fixture(scope="module")
def records(tiny_target):
    """Self-distillation data of the tiny target: half greedy, half sampled responses."""
    rng = random.Random(0)
    prompts = [(str(i), "chat", [rng.randrange(1, 8) for _ in range(rng.randrange(2, 8))]) for i in range(24)]
    temperatures = [0.0, 1.0] * 12
    return distill(tiny_target, prompts, temperatures, [], 20, 24, seed=0)


def test_the_engine_answers_greedy_prompts_as_the_dense_generator_does(tiny_target, tiny_target_dir) -> None:
    rng = random.Random(2)
    prompts = [(str(i), "code", [rng.randrange(1, 8) for _ in range(rng.randrange(2, 9))]) for i in range(12)]
    temperatures = [0.0] * 8 + [1.0] * 4
    # fp32 like the dense generator's CPU target: on a GPU the engine would default to bf16, whose
    # rounding can flip a near-tied greedy choice (a precision difference, not what this test is about).
    config = EngineConfig(
        model=str(tiny_target_dir), spec_mode="off", num_kv_pages=64, max_num_seqs=4, dtype="float32"
    )
    with LLM(config) as llm:
        served = distill_with_engine(llm, prompts, temperatures, 16, chunk_size=5, seed=0)
        eos = llm.engine.eos_token_ids
    dense = distill(tiny_target, prompts, temperatures, eos, 16, 12, seed=0)
    assert [r.id for r in served] == [p[0] for p in prompts]
    assert [r.response_ids for r in served[:8]] == [r.response_ids for r in dense[:8]]
    for record in served[8:]:
        assert record.temperature == 1.0 and 1 <= len(record.response_ids) <= 16
        assert all(0 <= t < 8 for t in record.response_ids)


def _drafter(tiny_target):
    return new_drafter(tiny_target.config, BLOCK, 1, 4, 2, seed=0, mask_token_id=1)


def _config(steps: int, **changes) -> TrainConfig:
    base = TrainConfig(
        steps=steps,
        batch_size=8,
        anchors_per_sequence=4,
        lr=3e-3,
        warmup_steps=2,
        log_every=100,
        save_every=100,
    )
    for name, value in changes.items():
        setattr(base, name, value)
    return base


def test_position_weights_decay_from_one() -> None:
    weights = position_weights(4, 2.0, torch.device("cpu"))
    assert weights[0] == 1.0 and bool((weights[1:] < weights[:-1]).all())
    torch.testing.assert_close(weights[1], torch.exp(torch.tensor(-0.5)))


def test_loss_decreases_over_a_few_steps(tiny_target, records, tmp_path) -> None:
    fixed = next(AnchorSampler(records, 16, 4, 64, seed=123))
    drafter = _drafter(tiny_target)
    with torch.no_grad():
        before = drafter_loss(tiny_target, drafter, fixed, LossWeights(), autocast=False)
    Trainer(tiny_target, drafter, records, _config(30), tmp_path, torch.device("cpu")).run()
    with torch.no_grad():
        after = drafter_loss(tiny_target, drafter, fixed, LossWeights(), autocast=False)
    assert float(after.total) < 0.8 * float(before.total)
    assert float(after.ce) < float(before.ce) and float(after.l1) < float(before.l1)


def _draft_log_probs(tiny_target, drafter, batch):  # noqa: ANN001, ANN202
    """The block targets of `batch` and the drafter's Markov-corrected log-probabilities for them, computed
    apart from `dspark_loss` (what its cross-entropies are checked against)."""
    features, targets = block_targets(tiny_target, batch, BLOCK, list(drafter.config.target_layer_ids))
    hidden = block_hidden(drafter, tiny_target.embed_tokens.weight, features, batch.token_ids, batch.anchors)
    logits = drafter.corrected_logits(
        F.linear(hidden.flatten(0, 1), tiny_target.lm_head.weight).float(),
        drafter.markov_features(targets.previous),
    )
    return targets, torch.log_softmax(logits, -1)


def test_the_soft_cross_entropy_is_against_the_targets_distribution(tiny_target, records, tmp_path) -> None:
    fixed = next(AnchorSampler(records, 16, 4, 64, seed=124))
    drafter = _drafter(tiny_target)
    soft = LossWeights()  # the default
    assert soft.ce_target == "target"
    with torch.no_grad():
        hard_parts = drafter_loss(tiny_target, drafter, fixed, LossWeights(ce_target="data"), autocast=False)
        soft_parts = drafter_loss(tiny_target, drafter, fixed, soft, autocast=False)
        targets, log_pd = _draft_log_probs(tiny_target, drafter, fixed)
        expected = -(torch.softmax(targets.target_logits.float(), -1) * log_pd).sum(-1)
        w = position_weights(BLOCK, soft.decay, expected.device)[None, :] * targets.valid
    torch.testing.assert_close(soft_parts.ce, (w * expected).sum() / w.sum())
    torch.testing.assert_close(soft_parts.l1, hard_parts.l1)  # only the cross-entropy's label changes
    assert abs(float(soft_parts.ce) - float(hard_parts.ce)) > 1e-4
    Trainer(tiny_target, drafter, records, _config(30, weights=soft), tmp_path, torch.device("cpu")).run()
    with torch.no_grad():
        after = drafter_loss(tiny_target, drafter, fixed, soft, autocast=False)
    assert float(after.total) < 0.8 * float(soft_parts.total)
    with pytest.raises(ValueError, match="ce_target"):
        LossWeights(ce_target="labels")


def test_the_argmax_cross_entropy_is_against_the_targets_most_likely_token(tiny_target, records) -> None:
    fixed = next(AnchorSampler(records, 16, 4, 64, seed=125))
    drafter = _drafter(tiny_target)
    argmax = LossWeights(ce_target="argmax")
    with torch.no_grad():
        parts = drafter_loss(tiny_target, drafter, fixed, argmax, autocast=False)
        data_parts = drafter_loss(tiny_target, drafter, fixed, LossWeights(ce_target="data"), autocast=False)
        targets, log_pd = _draft_log_probs(tiny_target, drafter, fixed)
        labels = targets.target_logits.argmax(-1)
        expected = -log_pd.gather(-1, labels[..., None]).squeeze(-1)
        w = position_weights(BLOCK, argmax.decay, expected.device)[None, :] * targets.valid
    torch.testing.assert_close(parts.ce, (w * expected).sum() / w.sum())
    torch.testing.assert_close(parts.l1, data_parts.l1)  # only the cross-entropy's label changes
    # The records' tokens are sampled, not the target's argmax everywhere: the two labels differ.
    assert bool(((labels != targets.labels) & targets.valid.bool()).any())
    assert abs(float(parts.ce) - float(data_parts.ce)) > 1e-4


def test_resumed_run_ends_where_an_uninterrupted_run_does(tiny_target, records, tmp_path) -> None:
    cpu = torch.device("cpu")
    straight = _drafter(tiny_target)
    Trainer(tiny_target, straight, records, _config(6), tmp_path / "straight", cpu).run()
    interrupted = Trainer(tiny_target, _drafter(tiny_target), records, _config(6), tmp_path / "resumed", cpu)
    for _ in range(3):
        interrupted.train_step()
    interrupted.save_state()
    resumed = Trainer(tiny_target, _drafter(tiny_target), records, _config(6), tmp_path / "resumed", cpu)
    finished = resumed.run()
    assert resumed.step == 6
    for (name, a), b in zip(straight.state_dict().items(), finished.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_bf16_mixed_precision_step_keeps_fp32_master_gradients(tiny_target_dir, records) -> None:
    bf16_target = load_target_model(tiny_target_dir, dtype=torch.bfloat16)
    drafter = _drafter(bf16_target)
    batch = next(AnchorSampler(records, 4, 3, 64, seed=0))
    parts = drafter_loss(bf16_target, drafter, batch, LossWeights(), autocast=True)
    parts.total.backward()
    assert torch.isfinite(parts.total)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in drafter.parameters())


def test_trained_drafter_commits_more_tokens_per_step_in_the_engine(
    tiny_target, tiny_target_dir, tmp_path
) -> None:
    rng = random.Random(1)
    prompts = [
        (str(i), "chat", [rng.randrange(1, 8) for _ in range(rng.randrange(2, 8))]) for i in range(136)
    ]
    greedy = distill(tiny_target, prompts[:128], [0.0] * 128, [], 24, 128, seed=0)
    drafter = _drafter(tiny_target)

    def tau(name: str) -> float:
        save_drafter(drafter, tmp_path / name, dtype=torch.float32)
        config = EngineConfig(
            model=str(tiny_target_dir),
            draft_model=str(tmp_path / name),
            spec_mode="static",
            num_kv_pages=128,
            adaptive_speculation=False,  # tau of the drafter on every step
            prompt_lookup=False,  # the drafter's blocks only, none copied
        )
        outs = LLM(config).generate(
            params=SamplingParams(max_tokens=24, ignore_eos=True),
            prompt_token_ids=[p[2] for p in prompts[128:]],
        )
        stats = SpecStats()
        for out in outs:
            stats.merge(out.spec_stats)
        return stats.mean_committed_per_step

    untrained = tau("untrained")
    Trainer(
        tiny_target,
        drafter,
        greedy,
        _config(150, batch_size=16, anchors_per_sequence=8),
        tmp_path / "work",
        torch.device("cpu"),
    ).run()
    assert tau("trained") > untrained + 0.5


def _assert_every_trunk_weight_learns(target, records, device: torch.device, autocast: bool) -> None:
    # W1 of the Markov head is left out: W2 starts at zero, so W1's first gradient is zero by design.
    drafter = _drafter(target).to(device)
    batch = next(AnchorSampler(records, 4, 3, 64, seed=0)).to(device)
    drafter_loss(target, drafter, batch, LossWeights(), autocast=autocast).total.backward()
    silent = [
        name
        for name, p in drafter.named_parameters()
        if name != "markov_w1.weight" and (p.grad is None or not bool(p.grad.abs().sum() > 0))
    ]
    assert not silent, f"no gradient reaches {silent}"


def test_every_drafter_weight_gets_a_gradient(tiny_target, records) -> None:
    _assert_every_trunk_weight_learns(tiny_target, records, torch.device("cpu"), autocast=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_drafter_weight_gets_a_gradient_on_the_gpu(tiny_target_dir, records) -> None:
    # The serving kernels have no backward: on CUDA, training must route around them (dspark/kernels/ops.py).
    target = load_target_model(tiny_target_dir, dtype=torch.bfloat16, device="cuda")
    _assert_every_trunk_weight_learns(target, records, torch.device("cuda"), autocast=True)


# The draft vocabulary the loss may be restricted to: 5 of the tiny target's 8 tokens (sorted ids).
DRAFT_VOCAB = torch.tensor([0, 2, 3, 5, 6])


def test_a_draft_vocabulary_of_every_token_gives_the_whole_vocabularys_loss(tiny_target, records) -> None:
    fixed = next(AnchorSampler(records, 16, 4, 64, seed=126))
    drafter = _drafter(tiny_target)
    every = torch.arange(tiny_target.config.vocab_size)
    for weights in (LossWeights(), LossWeights(ce_target="data"), LossWeights(ce_target="argmax")):
        with torch.no_grad():
            whole = drafter_loss(tiny_target, drafter, fixed, weights, autocast=False)
            listed = drafter_loss(tiny_target, drafter, fixed, weights, autocast=False, vocab=every)
        for name in ("total", "ce", "l1", "confidence", "survival"):
            torch.testing.assert_close(getattr(listed, name), getattr(whole, name), msg=name)


def test_the_draft_vocabulary_loss_is_the_served_drafters(tiny_target, records) -> None:
    """Over a draft vocabulary the drafter's distribution is a softmax over its tokens (their rows of the
    LM head and of W2), the soft cross-entropy sums over them, the L1 distance adds the target's mass
    outside them, the data's labels outside them leave the cross-entropy, and the survival compares the
    drafted token ids with the target's argmax over every token."""
    fixed = next(AnchorSampler(records, 16, 4, 64, seed=127))
    drafter = _drafter(tiny_target)
    with torch.no_grad():  # a Markov head that changes the logits, so its rows are checked too
        drafter.markov_w2.weight.normal_(0.0, 0.5)
    vocab = DRAFT_VOCAB
    soft = LossWeights()
    with torch.no_grad():
        parts = drafter_loss(tiny_target, drafter, fixed, soft, autocast=False, vocab=vocab)
        data_parts = drafter_loss(tiny_target, drafter, fixed, LossWeights(ce_target="data"), False, vocab)
        targets, full_log_pd = _draft_log_probs(tiny_target, drafter, fixed)
        log_pd = torch.log_softmax(full_log_pd[..., vocab], -1)  # a softmax over the K tokens alone
        p_t = torch.softmax(targets.target_logits.float(), -1)
        w = position_weights(BLOCK, soft.decay, log_pd.device)[None, :] * targets.valid
        expected_ce = -(p_t[..., vocab] * log_pd).sum(-1)
        outside = torch.ones(p_t.shape[-1], dtype=torch.bool)
        outside[vocab] = False
        expected_l1 = (log_pd.exp() - p_t[..., vocab]).abs().sum(-1) + p_t[..., outside].sum(-1)
        position = torch.full((p_t.shape[-1],), -1)
        position[vocab] = torch.arange(vocab.numel())
        label_index = position[targets.labels]
        kept = w * (label_index >= 0)
        expected_data_ce = -log_pd.gather(-1, label_index.clamp(min=0)[..., None]).squeeze(-1)
        drafts = vocab[log_pd.argmax(-1)]
        hit = (drafts == targets.target_logits.argmax(-1))[targets.valid.all(-1)]
    torch.testing.assert_close(parts.ce, (w * expected_ce).sum() / w.sum())
    torch.testing.assert_close(parts.l1, (w * expected_l1).sum() / w.sum())
    torch.testing.assert_close(data_parts.ce, (kept * expected_data_ce).sum() / kept.sum())
    assert bool((label_index < 0).logical_and(targets.valid.bool()).any())  # some labels are outside
    torch.testing.assert_close(parts.survival, hit.float().cumprod(-1).mean(0))
    # Only the K rows of the Markov head's W2 take part: the others get no gradient.
    drafter.zero_grad(set_to_none=True)
    drafter_loss(tiny_target, drafter, fixed, soft, autocast=False, vocab=vocab).total.backward()
    grad = drafter.markov_w2.weight.grad
    assert bool((grad[outside] == 0).all()) and bool((grad[vocab] != 0).any())


def test_training_over_a_draft_vocabulary_lowers_its_loss_and_resumes_only_over_it(
    tiny_target, records, tmp_path
) -> None:
    fixed = next(AnchorSampler(records, 16, 4, 64, seed=128))
    drafter = _drafter(tiny_target)
    cpu = torch.device("cpu")
    with torch.no_grad():
        before = drafter_loss(tiny_target, drafter, fixed, LossWeights(), False, DRAFT_VOCAB)
    trainer = Trainer(tiny_target, drafter, records, _config(30), tmp_path, cpu, DRAFT_VOCAB)
    trainer.run()
    with torch.no_grad():
        after = drafter_loss(tiny_target, drafter, fixed, LossWeights(), False, DRAFT_VOCAB)
    assert float(after.total) < 0.8 * float(before.total)
    with pytest.raises(ValueError, match="draft vocabulary"):
        Trainer(tiny_target, _drafter(tiny_target), records, _config(40), tmp_path, cpu).load_state()
    fewer = DRAFT_VOCAB[:4]
    with pytest.raises(ValueError, match="draft vocabulary"):
        Trainer(tiny_target, _drafter(tiny_target), records, _config(40), tmp_path, cpu, fewer).load_state()
    again = Trainer(tiny_target, _drafter(tiny_target), records, _config(40), tmp_path, cpu, DRAFT_VOCAB)
    again.load_state()
    assert again.step == 30
