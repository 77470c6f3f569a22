"""The OpenAI-compatible endpoint of `dspark serve`, driven by the real `openai` package against the
session's tritonserver: chat and text completions, streamed and whole, equal to the gRPC stream's greedy
output; stop strings, limits, usage; errors in OpenAI's shape; a client that goes away frees its request."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from server_fixtures import GrpcStream, Outcome, wait_for

pytestmark = pytest.mark.server

MODEL = "dspark"
MESSAGES = [{"role": "user", "content": "Name three colours of autumn leaves."}]
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 16}
FOREVER = {"ignore_eos": True}  # extra_body: the vLLM-style parameter the dspark model takes


@pytest.fixture(scope="module")
def client(triton_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=triton_server.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_ids(smollm2_dir) -> list[int]:
    """MESSAGES through the model's chat template, rendered by transformers (the reference)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    encoded = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def grpc_greedy(server, **prompt: object) -> Outcome:
    """The dspark model's greedy output over its own gRPC stream."""
    sampling = {"temperature": 0, "max_tokens": GREEDY["max_tokens"]}
    with GrpcStream(server) as grpc:
        outcome = grpc.send(
            stream=True, sampling_parameters=sampling, return_finish_reason=True, **prompt
        ).collect()
    assert outcome.error is None, outcome.error
    return outcome


@pytest.fixture(scope="module")
def grpc_chat(triton_server, chat_ids) -> Outcome:
    return grpc_greedy(triton_server, input_ids=chat_ids)


@pytest.fixture(scope="module")
def grpc_completion(triton_server) -> Outcome:
    return grpc_greedy(triton_server, text_input=PROMPT)


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == [MODEL]


def test_greedy_chat_equals_the_grpc_stream_with_the_chat_template(client, grpc_chat, chat_ids):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == grpc_chat.text
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[grpc_chat.finish_reason]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(chat_ids), len(grpc_chat.ids))
    assert reply.usage.total_tokens == len(chat_ids) + len(grpc_chat.ids)


def test_streamed_chat_deltas_add_up_to_the_grpc_text_and_end_with_usage(client, grpc_chat, chat_ids):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == grpc_chat.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1, (
        "streamed, not in one piece"
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [grpc_chat.finish_reason]
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        len(chat_ids),
        len(grpc_chat.ids),
    )


def test_greedy_completion_equals_the_grpc_stream_whole_and_streamed(client, grpc_completion):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **GREEDY)
    assert whole.choices[0].text == grpc_completion.text
    assert "".join(chunk.choices[0].text for chunk in streamed) == grpc_completion.text
    assert whole.usage.completion_tokens == len(grpc_completion.ids)


def test_a_stop_string_cuts_the_text_before_it_with_finish_reason_stop(client, grpc_completion):
    text = grpc_completion.text
    stop = text[len(text) // 2 :][:4]
    expected = text[: text.index(stop)]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stop=stop, stream=True, **GREEDY))
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_ends_the_completion_with_finish_reason_length(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0, extra_body=FOREVER
    )
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 5)


def test_completions_default_to_openai_s_16_tokens(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body=FOREVER)
    assert reply.usage.completion_tokens == 16


@pytest.mark.parametrize(
    ("param", "kwargs"),
    [
        ("temperature", {"temperature": -1}),
        ("top_p", {"top_p": 0}),
        ("max_completion_tokens", {"max_completion_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("seed", {"seed": -1}),
        ("n", {"n": 2}),
        ("messages", {"messages": []}),
        ("top_logprobs", {"top_logprobs": 3}),
        ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_parameter_is_a_400_naming_it_streamed_or_not(client, param, kwargs, stream):
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(stream=stream, **request)
    assert raised.value.status_code == 400
    assert raised.value.param == param and raised.value.body["message"].startswith(f"{param}: ")
    assert raised.value.body["type"] == "invalid_request_error"


def test_a_prompt_longer_than_the_context_is_a_400_naming_prompt(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    assert raised.value.param == "prompt"


def test_an_unknown_model_is_a_404_naming_model(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert (raised.value.param, raised.value.code) == ("model", "model_not_found")


def test_a_client_that_disconnects_mid_stream_frees_its_request(client, triton_server):
    def running() -> float | None:
        return triton_server.metric("dspark_num_requests_running", model=MODEL)

    def pages() -> float | None:
        return triton_server.metric("dspark_kv_pages_used", model=MODEL)

    assert wait_for(lambda: running() == 0 and pages() == 0)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=400, stream=True, extra_body=FOREVER
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    # The gauges are published every 0.1 s: the first chunks can come sooner (a CPU prefill of ~20 ms).
    assert wait_for(lambda: running() == 1 and pages() > 0), (running(), pages())
    stream.close()
    assert wait_for(lambda: running() == 0 and pages() == 0, timeout=10), (running(), pages())


def test_a_client_that_gives_up_on_a_whole_completion_frees_its_request(triton_server):
    impatient = openai.OpenAI(base_url=triton_server.openai_url, api_key="unused", max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=450, extra_body=FOREVER)
    assert wait_for(lambda: triton_server.metric("dspark_num_requests_running", model=MODEL) == 0, timeout=10)
    assert wait_for(lambda: triton_server.metric("dspark_kv_pages_used", model=MODEL) == 0, timeout=10)


def model_has_logprobs(server) -> bool:
    """Whether the served dspark model takes the vLLM backend's `return_logprobs` input."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10) as response:
        config = json.loads(response.read())
    return any(tensor["name"] == "return_logprobs" for tensor in config["input"])


def test_greedy_chat_logprobs_follow_the_chosen_tokens_streamed_or_not(client, triton_server):
    assert model_has_logprobs(triton_server)
    request = {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 3, **GREEDY}
    reply = client.chat.completions.create(**request)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(item.token for item in content) == reply.choices[0].message.content
    for item in content:
        ranked = [alternative.logprob for alternative in item.top_logprobs]
        assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True) and ranked[0] <= 0
        assert (item.token, item.logprob) == (item.top_logprobs[0].token, ranked[0]), "greedy picks the top"
    chunks = client.chat.completions.create(stream=True, **request)
    streamed = [
        item
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content], abs=1e-4)


def test_completion_logprobs_list_each_token_with_its_alternatives(client, triton_server):
    assert model_has_logprobs(triton_server)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert len(logprobs.token_logprobs) == reply.usage.completion_tokens == len(logprobs.top_logprobs)
    assert all(0 < len(top) <= 2 and max(top.values()) <= 0 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
