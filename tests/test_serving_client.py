"""dspark-client against a real server: streaming generate over gRPC and HTTP, and the bench sweep."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dspark_client.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import served_side_by_side  # noqa: E402

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"


def generate(capsys, *flags: str) -> tuple[str, dict]:
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "6", "--ignore-eos", "--stats", *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, json.loads(captured.err.strip().splitlines()[-1])


def test_generate_streams_the_completion_over_grpc(triton_server, capsys):
    text, stats = generate(capsys, "--url", triton_server.grpc_url)
    assert text.strip()
    assert stats["tokens"] == 6 and stats["finish_reason"] == "length"
    assert stats["spec_stats"]["steps"] >= 1


def test_generate_over_http_streams_the_same_greedy_text(triton_server, capsys):
    grpc_text, _ = generate(capsys, "--url", triton_server.grpc_url)
    http_text, stats = generate(capsys, "--http", "--url", triton_server.http_url)
    assert http_text == grpc_text and stats["tokens"] == 6


def test_generate_sends_a_user_turn_unless_raw(triton_server, capsys):
    # The default renders the prompt through the chat template (a reply); --raw continues the text.
    chat_text, _ = generate(capsys, "--url", triton_server.grpc_url)
    raw_text, stats = generate(capsys, "--raw", "--url", triton_server.grpc_url)
    assert raw_text != chat_text and stats["tokens"] == 6


def test_generate_reports_a_server_error_naming_the_field(triton_server, capsys):
    assert main(["generate", "--prompt", PROMPT, "--top-p", "3", "--url", triton_server.grpc_url]) == 1
    assert "top_p" in capsys.readouterr().err


def test_bench_reports_latency_throughput_and_acceptance_per_level(triton_server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--url", triton_server.grpc_url, "--concurrency", "1,2", "--num-prompts", "2"]
    assert main([*argv, "--max-tokens", "4", "--ignore-eos", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["concurrency"] for row in rows] == [1, 2]
    for row in rows:
        assert row["errors"] == 0 and row["requests"] == 2
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"]
        assert row["itl_p50_s"] > 0 and row["output_tokens_per_s"] > 0
        assert row["acceptance_length"] >= 1.0
    assert "TTFT p50" in capsys.readouterr().out


def test_bench_sends_the_prompts_of_a_file(triton_server, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "Name a color."}\n\n{"prompt": "Name a fruit.", "id": 2}\n')
    out = tmp_path / "bench.json"
    argv = ["bench", "--url", triton_server.grpc_url, "--concurrency", "1", "--num-prompts", "2"]
    assert main([*argv, "--prompts", str(prompts), "--max-tokens", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["errors"] == 0
    prompts.write_text('{"text": "no prompt field"}\n')
    assert main([*argv, "--prompts", str(prompts)]) == 2
    assert "mine.jsonl:1" in capsys.readouterr().err


def test_served_side_by_side_times_a_load_with_the_client_users_run(triton_server, tmp_path):
    # benchmarks/served_side_by_side.py --client-bench: the console script's own figures, one level.
    args = "--concurrency 1 --num-prompts 2 --max-tokens 6 --ignore-eos"
    figures = served_side_by_side.client_bench_load(triton_server.grpc_url, args, tmp_path / "c.json")
    assert figures["errors"] == 0 and figures["tokens_per_s"] > 0 and figures["tokens_per_step"] >= 1.0
    with pytest.raises(SystemExit, match="one --concurrency level"):
        two_levels = "--concurrency 1,2 --num-prompts 2 --max-tokens 2"
        served_side_by_side.client_bench_load(triton_server.grpc_url, two_levels, tmp_path / "d.json")
