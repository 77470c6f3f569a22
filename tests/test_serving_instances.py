"""Several instances of the model (backend stubs, `instance_group { count: 2 }`) share one engine process
(dspark.serving.shared_engine): one spawns it, the other attaches; requests through either stream the
same greedy text, a cancel by id reaches a request whichever instance holds it, the engine's metrics
(its adaptive gate's view too) come from one instance and request counts from both, once each, and
nothing outlives the server."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from server_fixtures import TEST_ENGINE_CONFIG, GrpcStream, wait_for

pytestmark = pytest.mark.server

LONG_PROMPT = "Tell me a long story about a dragon who learns to read. " * 6
LONG = {"max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def two_instance_server(smollm2_dir, tmp_path_factory):
    from server_fixtures import start_server

    from dspark.tools.cli import main as dspark_main

    assert dspark_main(["create-draft", "--if-missing"]) == 0
    # The serve default's adaptive gate (the session server drafts on every step): its gauges too.
    config = TEST_ENGINE_CONFIG.replace(adaptive_speculation=True)
    server = start_server(tmp_path_factory.mktemp("triton-instances"), config, instances=2)
    engines = _engine_processes(server)
    yield server
    stopping = time.monotonic()
    status = server.stop()
    assert status == 0, f"dspark serve did not stop cleanly ({status}):\n{server.log_tail()}"
    # The instances that attached end with the engine as the model unloads: no exit, no restart, no
    # waiting out tritonserver's exit timeout.
    log = server.log_tail(200)
    assert "Exit timeout expired" not in log and "exits after the engine died" not in log, log
    assert time.monotonic() - stopping < 8, log
    assert not server.leftover_processes()
    assert not [pid for pid in engines if Path(f"/proc/{pid}").exists()], "the engine process outlived it"


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process readable in /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        table[int(entry.name)] = (parent, command)
    return table


def _stubs(server) -> list[int]:
    """The backend stubs of the dspark model (not the wrapper model's)."""
    model = str(server.repo / "dspark" / "1" / "model.py")
    return [
        pid
        for pid, (_, command) in _processes().items()
        if "python_backend_stub" in command and model in command
    ]


def _engine_processes(server) -> list[int]:
    stubs = set(_stubs(server))
    return [
        pid for pid, (parent, command) in _processes().items() if parent in stubs and "spawn_main" in command
    ]


def test_one_instance_spawns_the_engine_and_the_other_attaches(two_instance_server):
    log = two_instance_server.log_tail(2000)
    assert log.count("spawned the engine shared by 2 instances") == 1, log
    assert log.count("attached to the engine shared by 2 instances") == 1, log
    assert len(_stubs(two_instance_server)) == 2
    assert len(_engine_processes(two_instance_server)) == 1


def _loads_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_only_the_engine_process_loads_torch(two_instance_server):
    # The stubs relay requests and deltas and make text: without torch they start in a fraction of the
    # time (each of them imported it once, seconds of CPU apiece) and hold far less memory.
    stubs = _stubs(two_instance_server)
    assert stubs and not [pid for pid in stubs if _loads_torch(pid)]
    (engine,) = _engine_processes(two_instance_server)
    assert _loads_torch(engine)


def test_concurrent_streams_through_the_instances_get_the_same_greedy_text(two_instance_server):
    streams = [GrpcStream(two_instance_server) for _ in range(8)]
    try:
        for grpc in streams:
            grpc.send(
                text_input="Count from one to ten:", stream=True, sampling_parameters={"max_tokens": 16}
            )
        outcomes = [grpc.collect(timeout=120) for grpc in streams]
    finally:
        for grpc in streams:
            grpc.close()
    assert all(outcome.error is None for outcome in outcomes), [o.error for o in outcomes]
    assert len({outcome.text for outcome in outcomes}) == 1 and outcomes[0].text


def test_a_cancel_by_id_reaches_a_request_on_either_instance(two_instance_server):
    """Six streams in flight at once spread over the two instances; each cancel by id, whichever
    instance takes it, answers "cancelled" and ends its stream with reason abort."""
    ids = [f"story-{i}" for i in range(6)]
    admitted = lambda: _metric_total(two_instance_server, "dspark_engine_admitted_requests_total")  # noqa: E731
    admitted_before = _settled(admitted)  # the test before's admissions may still be on their way
    streams = [GrpcStream(two_instance_server) for _ in ids]
    try:
        for grpc, request_id in zip(streams, ids, strict=True):
            grpc.send(
                request_id=request_id,
                text_input=LONG_PROMPT,
                stream=True,
                sampling_parameters=LONG,
                return_finish_reason=True,
            )
        for grpc in streams:  # every one in flight: it has tokens
            assert not isinstance(grpc.next(), str)
        for request_id in ids:
            status, body = two_instance_server.post(
                "/v2/models/dspark/generate", {"cancel_request_id": request_id}
            )
            assert status == 200 and json.loads(body)["finish_reason"] == "cancelled", (
                body,
                two_instance_server.log_tail(),
            )
        outcomes = [grpc.collect(timeout=60) for grpc in streams]
    finally:
        for grpc in streams:
            grpc.close()
    assert [outcome.finish_reason for outcome in outcomes] == ["abort"] * len(ids)
    # The engine's counters reach the server whichever instance held the requests (the spawning
    # instance publishes them, every 0.1 s), and its gauges say nothing runs.
    caught_up = wait_for(lambda: admitted() == admitted_before + len(ids), timeout=10)
    assert caught_up, (admitted_before, admitted())
    running = lambda: two_instance_server.metric("dspark_num_requests_running", model="dspark")  # noqa: E731
    assert wait_for(lambda: running() == 0, timeout=10)
    status, body = two_instance_server.post("/v2/models/dspark/generate", {"cancel_request_id": "no-such"})
    assert status == 400 and "cancel_request_id" in json.loads(body)["error"]


def test_each_request_is_counted_once_and_the_engine_by_one_instance(two_instance_server):
    def counts() -> tuple[float, float, float]:
        server, labels = two_instance_server, {"model": "dspark", "version": "1"}
        return (
            server.metric("dspark_requests_total", finish_reason="length", **labels) or 0.0,
            server.metric("vllm:generation_tokens_total", **labels) or 0.0,
            server.metric("dspark_engine_admitted_requests_total", **labels) or 0.0,
        )

    before = _settled(counts)  # an earlier test's last counts may still be on their way
    for _ in range(4):
        with GrpcStream(two_instance_server) as grpc:
            outcome = grpc.send(
                text_input="Hello", stream=True, sampling_parameters={"max_tokens": 5, "ignore_eos": True}
            ).collect(timeout=60)
        assert outcome.error is None
    expected = (before[0] + 4, before[1] + 20, before[2] + 4)  # each instance publishes every 0.1 s
    assert wait_for(lambda: counts() == expected, timeout=10), (before, counts())
    assert not wait_for(lambda: counts() != expected, timeout=1)  # and nothing more comes


def test_the_adaptive_gate_s_view_is_published_once(two_instance_server):
    """The serve default's gate, per tier and draft length: the steps it chose, the step times it
    measured and the tokens a request it expects, from the instance that spawned the engine."""

    def samples(name: str) -> list[tuple[dict[str, str], float]]:
        found = []
        for line in two_instance_server.metrics_text().splitlines():
            match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
            if match:
                found.append((dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))), float(match.group(2))))
        return found

    def chosen_total() -> float:
        return sum(value for _, value in samples("dspark_spec_gate_chosen_steps"))

    before = _settled(chosen_total)  # the earlier tests' requests were gated too
    with GrpcStream(two_instance_server) as grpc:
        outcome = grpc.send(
            text_input="Count from one to twenty.", sampling_parameters={"max_tokens": 48, "ignore_eos": True}
        ).collect(timeout=60)
    assert outcome.error is None
    # Its steps' choices are counted in the tier of the gate's run they fall in: a warm-up begun by the
    # earlier test's six streams (tier 8) goes on through a lone request's steps until it ends, which
    # with a GPU's decode bursts (a choice per burst) can outlast this request.
    assert wait_for(lambda: chosen_total() > before, timeout=10), (before, chosen_total())
    chosen = samples("dspark_spec_gate_chosen_steps")
    keys = [(labels["tier"], labels["length"]) for labels, _ in chosen]
    assert len(keys) == len(set(keys)), chosen  # one instance publishes them
    tiers = {labels["tier"] for labels, value in chosen if value} | {
        labels["tier"] for labels, _ in samples("dspark_spec_gate_step_seconds")
    }
    assert "1" in tiers, chosen  # one request: its steps are timed (or chosen) in tier 1
    timed = samples("dspark_spec_gate_step_seconds")
    assert timed and all(0 < value < 10 for _, value in timed), timed
    tokens = {labels["length"]: value for labels, value in samples("dspark_spec_gate_tokens_per_request")}
    # A length is published once chosen or measured: on a GPU the warm-up of 48 tokens may end before it
    # reaches plain decoding (lengths 3 and 2 only, on an H100).
    assert tokens and tokens.get("0", 1.0) == 1.0, tokens
    assert all(1.0 <= value <= 1 + int(length) for length, value in tokens.items()), tokens


def _metric_total(server, name: str) -> float:
    return server.metric(name, model="dspark", version="1") or 0.0


def _settled(read, quiet_s: float = 0.5, timeout: float = 10.0):
    """read()'s value once it stayed the same for quiet_s (the instances publish every 0.1 s)."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return value
    raise AssertionError(f"the metrics kept moving for {timeout} s: {value}")
