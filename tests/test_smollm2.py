"""The embedded default, SmolLM2-135M-Instruct, through the engine, its offline API and its CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dspark import LLM, EngineConfig, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def plain_greedy(smollm2_dir):
    llm = LLM(EngineConfig(model=str(smollm2_dir), spec_mode="off", num_kv_pages=64))
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_greedy_output_unchanged_by_speculation_on_smollm2(
    smollm2_dir, smollm2_drafter_dir, plain_greedy, mode
):
    llm = LLM(
        EngineConfig(
            model=str(smollm2_dir),
            draft_model=str(smollm2_drafter_dir),
            spec_mode=mode,
            num_kv_pages=64,
            adaptive_speculation=False,
        )
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_greedy
    assert all(o.spec_stats.drafted_tokens > 0 for o in outs)


def test_chat_reply_follows_the_chat_template(smollm2_dir, smollm2_drafter_dir) -> None:
    llm = LLM(EngineConfig(model=str(smollm2_dir), draft_model=str(smollm2_drafter_dir), num_kv_pages=64))
    reply = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=24)
    )
    assert "Paris" in reply.text
    assert reply.finish_reason in ("stop", "length")


def test_dspark_generate_cli_prints_text(smollm2_dir, smollm2_drafter_dir) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark.tools.cli",
            "generate",
            "--prompt",
            PROMPTS[0],
            "--max-tokens",
            "8",
            "--stats",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stop_token_that_ends_a_request_is_in_its_ids_not_its_text(smollm2_dir, skip_special_tokens):
    # vLLM's rule: EOS or a stop_token_id that ends a request is returned as an id, never as text,
    # even with skip_special_tokens false.
    llm = LLM(EngineConfig(model=str(smollm2_dir), spec_mode="off", num_kv_pages=64))
    tokenizer = llm.engine.tokenizer
    free = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop_id = free.token_ids[4]
    params = SamplingParams(
        max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id], skip_special_tokens=skip_special_tokens
    )
    out = llm.generate(PROMPTS[:1], params)[0]
    first = free.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    assert out.text == tokenizer.decode(out.token_ids[:-1], skip_special_tokens=skip_special_tokens)
    chat = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(max_tokens=64, skip_special_tokens=skip_special_tokens),
    )
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in chat.text
