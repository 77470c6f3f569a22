"""benchmarks/gate_timeline.py: every step of a serve-default engine recorded with its draft length and
the time its gate measured, the plain engine's steps too, on the CPU with the tiny models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gate_timeline  # noqa: E402


def test_the_gate_s_times_are_the_ones_it_recorded_for_each_length(
    tiny_target_dir, tiny_drafter_dir, tmp_path
):
    out = tmp_path / "timeline.json"
    gate_timeline.main(
        [
            "--model",
            str(tiny_target_dir),
            "--draft-model",
            str(tiny_drafter_dir),
            "--device",
            "cpu",
            "--batch",
            "4",
            "--max-tokens",
            "24",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    default, plain = report["default"], report["off"]
    assert {r["length"] for r in plain["steps"]} == {0}
    assert not any(r["gate_ms"] is not None for r in plain["steps"])
    steps = default["steps"]
    assert len(steps) >= 24 // 5 and steps[0]["prefill"]  # the first step prefills every prompt
    timed = [r for r in steps if r["gate_ms"] is not None]
    assert timed and not any(r["prefill"] for r in timed)
    # Without overlap (the CPU) a step is measured from its own launch: within its finish-to-finish time.
    gaps = {id(b): 1e3 * (b["finish_s"] - a["finish_s"]) for a, b in zip(steps, steps[1:], strict=False)}
    assert all(r["gate_ms"] <= gaps[id(r)] + 1e-6 for r in timed if id(r) in gaps)
    rows = {row["length"]: row for row in default["lengths"]}
    assert sum(row["steps"] for row in rows.values()) == len(steps)
    assert sum(row["gate_timed"] for row in rows.values()) == len(timed)


def test_summary_takes_medians_per_length() -> None:
    records = [
        gate_timeline.StepRecord(0, True, finish_s=0.000),
        gate_timeline.StepRecord(0, False, finish_s=0.002, device_ms=1.0, gate_ms=2.0),
        gate_timeline.StepRecord(3, False, finish_s=0.005, device_ms=2.0),
        gate_timeline.StepRecord(3, False, finish_s=0.009, device_ms=2.5, gate_ms=4.0, syncs=["a.py:1"]),
    ]
    rows = {row["length"]: row for row in gate_timeline.summary(records)}
    assert rows[0] == {
        "length": 0,
        "steps": 2,
        "gate_timed": 1,
        "gate_ms": 2.0,
        "timed_device_ms": 1.0,
        "timed_finish_gap_ms": 2.0,
        "decode_device_ms": 1.0,
        "decode_finish_gap_ms": 2.0,
        "decode_device_idle_ms": None,
        "decode_gap_sum_ms": 2.0,
        "prefill_steps": 1,
        "prefill_finish_gap_ms": None,
        "prefill_gap_sum_ms": 0,
        "prefill_replayed_share": 0.0,
        "decode_launch_ms": 0.0,
        "decode_complete_ms": 0.0,
        "replayed_share": 0.0,
        "ahead_share": 0.0,
        "steps_with_syncs": 0,
        "syncs": {},
        "steps_with_device_allocs": 0,
        "steps_with_host_allocs": 0,
    }
    assert rows[3]["decode_finish_gap_ms"] == 3.5 and rows[3]["timed_finish_gap_ms"] == 4.0
    assert rows[3]["steps_with_syncs"] == 1 and rows[3]["syncs"] == {"a.py:1": 1}


def test_batches_run_before_leave_their_tiers_in_the_gate(
    tiny_target_dir, tiny_drafter_dir, tmp_path
) -> None:
    out = tmp_path / "timeline.json"
    common = ["--model", str(tiny_target_dir), "--draft-model", str(tiny_drafter_dir), "--device", "cpu"]
    gate_timeline.main([*common, "--batch", "2", "--max-tokens", "12", "--out", str(out)])
    alone = json.loads(out.read_text())
    first = ["--before", "7", "--before-runs", "1"]
    gate_timeline.main([*common, "--batch", "2", "--max-tokens", "12", *first, "--out", str(out)])
    after = json.loads(out.read_text())
    assert alone["before"] == [] and after["before"] == [7]
    # The gate keeps a tier per power of two of requests: 7 requests' steps land in tier 8 (and the
    # smaller tiers their ramp passes through), which the timed batch of 2 alone never reaches.
    assert 8 not in alone["default"]["gate_tiers"] and 8 in after["default"]["gate_tiers"]
    assert "0" in after["default"]["gate_rates"]  # plain's rate, among the lengths it rates (JSON keys)


def test_sustained_load_refills_slots_and_times_each_mode(
    tiny_target_dir, tiny_drafter_dir, tmp_path
) -> None:
    out = tmp_path / "timeline.json"
    common = ["--model", str(tiny_target_dir), "--draft-model", str(tiny_drafter_dir), "--device", "cpu"]
    gate_timeline.main(
        [
            *common,
            "--batch",
            "2",
            "--max-tokens",
            "8",
            "--sustained",
            "3",
            "--modes",
            "static,off",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert set(report) >= {"static", "off"} and "default" not in report
    plain = report["off"]
    # 6 requests, 2 in flight, 8 tokens each: more prompt-taking steps than one batch's single one, and
    # every step's finish-to-finish time lands in the decode or the prefill sum of its length.
    assert sum(1 for r in plain["steps"] if r["prefill"]) >= 2
    row = plain["lengths"][0]
    gaps = [
        1e3 * (b["finish_s"] - a["finish_s"])
        for a, b in zip(plain["steps"], plain["steps"][1:], strict=False)
    ]
    assert abs(row["decode_gap_sum_ms"] + row["prefill_gap_sum_ms"] - sum(gaps)) < 0.5


def test_answer_lengths_are_seeded_spread_and_one_length_without_spread() -> None:
    import e2e

    assert e2e.answer_lengths(5, 100, 0.0) == [100] * 5
    lengths = e2e.answer_lengths(400, 100, 0.5)
    assert lengths == e2e.answer_lengths(400, 100, 0.5)  # every engine gets the same lengths
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 50


def test_sustained_load_ends_each_request_at_its_own_length(tiny_target_dir) -> None:
    import collections

    import e2e

    from dspark import LLM, EngineConfig

    llm = LLM(EngineConfig(model=str(tiny_target_dir), device="cpu", spec_mode="off", num_kv_pages=256))
    engine, produced = llm.engine, collections.Counter()
    step = engine.step

    def counted():  # noqa: ANN202 - the engine's signature
        deltas = step()
        for delta in deltas:
            produced[delta.request_id.split("-")[1]] += len(delta.new_token_ids)
        return deltas

    engine.step = counted  # type: ignore[method-assign]
    ids = [[(5 * i + j) % 7 + 1 for j in range(6)] for i in range(6)]
    lengths = e2e.answer_lengths(len(ids), 8, 0.5)
    whole, _, _ = e2e._time_sustained_once(llm, ids, 2, lengths)
    llm.close()
    assert whole > 0 and len(set(lengths)) > 1
    assert [produced[str(i)] for i in range(len(ids))] == lengths


def test_forced_modes_hold_or_alternate_the_gate_s_choice(
    tiny_target_dir, tiny_drafter_dir, tmp_path
) -> None:
    # fixedL: the serve default's engine with every decode launch at L drafts; switchN: N plain
    # launches, then N at the block, in turn (what a length and a switch cost there).
    out = tmp_path / "timeline.json"
    common = ["--model", str(tiny_target_dir), "--draft-model", str(tiny_drafter_dir), "--device", "cpu"]
    args = ["--batch", "2", "--max-tokens", "16", "--modes", "fixed1,switch2", "--out", str(out)]
    gate_timeline.main([*common, *args])
    report = json.loads(out.read_text())

    def decode_steps(mode: str) -> dict[int, int]:
        return {row["length"]: row["steps"] - row["prefill_steps"] for row in report[mode]["lengths"]}

    # The one plain decode step of fixed1: the batch's first request decoding while the second's prompt
    # is still taken in, when the engine does not ask the gate.
    fixed, switched = decode_steps("fixed1"), decode_steps("switch2")
    assert set(fixed) <= {0, 1} and fixed.get(0, 0) <= 1 and fixed[1] >= 4
    assert set(switched) == {0, max(switched)} and max(switched) > 1 and switched[0] >= 2
