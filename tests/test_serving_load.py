"""Under load and client churn nothing is lost or mixed up: every stream that finishes equals its solo
greedy text, cancelled ones stop cleanly, and the engine ends with no request running and no KV page
held. (Heavier variants: benchmarks/stress_serving.py.)"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_fixtures import GrpcStream, wait_for

pytestmark = pytest.mark.server

PROMPTS = [
    "Name a bird that cannot fly.",
    "How do plants make food?",
    "Describe a rainy afternoon.",
    "What does a compiler do?",
    "Suggest a name for a cat.",
]
MAX_TOKENS = 12  # enough tokens to cancel mid-stream; 24 took a minute more of make test on 2 cores
NUM_STREAMS = 200
CANCELLED_SHARE = 0.2


@pytest.fixture(scope="module")
def solo_ids(triton_server) -> dict[str, list[int]]:
    """Each prompt's greedy token ids, decoded alone."""
    ids = {}
    for prompt in PROMPTS:
        with GrpcStream(triton_server) as grpc:
            outcome = grpc.send(
                text_input=prompt,
                stream=True,
                sampling_parameters={"max_tokens": MAX_TOKENS, "ignore_eos": True},
            ).collect()
        assert outcome.error is None, outcome.error
        ids[prompt] = outcome.ids
    return ids


def assert_engine_idle(server) -> None:
    """No request running or waiting, no KV page held, and the model ready."""
    for name in ("dspark_num_requests_running", "dspark_num_requests_waiting", "dspark_kv_pages_used"):
        assert wait_for(lambda name=name: server.metric(name, model="dspark") == 0, timeout=30), name
    assert server.ready()


def run_stream(
    server, prompt: str, max_tokens: int, cancel_after: int | None
) -> tuple[list[int], str | None, bool]:
    """One client: (token ids received, error, whether it finished), cancelling after some responses."""
    with GrpcStream(server) as grpc:
        grpc.send(
            text_input=prompt,
            stream=True,
            sampling_parameters={"max_tokens": max_tokens, "ignore_eos": True},
            return_finish_reason=True,
        )
        ids: list[int] = []
        while True:
            item = grpc.next(timeout=300)
            if isinstance(item, str):
                return ids, item, False
            ids.extend(item.ids)
            if item.final:
                return ids, None, True
            if cancel_after is not None and len(ids) >= cancel_after:
                grpc.cancel()
                return ids, None, False


def test_200_concurrent_streams_with_cancellations_each_equal_their_solo_greedy_text(triton_server, solo_ids):
    rng = random.Random()  # a fresh plan each run (one round: a second one took another minute)
    plans = []
    for index in range(NUM_STREAMS):
        prompt = PROMPTS[index % len(PROMPTS)]
        max_tokens = rng.randint(4, MAX_TOKENS)
        cancel_after = rng.randint(1, max_tokens - 1) if rng.random() < CANCELLED_SHARE else None
        plans.append((prompt, max_tokens, cancel_after))
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        results = list(pool.map(lambda plan: run_stream(triton_server, *plan), plans))
    finished = 0
    for (prompt, max_tokens, cancel_after), (ids, error, done) in zip(plans, results, strict=True):
        assert error is None, error
        assert ids == solo_ids[prompt][: len(ids)], "every token so far is the solo greedy one"
        if cancel_after is None:
            assert done and len(ids) == max_tokens
            finished += 1
    assert finished >= NUM_STREAMS * (1 - CANCELLED_SHARE) / 2
    assert_engine_idle(triton_server)


def test_a_storm_of_client_disconnects_leaves_a_good_stream_unchanged_and_the_engine_idle(
    triton_server, solo_ids
):
    prompt = PROMPTS[0]
    rng = random.Random()

    def disconnect(index: int) -> None:
        with GrpcStream(triton_server) as stream:
            stream.send(
                text_input=PROMPTS[index % len(PROMPTS)],
                stream=True,
                sampling_parameters={"max_tokens": 100, "ignore_eos": True},
            )
            if rng.random() < 0.5:
                stream.next()  # disconnect mid-stream rather than before the first token
            stream.cancel()

    with GrpcStream(triton_server) as good:
        good.send(
            text_input=prompt, stream=True, sampling_parameters={"max_tokens": MAX_TOKENS, "ignore_eos": True}
        )
        with ThreadPoolExecutor(40) as pool:
            list(pool.map(disconnect, range(40)))
        outcome = good.collect(timeout=300)
    assert outcome.error is None
    assert outcome.ids == solo_ids[prompt]
    assert_engine_idle(triton_server)
