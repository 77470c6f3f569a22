"""One VerifyPolicy per spec_mode, chosen once from the config: what each verifies and commits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dspark.config import SPEC_MODES, EngineConfig
from dspark.spec.drafts import Drafts
from dspark.spec.planner import VerifyPlanner
from dspark.spec.sps_table import SpsTable
from dspark.spec.step_draft import InStepDrafts
from dspark.spec.verify_policy import (
    CapAcceptPolicy,
    CompactPolicy,
    OffPolicy,
    StaticPolicy,
    VerifyPlan,
    verify_policy,
)

BLOCK = 4
# Fewer tokens a step, far more steps per second: the planner admits only the likeliest drafts.
STEEP_SPS = SpsTable([(1, 1000.0), (2, 600.0), (4, 300.0), (8, 100.0), (16, 10.0)])


def _drafts(confidences: list[list[float]], lengths: list[int] | None = None) -> Drafts:
    conf = torch.tensor(confidences)
    tokens = torch.arange(conf.numel()).view(conf.shape)
    return Drafts(tokens, conf, [None] * len(confidences), None if lengths is None else torch.tensor(lengths))


@pytest.mark.parametrize(
    ("mode", "policy"),
    [
        ("off", OffPolicy),
        ("static", StaticPolicy),
        ("compact", CompactPolicy),
        ("cap-accept", CapAcceptPolicy),
    ],
)
def test_each_spec_mode_has_its_own_policy(mode, policy) -> None:
    assert isinstance(verify_policy(EngineConfig(spec_mode=mode), BLOCK), policy)
    assert mode in SPEC_MODES


def test_only_compact_stops_drafting_early_and_only_static_drafts_inside_the_target_step() -> None:
    config = EngineConfig(draft_stop_survival=0.2)
    policies = {mode: verify_policy(config.replace(spec_mode=mode), BLOCK) for mode in SPEC_MODES}
    assert {m: p.draft_stop_survival for m, p in policies.items()} == {
        "off": 0.0,
        "static": 0.0,
        "compact": 0.2,
        "cap-accept": 0.0,
    }
    assert [m for m, p in policies.items() if p.drafts_in_step] == ["static"]
    assert [m for m, p in policies.items() if p.uses_planner] == ["compact", "cap-accept"]


def test_compact_under_a_flat_table_drafts_whole_blocks_inside_the_target_step() -> None:
    # A flat table never charges a verified token, so the plan is the caps whatever the confidences:
    # compact drafts as static does (in the step, whole blocks) and reads neither planner nor table.
    config = EngineConfig(spec_mode="compact", draft_stop_survival=0.2)
    flat = verify_policy(config, BLOCK, flat_table=True)
    planned = verify_policy(config, BLOCK, flat_table=False)
    assert (flat.drafts_in_step, flat.uses_planner, flat.draft_stop_survival) == (True, False, 0.0)
    assert (planned.drafts_in_step, planned.uses_planner, planned.draft_stop_survival) == (False, True, 0.2)
    in_step = InStepDrafts(proposer=None, seqs=[])  # never drafted: the plan does not read it
    assert flat.plan(in_step, [4, 2], VerifyPlanner("sync", SpsTable.flat())) == VerifyPlan(
        (4, 2), (4, 2), in_step
    )
    with pytest.raises(AssertionError):
        planned.plan(in_step, [4, 2], VerifyPlanner("sync", STEEP_SPS))
    # Drafted apart (sampling requests, a step without graphs), it verifies what was drafted.
    drafts = _drafts([[0.01] * BLOCK, [0.99] * BLOCK], lengths=[1, 4])
    assert flat.plan(drafts, [4, 2], VerifyPlanner("sync", SpsTable.flat())).verify_lens == (1, 2)


def test_static_verifies_and_commits_every_cap_whatever_the_confidences() -> None:
    drafts = _drafts([[0.01] * BLOCK, [0.99] * BLOCK], lengths=[4, 4])
    plan = StaticPolicy().plan(drafts, [4, 2], VerifyPlanner("sync", STEEP_SPS))
    assert plan == VerifyPlan((4, 2), (4, 2), drafts)
    # Lowered only to what a request drafted (a copied block shorter than the block, `spec.lookup`).
    short = _drafts([[0.01] * BLOCK, [0.99] * BLOCK], lengths=[1, 4])
    assert StaticPolicy().plan(short, [4, 2], VerifyPlanner("sync", STEEP_SPS)) == VerifyPlan(
        (1, 2), (1, 2), short
    )


def test_compact_verifies_no_draft_past_a_requests_early_stop() -> None:
    drafts = _drafts([[0.9] * BLOCK, [0.9] * BLOCK], lengths=[1, 3])
    plan = CompactPolicy(BLOCK, 0.05).plan(drafts, [4, 2], VerifyPlanner("sync", SpsTable.flat()))
    assert plan.verify_lens == plan.commit_caps == (1, 2)


def test_cap_accept_verifies_everything_drafted_and_commits_only_the_plan() -> None:
    drafts = _drafts([[0.95, 0.9, 0.1, 0.1], [0.2, 0.1, 0.1, 0.1]])
    planner = VerifyPlanner("sync", STEEP_SPS)
    planned = CompactPolicy(BLOCK, 0.0).plan(drafts, [4, 4], planner)
    plan = CapAcceptPolicy(BLOCK).plan(drafts, [4, 4], VerifyPlanner("sync", STEEP_SPS))
    assert plan.verify_lens == (4, 4)
    assert plan.commit_caps == planned.verify_lens
    assert sum(plan.commit_caps) < 8, "the planner must cut something for this test to say anything"


def test_off_plans_plain_steps() -> None:
    assert OffPolicy().plan(
        _drafts([[0.9] * BLOCK]), [4], VerifyPlanner("sync", STEEP_SPS)
    ) == VerifyPlan.plain(1)


# Modules that may read spec_mode: where it is parsed, and where a policy is chosen from it.
MODE_READERS = {"config.py", "verify_policy.py"}


def test_no_module_compares_a_spec_mode_past_config_parsing() -> None:
    root = Path(__file__).resolve().parents[1] / "backend" / "dspark"
    offending = []
    for path in sorted(root.rglob("*.py")):
        if path.name in MODE_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "spec_mode"
                and isinstance(node.ctx, ast.Load)
            ):
                offending.append(f"{path.relative_to(root)}:{node.lineno} reads spec_mode")
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in SPEC_MODES for o in operands):
                    offending.append(f"{path.relative_to(root)}:{node.lineno} compares with a mode name")
    assert not offending, "\n".join(offending)
