"""The OpenAI frontend's translations, without a server: request bodies to what the dspark model is
asked, model errors to OpenAI errors, the vLLM-shaped log probabilities to OpenAI's two shapes."""

from __future__ import annotations

import pytest

from dspark.sampling_params import MAX_INT
from dspark.serving.openai_frontend.errors import OpenAIError, from_model_message
from dspark.serving.openai_frontend.logprobs import MIN_LOGPROB, chat_content, completion_logprobs
from dspark.serving.openai_frontend.protocol import parse_chat, parse_completion

CHAT = {"model": "dspark", "messages": [{"role": "user", "content": "Hi"}]}


def rejected(parse, body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as raised:
        parse(body)
    assert raised.value.status == 400
    return raised.value


def test_chat_defaults_are_openai_s_sampling_up_to_the_context():
    request = parse_chat(CHAT)
    assert request.sampling == {"temperature": 1.0, "top_p": 1.0, "max_tokens": MAX_INT}
    assert (request.stream, request.include_usage, request.logprobs) == (False, False, None)


def test_completions_default_to_16_tokens_and_take_one_prompt_as_text_or_ids():
    assert parse_completion({"model": "m", "prompt": "a"}).sampling["max_tokens"] == 16
    assert parse_completion({"model": "m", "prompt": ["a"]}).prompt == "a"
    assert parse_completion({"model": "m", "prompt": [[5, 6]]}).prompt == [5, 6]
    assert rejected(parse_completion, {"model": "m", "prompt": ["a", "b"]}).param == "prompt"


def test_max_completion_tokens_wins_and_errors_name_what_the_client_sent():
    request = parse_chat({**CHAT, "max_tokens": 3, "max_completion_tokens": 7})
    assert request.sampling["max_tokens"] == 7
    assert request.param_names["max_tokens"] == "max_completion_tokens"
    assert parse_chat({**CHAT, "max_tokens": 3}).param_names["max_tokens"] == "max_tokens"


def test_sampling_values_and_vllm_extras_pass_through_as_sent():
    body = {**CHAT, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x", "top_k": 4, "ignore_eos": True}
    sampling = parse_chat({**body, "user": "ignored", "presence_penalty": 0}).sampling
    assert sampling == {
        "temperature": 0,
        "top_p": 0.5,
        "seed": 3,
        "stop": "x",
        "top_k": 4,
        "ignore_eos": True,
        "max_tokens": MAX_INT,
    }
    assert parse_chat({**CHAT, "presence_penalty": 0.5}).sampling["presence_penalty"] == 0.5


def test_text_parts_of_a_message_are_joined_and_other_parts_refused():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse_chat({**CHAT, "messages": [{"role": "user", "content": parts}]}).prompt[0]["content"] == "ab"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert rejected(parse_chat, {**CHAT, "messages": [{"role": "user", "content": image}]}).param == (
        "messages[0].content"
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"n": 1.5}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"model": ""}, "model"),
        ({"messages": "Hi"}, "messages"),
    ],
)
def test_a_chat_parameter_the_frontend_cannot_honour_is_a_400_naming_it(extra, param):
    error = rejected(parse_chat, {**CHAT, **extra})
    assert error.param == param and error.message.startswith(f"{param}: ")
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_logprobs_ask_the_model_for_the_top_alternatives():
    assert parse_chat({**CHAT, "logprobs": True}).logprobs == 0
    assert parse_chat({**CHAT, "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert parse_completion({"model": "m", "prompt": "a", "logprobs": 2}).logprobs == 2
    assert rejected(parse_completion, {"model": "m", "prompt": "a", "best_of": 2}).param == "best_of"


@pytest.mark.parametrize(
    ("message", "status", "param"),
    [
        ("sampling_parameters.max_tokens: must be >= 1, got 0", 400, "max_completion_tokens"),
        ("sampling_parameters.top_p: must be in (0, 1], got 0", 400, "top_p"),
        ("input_ids: 600 tokens leave no room in the context of 512", 400, "messages"),
        ("stop_token_ids: id 99999 is past the vocabulary", 400, "stop_token_ids"),
        ("engine is not running", 503, None),
        ("Request for unknown model: 'dspark' is not found", 503, None),
        ("engine error: InjectedFault", 500, None),
    ],
)
def test_a_model_error_becomes_openai_s_error_with_its_status(message, status, param):
    names = {"input_ids": "messages", "max_tokens": "max_completion_tokens"}
    error = from_model_message(message, names)
    assert (error.status, error.param) == (status, param)
    if param:
        assert error.message.startswith(f"{param}: ")


# One token position as the model sends it: the chosen token (id 7, rank 3) and the top 2.
ENTRY = {
    "7": {"logprob": -2.5, "rank": 3, "decoded_token": " c"},
    "4": {"logprob": -0.5, "rank": 1, "decoded_token": " a"},
    "9": {"logprob": float("-inf"), "rank": 2, "decoded_token": " b"},
}


def test_chat_logprobs_give_the_chosen_token_and_its_ranked_alternatives():
    (item,) = chat_content([ENTRY], [7], top=2)
    assert (item["token"], item["logprob"], item["bytes"]) == (" c", -2.5, [32, 99])
    assert [(t["token"], t["logprob"]) for t in item["top_logprobs"]] == [(" a", -0.5), (" b", MIN_LOGPROB)]
    assert chat_content([ENTRY], [4], top=0)[0]["top_logprobs"] == []


def test_completion_logprobs_list_tokens_alternatives_and_text_offsets():
    logprobs = completion_logprobs([ENTRY, ENTRY], [7, 4], top=1, offset=10)
    assert logprobs == {
        "tokens": [" c", " a"],
        "token_logprobs": [-2.5, -0.5],
        "top_logprobs": [{" a": -0.5}, {" a": -0.5}],
        "text_offset": [10, 12],
    }
