"""Tensor parallelism on CPU (gloo): TP ranks give the single rank's greedy tokens; a rank that dies or
hangs ends requests with an error instead of a hang; startup errors are clear; no rank outlives its
engine or its driver process."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dspark import LLM, EngineConfig, SamplingParams
from dspark.engine.async_engine import AsyncEngine, EngineDeadError
from dspark.runner.model_runner import TargetStep, create_runner

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def smollm2_config(target: Path, drafter: Path, **changes) -> EngineConfig:
    config = EngineConfig(
        model=str(target),
        draft_model=str(drafter),
        num_kv_pages=64,
        tensor_parallel_timeout_s=60,
        adaptive_speculation=False,  # TP = 1 and TP = 3 must draft on the same steps
    )
    return config.replace(**changes)


def tiny_config(target: Path, **changes) -> EngineConfig:
    return EngineConfig(model=str(target), spec_mode="off", num_kv_pages=8, kv_page_size=4).replace(**changes)


def one_step(capture_layers: tuple[int, ...] = ()) -> TargetStep:
    """A prefill of five tokens in pages 0 and 1, logits at every row."""
    return TargetStep(
        token_ids=torch.tensor([1, 5, 2, 7, 3]),
        positions=torch.arange(5),
        window_starts=[0],
        window_lens=[5],
        pages=[[0, 1]],
        logit_rows=torch.arange(5),
        capture_layers=capture_layers,
    )


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@contextmanager
def one_thread():
    """Run with one intra-op thread, as each rank does: on 2 shared cores, torch's spinning threads
    slow a step down several times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def offline(config: EngineConfig):
    llm = LLM(config)
    try:
        yield llm
    finally:
        llm.engine.close()


def greedy_tokens(config: EngineConfig) -> tuple[list[list[int]], list[int]]:
    """Greedy token ids for PROMPTS and the worker pids the engine had."""
    with one_thread(), offline(config) as llm:
        pids = list(getattr(llm.engine.runner, "worker_pids", []))
        outputs = llm.generate(PROMPTS, GREEDY)
    assert all(o.finish_reason == "length" for o in outputs)
    return [o.token_ids for o in outputs], pids


# Same tokens -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_mode", ["off", "compact"])
def test_tp3_greedy_tokens_equal_single_rank(smollm2_dir, smollm2_drafter_dir, spec_mode):
    single, _ = greedy_tokens(smollm2_config(smollm2_dir, smollm2_drafter_dir, spec_mode=spec_mode))
    tp3, pids = greedy_tokens(
        smollm2_config(smollm2_dir, smollm2_drafter_dir, spec_mode=spec_mode, tensor_parallel_size=3)
    )
    assert tp3 == single
    assert len(pids) == 2 and not any(alive(pid) for pid in pids), "close() reaps ranks 1 and 2"


def test_tp2_logits_features_and_vocab_weights_match_single_rank(tiny_target_dir):
    """Untied LM head and a vocabulary split in two: the gathered logits, rank 0's captured hidden states
    and the drafter's full vocabulary weights are the single rank's."""
    single = create_runner(tiny_config(tiny_target_dir), torch.device("cpu"), torch.float32)
    tp2 = create_runner(
        tiny_config(tiny_target_dir, tensor_parallel_size=2), torch.device("cpu"), torch.float32
    )
    try:
        expected, got = single.run(one_step((0, 1))), tp2.run(one_step((0, 1)))
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.features, expected.features, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.slots, expected.slots)
        for full, reference in zip(tp2.vocab_weights(), single.vocab_weights(), strict=True):
            assert torch.equal(full, reference)
    finally:
        tp2.close()


# Failures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_failed_rank_ends_in_flight_requests_with_an_error_and_leaves_no_rank(
    smollm2_dir, smollm2_drafter_dir, how
):
    timeout = 10
    config = smollm2_config(
        smollm2_dir, smollm2_drafter_dir, tensor_parallel_size=3, tensor_parallel_timeout_s=timeout
    )
    engine = AsyncEngine(config)
    engine.start()
    try:
        pids = engine.engine.runner.worker_pids
        deltas: queue.Queue = queue.Queue()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        engine.submit("long", params, deltas.put, prompt="Tell me a long story.")
        assert not deltas.get(timeout=120).finished
        os.kill(pids[0], how)
        failed_at = time.monotonic()
        while not (delta := deltas.get(timeout=timeout + 30)).finished:
            pass
        assert delta.finish_reason == "error"
        cause = "rank 1" if how == signal.SIGKILL else "a step took longer than tensor_parallel_timeout_s"
        assert "tensor-parallel group failed" in delta.error and cause in delta.error
        assert time.monotonic() - failed_at < timeout + 10
        assert wait_until(lambda: not engine.healthy, 5)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 10), "rank 2 went down with rank 1"
        with pytest.raises(EngineDeadError):
            engine.submit("after", params, deltas.put, prompt="Hello")
    finally:
        engine.shutdown()


# Startup errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "message"),
    [(2, r"num_attention_heads \(9\)"), (9, r"num_key_value_heads \(3\)")],
)
def test_tp_size_not_dividing_heads_is_a_clear_error(smollm2_dir, size, message):
    import multiprocessing

    config = EngineConfig(model=str(smollm2_dir), spec_mode="off", tensor_parallel_size=size)
    with pytest.raises(ValueError, match=rf"{message} is not divisible by tensor_parallel_size \({size}\)"):
        LLM(config)
    assert not multiprocessing.active_children(), "nothing is spawned for a split that cannot work"


def test_more_ranks_than_gpus_is_a_clear_error(smollm2_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig(model=str(smollm2_dir), spec_mode="off", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) needs 3 GPUs, but 2 are visible"):
        create_runner(config, torch.device("cuda"), torch.float32)


def test_device_list_must_name_one_gpu_per_rank():
    with pytest.raises(ValueError, match="tensor_parallel_devices: lists 1 GPUs for tensor_parallel_size 2"):
        EngineConfig(tensor_parallel_size=2, tensor_parallel_devices="0")
    assert EngineConfig(
        tensor_parallel_size=2, tensor_parallel_devices="2, 3"
    ).tensor_parallel_device_ids == [2, 3]


# Processes -------------------------------------------------------------------------------------------


def test_ranks_spawn_with_the_real_interpreter_when_sys_executable_is_not_python(
    tiny_target_dir, monkeypatch
):
    """Inside Triton's Python backend sys.executable may be the stub binary."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    runner = create_runner(
        tiny_config(tiny_target_dir, tensor_parallel_size=2), torch.device("cpu"), torch.float32
    )
    try:
        assert runner.run(one_step()).logits.shape == (5, 8)
    finally:
        runner.close()


def test_second_tensor_parallel_engine_in_one_process_is_refused_before_spawning(tiny_target_dir):
    import multiprocessing

    config = tiny_config(tiny_target_dir, tensor_parallel_size=2)
    first = create_runner(config, torch.device("cpu"), torch.float32)
    try:
        with pytest.raises(RuntimeError, match="already hosts a tensor-parallel group"):
            create_runner(config, torch.device("cpu"), torch.float32)
        assert [p.pid for p in multiprocessing.active_children()] == first.worker_pids
    finally:
        first.close()


DRIVER = textwrap.dedent(
    """
    import sys
    import torch
    from dspark.runner.model_runner import create_runner
    from test_tensor_parallel import one_step, tiny_config

    runner = create_runner(
        tiny_config(sys.argv[1], tensor_parallel_size=2), torch.device("cpu"), torch.float32
    )
    runner.run(one_step())
    print(*runner.worker_pids, flush=True)
    sys.stdin.readline()  # both drivers are up: run again, side by side
    runner.run(one_step())
    print("ok", flush=True)
    sys.stdin.readline()  # then exit without close(): atexit stops the ranks
    """
)


def test_two_engines_on_one_host_run_side_by_side_and_their_ranks_exit_with_them(tiny_target_dir):
    """Each engine rendezvouses on its own port; ranks go when their driver exits or is killed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    drivers = [
        subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(tiny_target_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        pids = [[int(p) for p in driver.stdout.readline().split()] for driver in drivers]
        assert all(len(p) == 1 and alive(p[0]) for p in pids)
        for driver in drivers:
            driver.stdin.write("\n")
            driver.stdin.flush()
        assert [driver.stdout.readline().strip() for driver in drivers] == ["ok", "ok"]
        drivers[0].kill()
        drivers[1].stdin.write("\n")
        drivers[1].stdin.flush()
        assert drivers[1].wait(30) == 0
        assert wait_until(lambda: not any(alive(p[0]) for p in pids), 15)
    finally:
        for driver in drivers:
            driver.kill()
            driver.wait()


def test_gpu_benchmark_logic_runs_tiny_on_cpu(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tp_gpu.py"
    command = [
        sys.executable,
        str(script),
        "--tiny",
        "--out",
        str(tmp_path),
        "--checkpoint",
        str(tmp_path / "ckpt"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "results.json").read_text())
    tp2 = report["results"]["2"]
    assert tp2["agreement"]["logits_within_tolerance"] and tp2["agreement"]["greedy_identical_rate"] == 1.0
    assert [d["batch"] for d in tp2["decode"]] == report["plan"]["batch_sizes"]
    assert (tmp_path / "results.md").read_text().startswith("# Tensor parallelism")
