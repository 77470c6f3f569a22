"""Metrics on Triton's metrics port: request and token counters, latency histograms, speculation, load."""

from __future__ import annotations

import time

import pytest
from server_fixtures import GrpcStream, wait_for

pytestmark = pytest.mark.server

COUNTERS = [
    "dspark_prompt_tokens_total",
    "dspark_generation_tokens_total",
    "dspark_spec_drafted_tokens_total",
    "dspark_spec_verified_tokens_total",
    "dspark_spec_steps_total",
    "dspark_time_to_first_token_seconds_count",
    "dspark_inter_token_latency_seconds_count",
]


def snapshot(server) -> dict[str, float]:
    values = {name: server.metric(name, model="dspark") or 0.0 for name in COUNTERS}
    values["requests_length"] = (
        server.metric("dspark_requests_total", model="dspark", finish_reason="length") or 0.0
    )
    values["requests_invalid"] = (
        server.metric("dspark_requests_total", model="dspark", finish_reason="invalid") or 0.0
    )
    return values


def settled_snapshot(server) -> dict[str, float]:
    """A snapshot once earlier tests' counters are published (at most 0.1 s after their events)."""
    previous = snapshot(server)
    while True:
        time.sleep(0.3)
        now = snapshot(server)
        if now == previous:
            return now
        previous = now


def test_counters_and_histograms_move_with_requests(triton_server):
    before = settled_snapshot(triton_server)
    with GrpcStream(triton_server) as grpc:
        outcome = grpc.send(
            text_input="List three fruits:",
            stream=True,
            sampling_parameters={"max_tokens": 6, "ignore_eos": True},
        ).collect()
    with GrpcStream(triton_server) as grpc:
        assert grpc.send(text_input="").collect().error

    # Each instance publishes its own counters from its poll thread, at most 0.1 s after the event:
    # the two requests may have gone to different instances, so wait for both to show.
    def published(now: dict[str, float]) -> bool:
        return (
            now["requests_invalid"] == before["requests_invalid"] + 1
            and now["requests_length"] == before["requests_length"] + 1
            and now["dspark_generation_tokens_total"] - before["dspark_generation_tokens_total"]
            >= len(outcome.ids)
        )

    assert wait_for(lambda: published(snapshot(triton_server)))
    after = snapshot(triton_server)
    assert after["dspark_generation_tokens_total"] - before["dspark_generation_tokens_total"] == len(
        outcome.ids
    )
    assert after["dspark_prompt_tokens_total"] > before["dspark_prompt_tokens_total"]
    assert after["requests_length"] == before["requests_length"] + 1
    assert after["requests_invalid"] == before["requests_invalid"] + 1
    assert (
        after["dspark_time_to_first_token_seconds_count"]
        == before["dspark_time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["dspark_inter_token_latency_seconds_count"] > before["dspark_inter_token_latency_seconds_count"]
    )
    for name in (
        "dspark_spec_drafted_tokens_total",
        "dspark_spec_verified_tokens_total",
        "dspark_spec_steps_total",
    ):
        assert after[name] > before[name], name


def test_speculation_gauges_are_published(triton_server):
    with GrpcStream(triton_server) as grpc:
        grpc.send(
            text_input="Say hello.", sampling_parameters={"max_tokens": 4, "ignore_eos": True}
        ).collect()

    def rate() -> float | None:
        return triton_server.metric("dspark_spec_acceptance_rate", model="dspark", position="1")

    assert wait_for(lambda: rate() is not None), "gauges are published between sends"
    assert 0.0 <= rate() <= 1.0
    assert triton_server.metric("dspark_spec_mean_verify_window", model="dspark") >= 1.0
    assert triton_server.metric("dspark_spec_mean_acceptance_length", model="dspark") >= 1.0


def test_load_gauges_report_the_kv_cache_and_request_counts(triton_server):
    assert triton_server.metric("dspark_kv_pages_total", model="dspark") == 96
    for name in ("dspark_kv_pages_used", "dspark_num_requests_running", "dspark_num_requests_waiting"):
        assert triton_server.metric(name, model="dspark") is not None, name


def test_engine_loop_counters_say_where_the_loop_time_went(triton_server):
    def loop() -> dict[str, float]:
        return {
            name: triton_server.metric(f"dspark_engine_{name}_total", model="dspark") or 0.0
            for name in ("steps", "step_requests", "step_seconds", "accept_seconds", "idle_seconds")
        }

    def settled() -> dict[str, float]:
        """Once every published counter stopped moving (each is written at most 0.1 s after a step)."""
        previous = loop()
        while True:
            time.sleep(0.3)
            now = loop()
            if now == previous:
                return now
            previous = now

    before = settled()
    with GrpcStream(triton_server) as grpc:
        grpc.send(
            text_input="Count to five.", sampling_parameters={"max_tokens": 8, "ignore_eos": True}
        ).collect()
    assert wait_for(lambda: loop()["steps"] >= before["steps"] + 2), "steps are counted"
    after = settled()
    steps = after["steps"] - before["steps"]
    assert after["step_requests"] - before["step_requests"] >= steps  # each step ran a request at least
    step_seconds = after["step_seconds"] - before["step_seconds"]
    assert 0 < after["accept_seconds"] - before["accept_seconds"] < step_seconds
    assert after["idle_seconds"] >= before["idle_seconds"]


def test_the_engine_processes_garbage_collector_is_counted(triton_server):
    """The collector's passes in the engine process reach the metrics: at least the full pass that
    froze its startup heap (`dspark.process_heap`), with its seconds."""

    def full() -> float:
        return triton_server.metric("dspark_engine_gc_full_collections_total", model="dspark") or 0.0

    with GrpcStream(triton_server) as grpc:  # a request's end publishes the engine's totals
        grpc.send(text_input="Hi.", sampling_parameters={"max_tokens": 2}).collect()
    assert wait_for(lambda: full() >= 1), "the startup heap's full pass is counted"
    assert (triton_server.metric("dspark_engine_gc_seconds_total", model="dspark") or 0.0) > 0
    assert triton_server.metric("dspark_engine_gc_collections_total", model="dspark") >= full()
