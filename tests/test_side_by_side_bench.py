"""benchmarks/side_by_side.py on the tiny models: engine specs read as EngineConfig fields, every engine
timed over the prompts, its ratio to the first and its greedy outputs against the first's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import side_by_side  # noqa: E402


def test_engine_specs_take_each_fields_type() -> None:
    assert side_by_side.parse_engine("plain:spec_mode=off") == ("plain", {"spec_mode": "off"})
    assert side_by_side.parse_engine("default:") == ("default", {})
    name, changes = side_by_side.parse_engine("x:prompt_lookup=false,block_size=2,draft_stop_survival=0.5")
    assert name == "x" and changes == {"prompt_lookup": False, "block_size": 2, "draft_stop_survival": 0.5}
    with pytest.raises(SystemExit, match="no field"):
        side_by_side.parse_engine("x:no_such_field=1")


def test_engines_side_by_side_report_ratios_and_identical_outputs(
    tiny_target_dir, tiny_drafter_dir, tmp_path, capsys
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    texts = ("w1 w2 w3", "w4 w5 w4 w5", "w6", "w7 w1")
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
    static = "static:spec_mode=static,adaptive_speculation=false"
    side_by_side.main(
        [
            "--model", str(tiny_target_dir), "--draft-model", str(tiny_drafter_dir), "--device", "cpu",
            "--engine", "plain:spec_mode=off", "--engine", static,
            "--prompts", str(prompts), "--max-tokens", "8", "--rounds", "2", "--batch", "2",
        ]
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{prompts}: 4 prompts, batch 2, 8 greedy tokens, 2 rounds")
    plain, static = (line.split() for line in lines[1:3])
    assert plain[0] == "plain" and plain[3] == "1.000x" and plain[plain.index("identical") + 1] == "4/4"
    assert static[0] == "static" and float(static[5]) > 1.0  # tokens a step: drafts were accepted
    assert static[static.index("identical") + 1] == "4/4"  # greedy: speculation keeps the tokens


def test_prompts_that_do_not_split_into_whole_batches_are_refused(tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("w1", "w2", "w3")))
    with pytest.raises(SystemExit, match="whole batches"):
        side_by_side.main(["--engine", "plain:spec_mode=off", "--prompts", str(prompts), "--batch", "2"])


def test_served_side_by_side_summarizes_rounds_against_the_first_server() -> None:
    """benchmarks/served_side_by_side.py's summary: medians over each server's rounds, the ratio of
    tokens/s to the first server's, the range, errors summed."""
    import served_side_by_side

    def run(rate: float, ttft: float, errors: int = 0) -> dict:
        return {
            "tokens_per_s": rate,
            "ttft_p50_ms": ttft,
            "gap_p50_ms": 20.0,
            "errors": errors,
            "tokens_per_step": 1.5,
        }

    rows = served_side_by_side.summarize(
        {
            "plain": [run(40, 30), run(44, 34), run(42, 50)],
            "default": [run(63, 31), run(50, 30, 1), run(60, 29)],
        }
    )
    assert [r["name"] for r in rows] == ["plain", "default"]
    assert rows[0]["tokens_per_s"] == 42 and rows[0]["ratio"] == 1.0 and rows[0]["range"] == [40, 44]
    assert rows[1]["tokens_per_s"] == 60 and rows[1]["ratio"] == pytest.approx(60 / 42, abs=1e-3)
    assert rows[1]["ttft_p50_ms"] == 30 and rows[1]["errors"] == 1
    assert "step_ms" not in rows[0]  # loads of --client-bench: no engine counters
    timed = served_side_by_side.summarize(
        {"plain": [run(40, 30) | {"step_ms": s} for s in (21.0, 25.0, 22.0)]}
    )
    assert timed[0]["step_ms"] == 22.0


def test_a_benchmark_server_refuses_ports_a_leftover_server_holds(tmp_path) -> None:
    """benchmarks' start_server: a server left running by a harness killed by its timeout answered the
    next run's readiness check and load in place of the server that run configured (session 40, H200)."""
    import socket

    import serving_ceiling

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"port {port} is taken"):
            serving_ceiling.start_server(tmp_path, port, port + 1, port + 2, tmp_path / "server.log")
    assert not (tmp_path / "server.log").exists()  # refused before anything started


def test_a_port_whose_server_stopped_is_free_though_its_connections_linger() -> None:
    """The harness probes a port as a server binds it: connections a stopped server closed sit in
    TIME_WAIT for up to a minute, and a probe without SO_REUSEADDR took them for a leftover server,
    refusing the next mode's server in the same run (session 41, H100)."""
    import socket

    import serving_ceiling

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert serving_ceiling.port_taken(port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its end of the connection lingers in TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))  # what the old probe did: refused
    assert not serving_ceiling.port_taken(port)
