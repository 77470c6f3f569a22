"""benchmarks/agreement.py's loop_shares: the engine loop's figures per step from two LoopTotals
snapshots, each counter under its own key (the acceptance's wait and the host's accept phase apart)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dspark.outputs import STEP_PHASES, LoopTotals

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from agreement import loop_shares  # noqa: E402
from serving_overhead import (  # noqa: E402
    _process_table,
    engine_pids,
    gate_table,
    served_gate,
    thread_clock,
    thread_shares,
)


def test_loop_shares_are_per_step_differences_under_distinct_keys() -> None:
    before = LoopTotals(steps=5, step_requests=10, verify_tokens=4, step_seconds=1.0, accept_seconds=0.5)
    phases = {f"host_{phase}_seconds": 0.5 + 0.01 * (i + 1) for i, phase in enumerate(STEP_PHASES)}
    after = LoopTotals(
        steps=15,
        step_requests=50,
        verify_tokens=64,
        prefill_steps=2,
        burst_steps=6,
        bursts=2,
        step_seconds=1.1,
        prefill_step_seconds=0.03,
        accept_seconds=0.502,
        gc_seconds=0.04,
        gc_full_collections=1,
        **phases,
    )
    shares = loop_shares(before, after, seconds=0.2, output_tokens=120)
    assert shares["steps_per_s"] == 50.0 and shares["requests_per_step"] == 4.0
    assert shares["tokens_per_step"] == 12.0 and shares["prefill"] == 0.2
    assert shares["drafts_per_request"] == 1.5  # 60 drafts over 40 request-steps
    assert shares["burst"] == 0.6 and shares["burst_length"] == 3.0  # 6 steps of 10 in 2 bursts
    assert shares["gc_ms"] == pytest.approx(4.0) and shares["gc_full"] == 1  # 40 ms over 10 steps
    assert shares["step_ms"] == pytest.approx(10.0) and shares["accept_ms"] == pytest.approx(0.2)
    # 2 prefill-carrying steps took 30 ms, the other 8 took 70.
    assert shares["prefill_step_ms"] == pytest.approx(15.0) and shares["decode_step_ms"] == pytest.approx(
        8.75
    )
    for i, phase in enumerate(STEP_PHASES):
        assert shares[f"host_{phase}_ms"] == pytest.approx(1e3 * (0.5 + 0.01 * (i + 1)) / 10)


def test_timed_generate_measures_repeated_batches_in_one_window(tiny_target_dir) -> None:
    """The offline side of serving_overhead / engine_process_check runs as many batches as the served
    streams run requests: one window over all of them, the first batch's tokens."""
    from agreement import timed_generate

    from dspark import LLM, EngineConfig, SamplingParams

    llm = LLM(EngineConfig(model=str(tiny_target_dir), spec_mode="off", num_kv_pages=64, device="cpu"))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    _, once, loop_once = timed_generate(llm, 3, params)
    rate, tokens, loop = timed_generate(llm, 3, params, repeats=3)
    assert tokens == once and [len(t) for t in tokens] == [5, 5, 5]
    # Every batch's tokens over every batch's steps (counting only the first batch's would give 1).
    assert rate > 0 and loop["tokens_per_step"] == loop_once["tokens_per_step"] == 3.0


def test_a_thread_clock_counts_the_cpu_its_thread_ran() -> None:
    """serving_overhead's loop-thread clock: a thread that computes runs a share of its window that
    the clock counts (until it has counted 0.1 s of CPU: on a loaded host the wall time is longer; an
    H100 machine running eight test workers gave a 0.3 s busy window a 0.36 share); one that sleeps
    runs little of it."""
    me = (os.getpid(), threading.get_native_id())
    before, started = thread_clock(*me), time.perf_counter()
    while thread_clock(*me)[0] - before[0] < 0.1 and time.perf_counter() - started < 10:
        sum(range(10000))
    busy = thread_shares(before, thread_clock(*me), time.perf_counter() - started)
    before, started = thread_clock(*me), time.perf_counter()
    time.sleep(0.3)
    idle = thread_shares(before, thread_clock(*me), time.perf_counter() - started)
    assert busy["loop_thread_cpu_share"] > 0.05 > idle["loop_thread_cpu_share"], (busy, idle)
    assert busy["loop_thread_preempted_per_s"] >= 0


def test_engine_pids_are_the_spawned_children_that_a_spawned_process_did_not_spawn() -> None:
    """The served engine process is a spawned child of a backend stub; its tensor-parallel ranks are
    spawned by it: only the first counts (the command lines carry multiprocessing's spawn_main)."""
    rank = "import time; time.sleep(30)  # spawn_main"
    engine = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}]); {rank}"
    stub = "import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', os.environ['E']]); "
    stub += "time.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", stub], env={**os.environ, "E": engine})
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the engine has spawned its rank
            table = _process_table()
            engines = [pid for pid, (parent, _, _) in table.items() if parent == server.pid]
            if engines and any(parent == engines[0] for parent, _, _ in table.values()):
                break
            time.sleep(0.05)
        assert engine_pids(server.pid) == engines
    finally:
        subprocess.run(["pkill", "-P", str(server.pid)], check=False)
        server.kill()
        server.wait()


def test_the_served_gate_s_view_is_read_from_its_gauges_and_tabled_beside_the_offline_one() -> None:
    """serving_overhead.py's gate table: the served side from the `dspark_spec_gate_*` gauges (another
    model's and the unlabelled lines ignored), the offline side from `gate_rows`, in the level's tier."""
    text = "\n".join(
        [
            "# HELP dspark_spec_gate_step_seconds ...",
            'dspark_spec_gate_step_seconds{model="dspark",version="1",length="0",tier="256"} 0.0013',
            'dspark_spec_gate_step_seconds{model="dspark",version="1",length="1",tier="256"} 0.002',
            'dspark_spec_gate_chosen_steps{model="dspark",version="1",length="0",tier="256"} 30',
            'dspark_spec_gate_chosen_steps{model="dspark",version="1",length="1",tier="256"} 90',
            'dspark_spec_gate_chosen_steps{model="dspark",version="1",length="1",tier="128"} 4',
            'dspark_spec_gate_chosen_steps{model="other",version="1",length="1",tier="256"} 7',
            'dspark_spec_gate_tokens_per_request{model="dspark",version="1",length="0"} 1',
            'dspark_spec_gate_tokens_per_request{model="dspark",version="1",length="1"} 1.4',
        ]
    )
    rows = served_gate(text)
    assert rows == [
        {"tier": 128, "length": 1, "chosen_steps": 4.0, "tokens_per_request": 1.4},
        {"tier": 256, "length": 0, "step_seconds": 0.0013, "chosen_steps": 30.0, "tokens_per_request": 1.0},
        {"tier": 256, "length": 1, "step_seconds": 0.002, "chosen_steps": 90.0, "tokens_per_request": 1.4},
    ]
    offline = [
        {
            "tier": 256,
            "length": 0,
            "step_seconds": 0.0012,
            "measured_steps": 9,
            "chosen_steps": 60,
            "tokens_per_request": 1.0,
        },
    ]
    runs = {"default": {"server": {200: {"gate": rows, "offline_gate": offline}}}, "args": {}}
    table = gate_table([200], runs).splitlines()
    assert table[-2:] == [
        "| default | 200 | 256 | 0 | 1.200 / 1.300 | 1.00 / 1.00 | 1.00 / 0.25 |",
        "| default | 200 | 256 | 1 | - / 2.000 | - / 1.40 | 0.00 / 0.75 |",
    ]
