"""CUDA-graph capture agreed over tensor-parallel ranks, run on CPU with TP 2 (gloo) and emulated graphs
(each replay runs the forward eagerly from the padded static buffers, collectives included, so ranks
that disagreed on a step's tier would all-reduce tensors of different sizes): every rank captures
the same tiers; a rank that can capture fewer makes every rank capture fewer; a rank whose capture
fails makes every rank run eagerly; configured tiers that are not powers of two (60, 96, 112) pad
steps as they should. Greedy tokens equal the eager engine's throughout.

Rank 1 is a spawned process: the test replaces `tp_worker.worker_main` (the spawned target) with
`hooked_worker_main`, which installs the same hooks in that process and reports what the rank did; the
driver hands it `emulated_shard` as its shard loader (`WorkerSpec.load_shard`, the patched
`ModelRunner.create`)."""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tensor_parallel import one_thread

from dspark import LLM, EngineConfig, SamplingParams
from dspark.parallel import tp_worker
from dspark.parallel.distributed import SINGLE, TensorParallel
from dspark.runner import cuda_graphs
from dspark.runner.cuda_graphs import CudaGraphs, all_tiers, step_tiers
from dspark.runner.model_runner import ModelRunner

TIERS = [1, 2, 4, 8, 16, 32, 60, 96, 112]
MAX_REQUESTS = 4
# Prompt lengths whose prefill steps, alone, take the 60, 96 and 112 tiers (together: chunks, mixed).
PROMPT_LENS = [100, 50, 80, 20, 5, 3, 40]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def engine_config(target: Path, **changes: Any) -> EngineConfig:
    """The tiny target, plain decoding, graphs of the TIERS token tiers and up to 4 requests."""
    config = EngineConfig(
        model=str(target),
        spec_mode="off",
        num_kv_pages=256,
        kv_page_size=4,
        max_num_seqs=MAX_REQUESTS,
        max_num_batched_tokens=TIERS[-1],
        cuda_graph_token_tiers=",".join(map(str, TIERS)),
        tensor_parallel_timeout_s=30,  # a disagreement fails a collective, it must not hang the suite
    )
    return config.replace(**changes)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, 8) for _ in range(n)] for n in PROMPT_LENS]


# Hooks, installed in the test's process (rank 0) and in the spawned one (rank 1) -----------------------


@dataclass(frozen=True)
class Hooks:
    """Test-only changes: every rank gets emulated graphs (CPU) and records what it captured and
    replayed; rank `rank` alone can capture all tiers but `drop_tiers`, and its capture of the
    `fail_at_tokens` tier raises (after the forward ran: as a CUDA capture fails after its warm-up)."""

    report_dir: str
    rank: int = 1
    drop_tiers: tuple[int, ...] = ()
    fail_at_tokens: int = 0


# The real shard loader, as this module is imported (in the test's process and in a spawned rank's,
# before any hook is installed).
LOAD_SHARD = ModelRunner.create


def emulated_shard(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> ModelRunner:
    """`ModelRunner.create`, then emulated graphs (CPU). A module-level function: the driver passes
    `ModelRunner.create` to its ranks (`WorkerGroup.spawn`'s load_shard), so the hooked one must pickle."""
    runner = LOAD_SHARD(config, device, dtype, tp)
    runner.use_graphs(CudaGraphs.from_config(runner.model, runner.cache, device, config, emulate=True))
    return runner


def install(hooks: Hooks, rank: int, patch: Callable[[object, str, object], None]) -> dict[str, Any]:
    """Install `hooks` for `rank` with `patch` (setattr or monkeypatch.setattr); returns the record that
    the hooks fill: the keys the rank captured, its capture log ([tokens, requests, ok] each) and the
    (tokens, requests) tiers it replayed."""
    seen: dict[str, Any] = {"captured": None, "log": [], "replayed": []}
    capture_graphs, replay = ModelRunner.capture_graphs, CudaGraphs.replay

    def recorded_capture(runner: ModelRunner, capture_layers: tuple[int, ...]) -> Any:
        graphs = runner.graphs
        outcome = capture_graphs(runner, capture_layers)
        seen["log"] = [[r.tokens, r.requests, r.ok] for r in graphs.capture_log] if graphs is not None else []
        seen["captured"] = sorted(runner.graphs.captured) if runner.graphs is not None else []
        return outcome

    def recorded_replay(graphs: CudaGraphs, tiers: tuple[int, int], *args: Any) -> Any:
        seen["replayed"].append(tiers)  # what `CudaGraphs.fill` chose for the step
        return replay(graphs, tiers, *args)

    patch(ModelRunner, "create", staticmethod(emulated_shard))
    patch(ModelRunner, "capture_graphs", recorded_capture)
    patch(CudaGraphs, "replay", recorded_replay)
    if rank == hooks.rank and hooks.drop_tiers:
        budget = lambda graphs, layers: [t for t in graphs.token_tiers if t not in hooks.drop_tiers]  # noqa: E731
        patch(cuda_graphs, "capture_budget", budget)
    if rank == hooks.rank and hooks.fail_at_tokens:
        capture = CudaGraphs._capture

        def failing_capture(graphs: CudaGraphs, tokens: int, requests: int, layers: tuple[int, ...]) -> Any:
            captured = capture(graphs, tokens, requests, layers)
            if tokens == hooks.fail_at_tokens:
                raise RuntimeError("injected capture failure")
            return captured

        patch(CudaGraphs, "_capture", failing_capture)
    return seen


def hooked_worker_main(hooks: Hooks, spec: tp_worker.WorkerSpec, conn: Connection) -> None:
    """A spawned rank's entry point: `hooks` installed, then the real one; writes the rank's record."""
    seen = install(hooks, spec.rank, setattr)
    tp_worker.worker_main(spec, conn)
    Path(hooks.report_dir, f"rank{spec.rank}.json").write_text(json.dumps(seen))


# Running ------------------------------------------------------------------------------------------------


def generate(config: EngineConfig) -> list[list[int]]:
    """Greedy token ids of `prompts()`, each alone, then all together."""
    with one_thread():
        llm = LLM(config)
        try:
            alone = [llm.generate(params=PARAMS, prompt_token_ids=[p])[0] for p in prompts()]
            together = llm.generate(params=PARAMS, prompt_token_ids=prompts())
            return [o.token_ids for o in [*alone, *together]]
        finally:
            llm.engine.close()


def run_tp2(config: EngineConfig, hooks: Hooks, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list[dict]]:
    """Greedy tokens of a TP 2 engine with `hooks`, and each rank's record (JSON round-tripped)."""
    seen0 = install(hooks, 0, monkeypatch.setattr)
    monkeypatch.setattr(tp_worker, "worker_main", functools.partial(hooked_worker_main, hooks))
    tokens = generate(config.replace(tensor_parallel_size=2))
    seen1 = json.loads(Path(hooks.report_dir, "rank1.json").read_text())
    return tokens, [json.loads(json.dumps(seen0)), seen1]


def keys(tiers: list[int]) -> list:
    """The captured keys of plain decoding's graphs over `tiers`, as a rank's record lists them."""
    return [[tokens, requests, []] for tokens, requests in sorted(all_tiers(tiers, MAX_REQUESTS))]


def replayed_tokens(seen: dict) -> set[int]:
    return {tokens for tokens, _ in seen["replayed"]}


@pytest.fixture(scope="module")
def eager(tiny_target_dir: Path) -> list[list[int]]:
    """The single-rank eager engine's greedy tokens (graphs are off on a CPU)."""
    return generate(engine_config(tiny_target_dir))


# Tests --------------------------------------------------------------------------------------------------


def test_tp2_ranks_capture_and_replay_the_same_tiers(tiny_target_dir, eager, tmp_path, monkeypatch) -> None:
    tokens, seen = run_tp2(engine_config(tiny_target_dir), Hooks(str(tmp_path)), monkeypatch)
    assert tokens == eager
    assert seen[0]["captured"] == seen[1]["captured"] == keys(TIERS)
    assert seen[0]["replayed"] == seen[1]["replayed"], "every step replayed the same tier on both ranks"
    assert {60, 96, 112} <= replayed_tokens(seen[0]), seen[0]["replayed"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_can_capture_fewer_tiers_makes_every_rank_capture_fewer(
    tiny_target_dir, eager, tmp_path, monkeypatch, caplog, rank
) -> None:
    caplog.set_level(logging.WARNING, logger="dspark")
    # A middle tier and the largest: steps of 5..8 tokens pad to 16, steps above 96 run eagerly.
    hooks = Hooks(str(tmp_path), rank=rank, drop_tiers=(8, 112))
    tokens, seen = run_tp2(engine_config(tiny_target_dir), hooks, monkeypatch)
    agreed = [t for t in TIERS if t not in hooks.drop_tiers]
    assert tokens == eager
    assert seen[0]["captured"] == seen[1]["captured"] == keys(agreed)
    assert seen[0]["replayed"] == seen[1]["replayed"]
    assert {16, 60, 96} <= replayed_tokens(seen[0]) <= set(agreed)
    assert f"rank {rank} can capture token tiers {agreed} of {TIERS}" in caplog.text
    assert f"every rank captures token tiers {agreed}" in caplog.text


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_capture_on_one_rank_makes_every_rank_run_eagerly(
    tiny_target_dir, eager, tmp_path, monkeypatch, caplog, rank
) -> None:
    caplog.set_level(logging.INFO, logger="dspark")
    hooks = Hooks(str(tmp_path), rank=rank, fail_at_tokens=60)
    tokens, seen = run_tp2(engine_config(tiny_target_dir), hooks, monkeypatch)
    assert tokens == eager
    assert seen[0]["captured"] == seen[1]["captured"] == []
    assert seen[0]["replayed"] == seen[1]["replayed"] == []
    # Each rank captured the same tiers up to the failure, the failing rank's last record is the failure.
    assert (
        [r[:2] for r in seen[0]["log"]]
        == [r[:2] for r in seen[1]["log"]]
        == [k[:2] for k in keys(TIERS)][: len(seen[0]["log"])]
    )
    assert seen[rank]["log"][-1] == [60, 1, False] and seen[1 - rank]["log"][-1] == [60, 1, True]
    assert all(ok for _, _, ok in seen[rank]["log"][:-1])
    assert f"cuda graph capture failed on rank {rank} at tokens=60 requests=1: every rank runs eagerly" in (
        caplog.text
    )
    # Rank 0 logged each of its captures up to the failure, with its size and duration.
    captures = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cuda graph capture")]
    assert any(m.startswith("cuda graph captured: tokens=32 requests=4 in ") for m in captures)
    if rank == 0:
        assert "cuda graph capture failed at tokens=60 requests=1: injected capture failure" in captures


# Single rank: configured tiers --------------------------------------------------------------------------


def test_configured_tiers_pad_steps_to_the_smallest_that_holds_them() -> None:
    assert [step_tiers(n, 1, TIERS, 4)[0] for n in (1, 3, 33, 60, 61, 96, 97, 112)] == [
        1,
        4,
        60,
        60,
        96,
        96,
        112,
        112,
    ]
    assert step_tiers(113, 1, TIERS, 4) is None  # above the largest tier: eager
    # A request tier needs a token tier at least as large: 33 requests of a token each pad to 64
    # requests, which 60 cannot hold.
    assert step_tiers(40, 33, TIERS, 64) == (96, 64)
    assert step_tiers(2, 3, TIERS, 64) == (4, 4)
    assert step_tiers(100, 65, TIERS, 64) is None
    assert [r for t, r in all_tiers(TIERS, 64) if t == 60] == [1, 2, 4, 8, 16, 32]
    assert [r for t, r in all_tiers(TIERS, 128) if t == 112] == [1, 2, 4, 8, 16, 32, 64]
    # Every tier step_tiers returns is captured at start-up.
    captured = set(all_tiers(TIERS, 64))
    for tokens in range(1, 113):
        for requests in range(1, min(tokens, 64) + 1):
            assert step_tiers(tokens, requests, TIERS, 64) in captured


def test_configured_tiers_are_validated_sorted_and_bounded() -> None:
    assert EngineConfig(cuda_graph_token_tiers=" 96,60, 112,60").cuda_graph_tiers == [60, 96, 112]
    assert EngineConfig().cuda_graph_tiers == []
    with pytest.raises(ValueError, match="cuda_graph_token_tiers: expected comma-separated token counts"):
        EngineConfig(cuda_graph_token_tiers="60,x")
    with pytest.raises(ValueError, match="cuda_graph_token_tiers: token counts must be >= 1"):
        EngineConfig(cuda_graph_token_tiers="0,60")
    with pytest.raises(ValueError, match=r"cuda_graph_token_tiers: 600 is above .* \(512\)"):
        EngineConfig(cuda_graph_token_tiers="60,600")
    with pytest.raises(ValueError, match=r"cuda_graph_token_tiers: 112 is above .* \(64\)"):
        EngineConfig(cuda_graph_token_tiers="60,112", max_num_batched_tokens=64)
    # Graphs off: the tiers are not used, so they are not held against the limits.
    assert EngineConfig(cuda_graph_token_tiers="600", cuda_graph_max_tokens=0).cuda_graph_tiers == [600]
    parsed = EngineConfig.from_parameters({"cuda_graph_token_tiers": "60,96,112"})
    assert parsed.cuda_graph_tiers == [60, 96, 112]


def test_single_rank_engine_with_configured_tiers_gives_the_eager_tokens(
    tiny_target_dir, eager, tmp_path, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="dspark")
    hooked = install(Hooks(str(tmp_path), rank=-1), 0, monkeypatch.setattr)
    assert generate(engine_config(tiny_target_dir)) == eager
    seen = json.loads(json.dumps(hooked))
    assert seen["captured"] == keys(TIERS)
    assert [r[:2] for r in seen["log"]] == [k[:2] for k in keys(TIERS)] and all(r[2] for r in seen["log"])
    assert {60, 96, 112} <= replayed_tokens(seen)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cuda graph captured: ")]
    assert len(logged) == len(keys(TIERS))
    assert "cuda graph captured: tokens=112 requests=4 in " in logged[-1]
