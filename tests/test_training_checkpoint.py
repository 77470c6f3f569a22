"""A trained drafter survives the DSpark checkpoint format: save -> load gives identical weights and
outputs, bf16 files hold the bf16 rounding of the weights, calibrated temperatures are read back, a
warm restart from a checkpoint continues from its loss, and a deepened drafter starts where it was."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from dspark.runner.models.loader import load_target_model
from dspark.spec.draft_checkpoint import load_drafter, save_drafter
from dspark.training.calibration import write_temperatures
from dspark.training.data import distill
from dspark.training.dense import target_pass
from dspark.training.draft_forward import block_hidden, confidence_logits
from dspark.training.trainer import (
    LOG_FILE,
    TrainConfig,
    Trainer,
    deepened,
    drafter_loss,
    new_drafter,
    trainable_from_checkpoint,
    with_anchor_feature,
)


def _trained(target_dir, tmp_path):
    target = load_target_model(target_dir)
    rng = random.Random(0)
    prompts = [(str(i), "code", [rng.randrange(1, 8) for _ in range(4)]) for i in range(8)]
    records = distill(target, prompts, [0.0] * 8, [], 12, 8, seed=0)
    drafter = new_drafter(target.config, 4, 1, 4, 2, seed=0, mask_token_id=1)
    config = TrainConfig(steps=3, batch_size=4, anchors_per_sequence=2, warmup_steps=1, save_every=100)
    Trainer(target, drafter, records, config, tmp_path / "work", torch.device("cpu")).run()
    return target, drafter.requires_grad_(False)


def _trained_further(target, drafter, seed: int, work_dir):
    """`drafter` trained two more steps on the target's answers to 8 random prompts."""
    rng = random.Random(seed)
    prompts = [(str(i), "code", [rng.randrange(1, 8) for _ in range(4)]) for i in range(8)]
    records = distill(target, prompts, [0.0] * 8, [], 12, 8, seed=0)
    config = TrainConfig(steps=2, batch_size=4, anchors_per_sequence=2, warmup_steps=1, save_every=100)
    return Trainer(target, drafter, records, config, work_dir, torch.device("cpu")).run()


def _outputs(target, drafter) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([[3, 4, 5, 1, 6, 2, 7, 7, 3, 1, 4]])
    _, features = target_pass(target, tokens, drafter.config.target_layer_ids)
    hidden = block_hidden(drafter, target.embed_tokens.weight, features, tokens, torch.tensor([[2, 6]]))
    markov = drafter.markov_features(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1]]))
    return hidden, confidence_logits(drafter, hidden[0], markov)


def test_saved_drafter_loads_with_identical_weights_and_outputs(tiny_target_dir, tmp_path) -> None:
    target, drafter = _trained(tiny_target_dir, tmp_path)
    save_drafter(drafter, tmp_path / "fp32", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "fp32", torch.float32, "cpu")
    assert loaded.config == drafter.config
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    for a, b in zip(_outputs(target, drafter), _outputs(target, loaded), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bf16_checkpoint_holds_the_rounded_weights(tiny_target_dir, tmp_path) -> None:
    _, drafter = _trained(tiny_target_dir, tmp_path)
    save_drafter(drafter, tmp_path / "bf16")
    loaded = load_drafter(tmp_path / "bf16", torch.float32, "cpu")
    for (name, a), b in zip(drafter.named_parameters(), loaded.parameters(), strict=True):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, atol=0, rtol=0, msg=name)


def test_calibrated_temperatures_are_read_back(tiny_drafter_dir, tmp_path) -> None:
    draft_dir = tmp_path / "drafter"
    draft_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (draft_dir / name).write_bytes((tiny_drafter_dir / name).read_bytes())
    write_temperatures(draft_dir, [0.5, 1.25, 2.0, 3.5])
    loaded = load_drafter(draft_dir, torch.float32, "cpu")
    assert loaded.confidence_temperatures.tolist() == [0.5, 1.25, 2.0, 3.5]


def test_training_continues_from_a_checkpoint_on_blocks_of_another_length(tiny_target_dir, tmp_path) -> None:
    target, drafter = _trained(tiny_target_dir, tmp_path)
    save_drafter(drafter, tmp_path / "start", dtype=torch.float32)
    write_temperatures(tmp_path / "start", [0.5, 1.25, 2.0, 3.5])
    resumed = trainable_from_checkpoint(tmp_path / "start", block_size=2)
    assert resumed.config.block_size == 2 and resumed.confidence_temperatures.tolist() == [1.0, 1.0]
    for (name, a), b in zip(drafter.state_dict().items(), resumed.state_dict().values(), strict=True):
        if name != "confidence_temperatures":
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert all(p.requires_grad for p in resumed.parameters())
    rng = random.Random(1)
    prompts = [(str(i), "code", [rng.randrange(1, 8) for _ in range(4)]) for i in range(8)]
    records = distill(target, prompts, [0.0] * 8, [], 12, 8, seed=0)
    config = TrainConfig(steps=2, batch_size=4, anchors_per_sequence=2, warmup_steps=1, save_every=100)
    trained = Trainer(target, resumed, records, config, tmp_path / "work2", torch.device("cpu")).run()
    save_drafter(trained, tmp_path / "continued")
    assert load_drafter(tmp_path / "continued", torch.float32, "cpu").config.block_size == 2


def test_a_warm_restart_starts_from_the_checkpoints_loss_not_a_fresh_drafters(
    tiny_target_dir, tmp_path
) -> None:
    target, drafter = _trained(tiny_target_dir, tmp_path)
    save_drafter(drafter, tmp_path / "run0", dtype=torch.float32)
    rng = random.Random(2)
    prompts = [(str(i), "code", [rng.randrange(1, 8) for _ in range(4)]) for i in range(8)]
    records = distill(target, prompts, [0.0] * 8, [], 12, 8, seed=0)
    config = TrainConfig(
        steps=2,
        batch_size=4,
        anchors_per_sequence=2,
        warmup_steps=1,
        log_every=1,
        save_every=100,
        run_index=1,
    )
    trainer = Trainer(
        target,
        trainable_from_checkpoint(tmp_path / "run0", 4),
        records,
        config,
        tmp_path / "run1",
        torch.device("cpu"),
    )
    first_batch = next(copy.deepcopy(trainer.sampler))
    fresh = new_drafter(target.config, 4, 1, 4, 2, seed=0, mask_token_id=1)
    with torch.no_grad():
        restored_loss = float(drafter_loss(target, drafter, first_batch, config.weights, False).total)
        fresh_loss = float(drafter_loss(target, fresh, first_batch, config.weights, False).total)
    trainer.run()
    first = json.loads((tmp_path / "run1" / LOG_FILE).read_text().splitlines()[0])
    assert (first["run"], first["step"]) == (1, 1)
    assert first["loss"] == pytest.approx(restored_loss, abs=1e-4)
    assert abs(first["loss"] - fresh_loss) > 0.01


def test_a_deepened_drafter_computes_what_it_did_then_trains_its_new_layers(
    tiny_target_dir, tmp_path
) -> None:
    target, drafter = _trained(tiny_target_dir, tmp_path)
    save_drafter(drafter, tmp_path / "one", dtype=torch.float32)
    grown = deepened(trainable_from_checkpoint(tmp_path / "one", 4), 3)
    assert grown.config.num_hidden_layers == 3 and len(grown.layers) == 3
    assert deepened(drafter, 1) is drafter
    with pytest.raises(ValueError, match="num_layers"):
        deepened(grown, 2)
    with torch.no_grad():
        for a, b in zip(_outputs(target, drafter), _outputs(target, grown), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    trained = _trained_further(target, grown, 3, tmp_path / "work3")
    for layer in trained.layers[1:]:
        assert layer.self_attn.o_proj.weight.abs().sum() > 0 and layer.mlp.down_proj.weight.abs().sum() > 0
    save_drafter(trained, tmp_path / "three", dtype=torch.float32)
    assert load_drafter(tmp_path / "three", torch.float32, "cpu").config.num_hidden_layers == 3


def test_an_anchor_feature_starts_at_zero_trains_and_survives_the_checkpoint(
    tiny_target_dir, tmp_path
) -> None:
    """A drafter grown an anchor feature (the anchor's context row into every block input) computes what
    it did; training moves the new projection; it saves and loads."""
    target, drafter = _trained(tiny_target_dir, tmp_path)
    save_drafter(drafter, tmp_path / "base", dtype=torch.float32)
    grown = with_anchor_feature(trainable_from_checkpoint(tmp_path / "base", 4))
    assert grown.config.anchor_feature and with_anchor_feature(grown) is grown
    with torch.no_grad():
        for a, b in zip(_outputs(target, drafter), _outputs(target, grown), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    trained = _trained_further(target, grown, 5, tmp_path / "work-anchor")
    assert trained.anchor_fc.weight.abs().sum() > 0
    with torch.no_grad():  # the anchor's row now changes the blocks
        assert not torch.allclose(_outputs(target, trained)[0], _outputs(target, drafter)[0])
    save_drafter(trained, tmp_path / "anchor", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "anchor", torch.float32, "cpu")
    assert loaded.config.anchor_feature
    torch.testing.assert_close(loaded.anchor_fc.weight, trained.anchor_fc.weight, atol=0, rtol=0)
    fresh = new_drafter(target.config, 4, 1, 4, 2, seed=0, mask_token_id=1, anchor_feature=True)
    assert fresh.anchor_fc.weight.abs().sum() == 0
