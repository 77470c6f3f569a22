"""The capacity variants train and serve: `train-draft` builds drafters with two layers, chosen target
layers, another Markov rank and an anchor feature; a two-layer drafter and an anchor-feature one draft
in the engine (eagerly and through emulated
draft graphs, in the step too) with greedy output equal to plain decoding; `draft-cost` times a step."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_models import decaying_sps_table, write_tiny_drafter

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.cuda_graphs import CudaGraphs
from dspark.runner.models.loader import load_target_model
from dspark.spec.draft_checkpoint import load_drafter
from dspark.tools.cli import main as dspark
from dspark.training.data import distill
from dspark.training.shards import write_shard


def _config(target_dir, draft_dir, spec_mode: str, sps_table: str = "") -> EngineConfig:
    """The tiny engine sized for emulated graphs of 32 tokens and 4 requests, drafting every step."""
    return EngineConfig(
        model=str(target_dir),
        draft_model=str(draft_dir),
        spec_mode=spec_mode,
        sps_table=sps_table,
        num_kv_pages=256,
        kv_page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        adaptive_speculation=False,
    )


@pytest.mark.parametrize("drafter", ["two_layer_drafter_dir", "anchor_drafter_dir"])
@pytest.mark.parametrize("spec_mode", ["static", "compact"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_a_variant_drafter_keeps_the_greedy_output_of_plain_decoding(
    tiny_target_dir, drafter, spec_mode, graphs, tmp_path, request
) -> None:
    """A two-layer drafter, and one with an anchor feature (its rows kept per cache slot and read
    by every block, in the step too), draft with greedy output equal to plain decoding."""
    draft_dir = request.getfixturevalue(drafter)
    loaded = load_drafter(draft_dir, torch.float32, "cpu")
    assert len(loaded.layers) == 2 if drafter == "two_layer_drafter_dir" else loaded.anchor_fc is not None
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLM(_config(tiny_target_dir, "", "off")).generate(params=params, prompt_token_ids=prompts)
    # `compact` under a table where verifying costs: it plans from the confidences, drafting apart.
    table = decaying_sps_table(tmp_path) if spec_mode == "compact" else ""
    config = _config(tiny_target_dir, draft_dir, spec_mode, table)
    llm = LLM(config)
    if graphs:
        runner = llm.engine.runner
        runner.use_graphs(CudaGraphs(runner.model, runner.cache, runner.device, 32, 4, emulate=True))
        llm.engine.proposer.use_graphs(config.max_num_seqs, max_pages=64, emulate=True)
    outs = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.spec_stats.accepted_tokens for o in outs) > 0
    if graphs:  # `static` drafts inside the target step, `compact` replays its own blocks
        proposer_graphs = llm.engine.proposer.graphs
        assert bool(proposer_graphs.captured_in_step if spec_mode == "static" else proposer_graphs.captured)


def test_train_draft_builds_each_capacity_variant(tiny_target_dir, tmp_path) -> None:
    rng = random.Random(0)
    prompts = [(f"p{i}", "chat", [rng.randrange(1, 8) for _ in range(rng.randrange(2, 8))]) for i in range(8)]
    records = distill(load_target_model(tiny_target_dir), prompts, [0.0] * 8, [], 16, 8, seed=0)
    data = write_shard(tmp_path / "d.npz", records, [], {})
    base = f"train-draft --target {tiny_target_dir} --data {data} --steps 1 --batch-size 4 --anchors 2"
    variants = {
        "two-layers": ("--num-layers 2 --block-size 7", {"num_hidden_layers": 2, "block_size": 7}),
        "layers-0-1": ("--target-layers 0,1", {"target_layer_ids": [0, 1]}),
        "rank-8": ("--markov-rank 8 --num-target-features 1", {"markov_rank": 8, "target_layer_ids": [1]}),
        "argmax-ce": ("--ce-target argmax --target-layers 1", {"target_layer_ids": [1]}),
        "anchor-feature": ("--anchor-feature", {"anchor_feature": True}),
    }
    for name, (flags, expected) in variants.items():
        out = tmp_path / name
        assert dspark(f"{base} --out {out} {flags}".split()) == 0, name
        config = json.loads((out / "config.json").read_text())
        assert {key: config[key] for key in expected} == expected, name
        load_drafter(out, torch.float32, "cpu")
    with pytest.raises(ValueError, match="target_layer_ids"):
        dspark(f"{base} --out {tmp_path / 'bad'} --target-layers 0,5".split())


def test_draft_cost_times_a_step_at_each_batch_size(tiny_target_dir, two_layer_drafter_dir, tmp_path) -> None:
    single = write_tiny_drafter(tiny_target_dir, tmp_path / "one-layer")
    costs = {}
    for name, draft_dir in (("one", single), ("two", two_layer_drafter_dir)):
        out = tmp_path / f"{name}.json"
        command = (
            f"draft-cost --target {tiny_target_dir} --draft-model {draft_dir} --batches 1,4 --context 9 "
            f"--repeats 3 --out {out}"
        )
        assert dspark(command.split()) == 0
        costs[name] = json.loads(out.read_text())
        assert set(costs[name]["ms_per_step"]) == {"1", "4"}
        assert all(ms > 0 for ms in costs[name]["ms_per_step"].values())
    assert costs["two"]["parameters"] > costs["one"]["parameters"]
