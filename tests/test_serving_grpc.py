"""gRPC streaming against a real tritonserver: decoupled responses, the vLLM-backend interface."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from server_fixtures import GrpcStream, Outcome

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"
# Enough tokens that a stream has several responses on a fast GPU too: the adapter merges what the engine
# commits while a response is being sent (an H100 committed all of 10 before the first went out).
GREEDY = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}


def generate(server, stream: bool, **values: object) -> Outcome:
    with GrpcStream(server) as grpc:
        return grpc.send(text_input=PROMPT, stream=stream, return_finish_reason=True, **values).collect()


@pytest.fixture(scope="module")
def streamed(triton_server) -> Outcome:
    return generate(triton_server, True, sampling_parameters=GREEDY, return_num_output_tokens=True)


@pytest.fixture(scope="module")
def whole(triton_server) -> Outcome:
    return generate(triton_server, False, sampling_parameters=GREEDY, exclude_input_in_output=True)


def test_stream_deltas_concatenate_to_the_non_streamed_text(streamed, whole):
    assert streamed.error is None and whole.error is None
    assert len(streamed.responses) > 1
    assert streamed.text == whole.text
    assert streamed.ids == whole.ids and len(whole.ids) == GREEDY["max_tokens"]


def test_final_flag_rides_on_the_last_data_response(streamed):
    assert [r.final for r in streamed.responses] == [False] * (len(streamed.responses) - 1) + [True]
    assert streamed.responses[-1].ids, "the final response carries tokens, it is not an empty marker"
    assert [r.finish_reason for r in streamed.responses[:-1]] == ["None"] * (len(streamed.responses) - 1)
    assert streamed.finish_reason == "length"


def test_streamed_num_output_tokens_counts_each_response_s_new_tokens(streamed):
    assert [int(r.outputs["num_output_tokens"][0]) for r in streamed.responses] == [
        len(r.ids) for r in streamed.responses
    ]


def test_non_streamed_request_gets_one_response_with_the_prompt_prepended(triton_server, whole):
    with_prompt = generate(triton_server, False, sampling_parameters=GREEDY)
    assert len(with_prompt.responses) == 1 and with_prompt.responses[0].final
    assert with_prompt.text == PROMPT + whole.text


def test_text_equals_the_detokenized_output_ids(triton_server, whole):
    from dspark.config import DEFAULT_TARGET_DIR
    from dspark.tokenizer import Tokenizer

    assert Tokenizer.from_dir(DEFAULT_TARGET_DIR).decode(whole.ids) == whole.text


def test_input_ids_are_an_alternative_to_text_input(triton_server, whole):
    from dspark.config import DEFAULT_TARGET_DIR
    from dspark.tokenizer import Tokenizer

    ids = np.array(Tokenizer.from_dir(DEFAULT_TARGET_DIR).encode(PROMPT), dtype=np.int64)
    with GrpcStream(triton_server) as grpc:
        by_ids = grpc.send(
            input_ids=(ids, "INT64"), sampling_parameters=GREEDY, exclude_input_in_output=True
        ).collect()
    assert by_ids.error is None and by_ids.ids == whole.ids


def test_apply_chat_template_sends_the_text_as_one_user_turn(triton_server):
    # The server renders the turn with the model's template; the same ids sent by hand give the same
    # greedy tokens, and a non-streamed completion starts with the rendered prompt.
    from dspark.config import DEFAULT_TARGET_DIR
    from dspark.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(DEFAULT_TARGET_DIR)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    assert rendered != PROMPT and PROMPT in rendered
    ids = np.array(tokenizer.encode(rendered, add_special_tokens=False), dtype=np.int64)
    chat = generate(triton_server, False, sampling_parameters=GREEDY, apply_chat_template=True)
    with GrpcStream(triton_server) as grpc:
        by_ids = grpc.send(
            input_ids=(ids, "INT64"), sampling_parameters=GREEDY, exclude_input_in_output=True
        ).collect()
    assert chat.error is None and by_ids.error is None
    assert chat.ids == by_ids.ids and chat.text == rendered + by_ids.text
    with GrpcStream(triton_server) as grpc:
        refused = grpc.send(input_ids=(ids, "INT64"), apply_chat_template=True).collect()
    assert refused.error is not None and "apply_chat_template" in refused.error
    with GrpcStream(triton_server) as grpc:  # too long once rendered: named as the text the client sent
        too_long = grpc.send(text_input="word " * 20000, apply_chat_template=True).collect()
    assert too_long.error is not None and too_long.error.startswith("text_input: as a chat turn, "), (
        too_long.error
    )


def test_greedy_output_identical_with_num_draft_tokens_zero_and_default(triton_server, whole):
    plain = generate(
        triton_server,
        False,
        sampling_parameters={**GREEDY, "num_draft_tokens": 0},
        exclude_input_in_output=True,
    )
    assert plain.error is None
    assert plain.ids == whole.ids


def test_spec_stats_report_drafted_verified_and_accepted_tokens(triton_server):
    outcome = generate(triton_server, False, sampling_parameters=GREEDY, return_spec_stats=True)
    import json

    stats = json.loads(outcome.responses[-1].outputs["spec_stats"][0])
    assert (
        stats["steps"] >= 1
        and stats["drafted_tokens"] >= stats["verified_tokens"] >= stats["accepted_tokens"]
    )
    assert stats["verified_tokens"] > 0


def test_eight_concurrent_streams_each_finish_with_their_own_complete_text(triton_server):
    from dspark.config import DEFAULT_TARGET_DIR
    from dspark.tokenizer import Tokenizer

    prompts = [f"Count from {n} to {n + 5}:" for n in range(8)]
    outcomes: dict[int, Outcome] = {}

    def run(index: int) -> None:
        with GrpcStream(triton_server) as grpc:
            params = {"max_tokens": 8, "ignore_eos": True}
            outcomes[index] = grpc.send(
                f"concurrent-{index}",
                text_input=prompts[index],
                stream=True,
                sampling_parameters=params,
                return_finish_reason=True,
            ).collect()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    tokenizer = Tokenizer.from_dir(DEFAULT_TARGET_DIR)
    assert sorted(outcomes) == list(range(8))
    for outcome in outcomes.values():
        assert outcome.error is None
        assert len(outcome.ids) == 8 and outcome.finish_reason == "length"
        assert [r.final for r in outcome.responses].count(True) == 1
        assert outcome.text == tokenizer.decode(outcome.ids)
