"""Log probabilities: the target's raw distribution at each committed token (vLLM's default
`raw_logprobs`), unchanged by speculation, in the vLLM backend's shape."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from tiny_models import tiny_engine_config

from dspark import LLM, EngineConfig, SamplingParams, outputs
from dspark.outputs import Logprob, LogprobsLog, LogprobsPrefix, logprobs_json
from dspark.runner.models.dense import dense_logits
from dspark.runner.models.loader import load_target_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [2, 2], [7, 1, 3, 3, 5], [3, 5], [6, 6, 1]]
TOLERANCE = 1e-5  # fp32 logits of one position computed in windows of different shapes


def _config(target_dir, draft_dir=None, **changes) -> EngineConfig:
    # fp32: compared with the dense fp32 target, also where the engine runs on a GPU
    return tiny_engine_config(target_dir, draft_dir, **{"dtype": "float32", **changes})


def _assert_same_logprobs(a, b) -> None:
    """Two completions' logprobs agree: the same tokens, ranks and top ids, log probabilities to
    TOLERANCE, cumulative log probability to TOLERANCE per token."""
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert list(x) == list(y)
        for token_id in x:
            assert x[token_id].rank == y[token_id].rank
            assert x[token_id].decoded_token == y[token_id].decoded_token
            assert abs(x[token_id].logprob - y[token_id].logprob) < TOLERANCE
    assert abs(a.cumulative_logprob - b.cumulative_logprob) < TOLERANCE * len(a.token_ids)


@pytest.mark.parametrize("mode", ["static", "compact", "cap-accept"])
def test_greedy_logprobs_are_unchanged_by_speculation(tiny_target_dir, tiny_drafter_dir, mode) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)
    plain = LLM(_config(tiny_target_dir, spec_mode="off")).generate(params=params, prompt_token_ids=PROMPTS)
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode=mode))
    outs = llm.generate(params=params, prompt_token_ids=PROMPTS)
    assert sum(o.spec_stats.accepted_tokens for o in outs) > 0
    for a, b in zip(outs, plain, strict=True):
        _assert_same_logprobs(a, b)


def test_greedy_logprobs_with_num_draft_tokens_zero_equal_speculation_on(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="compact"))
    base = {"max_tokens": 20, "ignore_eos": True, "logprobs": 2, "presence_penalty": 0.5, "min_tokens": 3}
    on = llm.generate(params=SamplingParams(**base), prompt_token_ids=PROMPTS)
    off = llm.generate(params=SamplingParams(**base, num_draft_tokens=0), prompt_token_ids=PROMPTS)
    assert sum(o.spec_stats.accepted_tokens for o in on) > 0
    assert all(o.spec_stats.verified_tokens == 0 for o in off)
    for a, b in zip(on, off, strict=True):
        _assert_same_logprobs(a, b)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, logprobs=4, ignore_eos=True),
        # Raw: neither temperature, top-k nor penalties change the reported values.
        SamplingParams(
            max_tokens=12,
            logprobs=8,
            temperature=0.7,
            top_k=3,
            seed=5,
            ignore_eos=True,
            repetition_penalty=1.5,
        ),
    ],
    ids=["greedy", "sampled-penalized"],
)
def test_logprobs_are_the_log_softmax_of_the_targets_raw_logits(
    tiny_target_dir, tiny_drafter_dir, params
) -> None:
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static"))
    model = load_target_model(tiny_target_dir)
    outs = llm.generate(params=params, prompt_token_ids=PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        total = 0.0
        for k, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            exact = torch.log_softmax(dense_logits(model, prompt + out.token_ids[:k])[-1].double(), -1)
            order = exact.argsort(descending=True).tolist()
            assert token in entry and len(entry) <= params.logprobs + 1
            assert list(entry)[0] == token  # the chosen token first, as vLLM's dict
            assert abs(entry[token].logprob - float(exact[token])) < 1e-4
            assert entry[token].rank == order.index(token) + 1
            top = [t for t in entry if entry[t].rank <= params.logprobs]
            assert sorted(top, key=lambda t: entry[t].rank) == order[: params.logprobs]
            assert all(abs(entry[t].logprob - float(exact[t])) < 1e-4 for t in entry)
            total += float(exact[token])
        assert abs(out.cumulative_logprob - total) < 1e-3


def test_logprobs_zero_reports_the_chosen_token_only_and_none_reports_nothing(tiny_target_dir) -> None:
    llm = LLM(_config(tiny_target_dir, spec_mode="off"))
    chosen, none = llm.generate(
        params=[SamplingParams(max_tokens=6, logprobs=0), SamplingParams(max_tokens=6)],
        prompt_token_ids=[[3, 5], [3, 5]],
    )
    assert [list(entry) for entry in chosen.logprobs] == [[t] for t in chosen.token_ids]
    assert none.logprobs is None and none.cumulative_logprob is None


def test_logprobs_stop_at_the_finishing_token(tiny_target_dir, tiny_drafter_dir) -> None:
    """A step that commits past a stop id reports logprobs only of the tokens kept."""
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static"))
    outs = llm.generate(params=SamplingParams(max_tokens=40, logprobs=1), prompt_token_ids=PROMPTS)
    assert any(o.finish_reason == "stop" for o in outs)
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids)
        assert math.isclose(
            out.cumulative_logprob,
            sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids, strict=True)),
            abs_tol=1e-4,
        )


def test_a_delta_holds_the_logprobs_so_far_unchanged_by_later_steps(tiny_target_dir) -> None:
    llm = LLM(_config(tiny_target_dir, spec_mode="off"))
    engine = llm.engine
    params = SamplingParams(max_tokens=5, logprobs=1, ignore_eos=True)
    engine.add_request("r", engine.prepare_prompt(None, [3, 5], params), params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    assert [len(d.logprobs) for d in deltas] == [1, 2, 3, 4, 5]
    assert all(d.new_logprobs == list(d.logprobs)[-1:] for d in deltas)
    assert deltas[0].logprobs[0] == deltas[-1].logprobs[0]
    with pytest.raises(IndexError):
        deltas[0].logprobs[1]  # noqa: B018


def test_logprobs_json_has_the_vllm_backend_shape() -> None:
    log = LogprobsLog()
    log.entries.append({5: Logprob(-0.5, 2, " a"), 9: Logprob(-0.25, 1, "b")})
    entries = LogprobsPrefix(log, 1)
    assert json.loads(logprobs_json(entries)) == [
        {
            "5": {"logprob": -0.5, "rank": 2, "decoded_token": " a"},
            "9": {"logprob": -0.25, "rank": 1, "decoded_token": "b"},
        }
    ]
    assert logprobs_json(None) == "null"
    assert json.loads(logprobs_json([])) == []


def test_deltas_pickled_to_another_process_carry_only_their_new_logprobs(tiny_target_dir) -> None:
    """The engine process pickles every delta to the adapter: each carries the entries not shipped
    before (a delta never pickled loses nothing), the receiver rebuilds every prefix, and forgets the
    request's log at its last delta."""
    llm = LLM(_config(tiny_target_dir, spec_mode="off"))
    engine = llm.engine
    params = SamplingParams(max_tokens=40, logprobs=20, ignore_eos=True)
    engine.add_request("p", engine.prepare_prompt(None, [3, 5], params), params)
    sent, received = [], []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            data = pickle.dumps(delta) if len(sent) % 3 != 1 else b""  # every third one stays here
            sent.append(len(data))
            if data:
                received.append((delta, pickle.loads(data)))
            if len(sent) == 4:  # and one is sent twice
                received.append((delta, pickle.loads(pickle.dumps(delta))))
    sizes = [size for size in sent if size]
    assert max(sizes) < 2 * min(sizes), "a delta's pickle grows with the request's earlier tokens"
    for original, copy in received:
        assert list(copy.logprobs) == list(original.logprobs)
        assert copy.cumulative_logprob == original.cumulative_logprob
    assert received[-1][1].logprobs.final and not outputs._received_logs
