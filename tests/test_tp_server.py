"""Tensor parallelism inside one Triton model instance: a real tritonserver whose dspark model runs with
tensor_parallel_size 3 (gloo on CPU), its ranks spawned from Triton's Python backend stub."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import pytest
import torch
from server_fixtures import TEST_ENGINE_CONFIG, GrpcStream, start_server, wait_for

from dspark import LLM, SamplingParams

pytestmark = pytest.mark.server

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 16
TP_CONFIG = TEST_ENGINE_CONFIG.replace(tensor_parallel_size=3, tensor_parallel_timeout_s=30)


def children(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def rank_pids(server) -> list[int]:
    """Process ids of the TP ranks 1..N-1: the spawned processes below the server that spawned none
    themselves (the engine process, which spawns them, is one too)."""
    spawned = []
    for pid in children(server.process.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline:
            spawned.append(pid)
    return [pid for pid in spawned if not set(children(pid)) & set(spawned)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def http_status(server, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def tp_server(smollm2_dir, smollm2_drafter_dir, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("triton-tp"), TP_CONFIG)
    ranks = rank_pids(server)
    yield server
    server.stop()
    assert not server.leftover_processes()
    assert wait_for(lambda: not any(alive(pid) for pid in ranks), timeout=15), "a TP rank outlived the server"


@pytest.fixture(scope="module")
def single_rank_greedy(smollm2_dir) -> list[list[int]]:
    """The in-process single-rank engine's tokens (one thread, as the server's processes run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(TEST_ENGINE_CONFIG)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.engine.close()
        torch.set_num_threads(threads)
    return [o.token_ids for o in outputs]


def test_tp3_instance_runs_two_spawned_ranks(tp_server):
    assert len(rank_pids(tp_server)) == 2


def test_tp3_server_streams_the_single_rank_greedy_tokens(tp_server, single_rank_greedy):
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    for prompt, expected in zip(PROMPTS, single_rank_greedy, strict=True):
        with GrpcStream(tp_server) as grpc:
            outcome = grpc.send(text_input=prompt, stream=True, sampling_parameters=greedy).collect()
        assert outcome.error is None
        assert outcome.ids == expected


def test_killed_rank_fails_the_request_and_the_server_stays_up(tp_server):
    """Runs last: it takes the model's engine down."""
    ranks = rank_pids(tp_server)
    grpc = GrpcStream(tp_server).send(
        text_input="Tell me a long story.",
        stream=True,
        sampling_parameters={"max_tokens": 400, "ignore_eos": True},
    )
    try:
        assert not isinstance(grpc.next(), str), "the request is under way"
        os.kill(ranks[0], signal.SIGKILL)
        outcome = grpc.collect(timeout=60)
    finally:
        grpc.close()
    assert outcome.error is not None and "tensor-parallel group failed" in outcome.error
    assert tp_server.running
    assert http_status(tp_server, "/v2/health/live") == 200
    assert wait_for(lambda: not any(alive(pid) for pid in ranks), timeout=15), "no rank is left behind"
    with GrpcStream(tp_server) as grpc:
        after = grpc.send(text_input="Hello", stream=True, sampling_parameters={"max_tokens": 4}).collect()
    assert after.error is not None and "engine is not running" in after.error
