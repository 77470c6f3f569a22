"""benchmarks/overlap.py: overlap settings side by side, and the steady window its GPU-busy shares are
measured over (CPU with the tiny models; the shares themselves on a GPU)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import overlap  # noqa: E402
from tiny_models import tiny_engine_config  # noqa: E402

from dspark import LLM  # noqa: E402


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random()
    return [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 9))] for _ in range(count)]


def test_the_steady_window_runs_its_steps_after_the_prompts_are_in_and_drains(tiny_target_dir) -> None:
    llm = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off"))
    engine = llm.engine
    seen: list[int] = []

    def window(run):  # noqa: ANN001, ANN202
        before = engine.loop_counters.steps
        assert not any(s.in_prefill for s in engine.scheduler.running)  # decoding when the window opens
        run()
        seen.append(engine.loop_counters.steps - before)
        return "value"

    assert overlap._steady_window(llm, _prompts(3), 5, 40, window) == "value"
    assert seen == [5]
    assert not engine.has_unfinished_requests()


def test_the_sweep_on_a_cpu_keeps_outputs_and_leaves_the_busy_shares_unmeasured(
    tiny_target_dir, tmp_path
) -> None:
    out = tmp_path / "overlap.json"
    overlap.main(
        [
            "--model", str(tiny_target_dir), "--device", "cpu", "--batch-sizes", "2", "--modes", "off",
            "--settings", "ahead,off", "--max-tokens", "12", "--repeats", "1", "--busy-steps", "4",
            "--out", str(out),
        ]
    )  # fmt: skip
    row = json.loads(out.read_text())["rows"][0]["off"]
    for setting in ("ahead", "off"):
        assert row[setting]["identical"] == 1.0
        assert row[setting]["busy"] is None and row[setting]["stream_busy"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_the_stream_busy_share_is_a_share_and_the_runner_is_restored(tiny_target_dir) -> None:
    llm = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off", device="cuda"))
    share = overlap.stream_busy_share(llm, _prompts(4), 6, 40)
    assert share is not None and 0.0 < share <= 1.0
    assert not {"run", "run_following"} & set(vars(llm.engine.runner))  # the class's methods again
