"""benchmarks/stress.py: its CPU smoke run against real tritonservers (the report is complete and every
check passes), and the pieces a GPU run relies on: the solo-answer classifier, the malformed-request
schedule, fault attribution, the seeded traffic mix, and the GPU memory load gauges."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_serving_metrics_families import FakeFamily, metric

from dspark.outputs import EngineLoad
from dspark.serving.metrics import TritonMetrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import stress  # noqa: E402

SMOKE_TIMEOUT_S = 400  # the run takes about a minute on 2 cores; a hung server must still end the test


@pytest.mark.server
def test_tiny_run_against_two_real_servers_passes_every_check_and_reports_each_figure(
    smollm2_dir, smollm2_drafter_dir, tmp_path
):
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "benchmarks" / "stress.py"), "--tiny", "--out", str(out)]
    command += ["--work-dir", str(tmp_path / "work")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, cwd=REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((out / "stress.json").read_text())
    assert report["status"] == "passed" and not report["incomplete"]
    assert report["device"] == "cpu"
    assert [c for c in report["checks"] if c["passed"] is False] == []
    servers = report["replay"]["servers"]
    assert set(servers) == {"main-static", "main-compact"}
    for name, server in servers.items():
        assert server["requests"] > 0 and server["finished"] > 0 and server["errors"] == 0, name
        assert server["faults"] == 0 and server["restarts"] == 0 and server["ready"], name
        assert server["idle"]["reached"] and server["idle"]["dspark_kv_pages_used"] == 0, name
        assert [level["concurrency"] for level in server["per_level"]] == [1, 4, 8]
        assert sum(level["requests"] for level in server["per_level"]) == server["requests"]
        solo = server["solo"]
        assert solo["checked"] > 0 and solo["mismatch"] == 0 and not solo["errors"], (name, solo)
        assert solo["match"] + solo["near_tie"] == solo["checked"]
        # 20 s at one malformed request every 8 s: at 4 s and 12 s, each refused naming its field.
        assert [m["at_s"] for m in server["malformed"]] == [4.0, 12.0]
        assert all(
            m["ok"] and m["wrapper_status"] == "StatusCode.INVALID_ARGUMENT" for m in server["malformed"]
        )
        assert server["memory"]["after"] == {"allocated": 0.0, "reserved": 0.0}  # the CPU has none
        assert server["exit_status"] == 0
    # A fifth of the requests close their stream early; some did, over both servers.
    assert sum(server["cancelled"] for server in servers.values()) > 0
    assert report["capture"]["status"] == "skipped" and report["sanitizer"]["status"] == "skipped"
    summary = (out / "stress.md").read_text()
    assert summary.startswith("# Stress run: passed") and "| main-compact |" in summary
    assert "=== main-static" in (out / "server-logs.txt").read_text()


def test_a_stream_equal_to_its_solo_answer_or_a_prefix_of_it_when_cancelled_matches():
    assert stress.classify([5, 6, 7], True, [5, 6, 7], None, 1e-4) == ("match", None, None)
    assert stress.classify([5, 6], False, [5, 6, 7], None, 1e-4) == ("match", None, None)
    # A finished stream that stopped short of its solo answer did not match.
    assert stress.classify([5, 6], True, [5, 6, 7], None, 1e-4)[0] == "mismatch"


def _entry(*logprobs: float) -> dict:
    """A logprobs entry of the vLLM backend's shape: token id -> {logprob, rank, decoded_token}."""
    return {str(i): {"logprob": lp, "rank": i + 1, "decoded_token": f"t{i}"} for i, lp in enumerate(logprobs)}


def test_a_difference_at_a_near_tie_of_the_solo_answer_is_a_near_tie_and_elsewhere_a_mismatch():
    solo, logprobs = (
        [5, 6, 7, 8],
        [_entry(-0.1, -3.0), _entry(-0.1, -2.0), _entry(-0.69310, -0.69315), _entry()],
    )
    verdict, position, margin = stress.classify([5, 6, 9, 9], True, solo, logprobs, 1e-4)
    assert (verdict, position) == ("near_tie", 2) and margin == pytest.approx(5e-5, abs=1e-9)
    verdict, position, margin = stress.classify([5, 9, 7, 8], True, solo, logprobs, 1e-4)
    assert (verdict, position, margin) == ("mismatch", 1, pytest.approx(1.9))
    # A cancelled stream that diverged: judged at its first difference too.
    assert stress.classify([5, 6, 1], False, solo, logprobs, 1e-4)[:2] == ("near_tie", 2)
    # Without the solo answer's logprobs there (it ended first) a difference stays a mismatch.
    assert stress.classify([5, 6, 7, 8, 9], True, solo, logprobs, 1e-4) == ("mismatch", 4, None)


def test_malformed_requests_come_once_per_interval_in_the_middle_cycling_through_the_cases():
    cases = stress.malformed_cases(vocab=49152)
    schedule = stress.malformed_schedule(300.0, 60.0, len(cases))
    assert schedule == [(30.0, 0), (90.0, 1), (150.0, 2), (210.0, 3), (270.0, 4)]
    assert stress.malformed_schedule(20.0, 8.0, len(cases)) == [(4.0, 0), (12.0, 1)]
    assert stress.malformed_schedule(130.0, 60.0, 2) == [(30.0, 0), (90.0, 1)]
    assert stress.malformed_schedule(300.0, 0.0, len(cases)) == []
    assert {case.field for case in cases} == {"max_tokens", "seed", "input_ids", "temperature"}
    past_vocabulary = next(c for c in cases if c.name == "input_ids past the vocabulary")
    assert past_vocabulary.values["input_ids"] == [1, 49152]


FEATURES = {
    "main-static": {"graphs", "speculation", "static"},
    "main-compact": {"graphs", "speculation", "compact"},
    "control-no-graphs": {"speculation", "compact"},
    "control-spec-off": {"graphs"},
}


@pytest.mark.parametrize(
    ("failing", "verdict"),
    [
        ((), "none"),
        (("main-static", "main-compact", "control-spec-off"), "graphs"),
        (("main-static", "main-compact", "control-no-graphs"), "speculation"),
        (("main-static", "main-compact"), "graphs+speculation"),
        (("main-static",), "static"),
        (tuple(FEATURES), "neither: every configuration (" + ", ".join(sorted(FEATURES)) + ")"),
        (("main-static", "control-no-graphs"), "neither: control-no-graphs, main-static"),
    ],
)
def test_a_failure_is_attributed_to_the_features_of_exactly_the_servers_that_failed(failing, verdict):
    assert stress.attribute({name: name in failing for name in FEATURES}, FEATURES) == verdict


def test_server_features_follow_their_configuration_and_the_device():
    base = stress.EngineConfig()
    features = {name: stress.variant_features(base.replace(**v), True) for name, v in stress.VARIANTS.items()}
    assert features == FEATURES
    assert stress.variant_features(base, on_gpu=False) == {"speculation", "static"}


def test_the_traffic_schedule_is_seeded_and_has_the_mix_the_issue_asks_for():
    plans = [
        stress.plan_request(3, level, stream, 0, 49152, 512) for level in range(6) for stream in range(400)
    ]
    assert plans == [
        stress.plan_request(3, level, stream, 0, 49152, 512) for level in range(6) for stream in range(400)
    ]
    assert plans != [
        stress.plan_request(4, level, stream, 0, 49152, 512) for level in range(6) for stream in range(400)
    ]

    def share(predicate) -> float:
        return sum(map(predicate, plans)) / len(plans)

    assert share(lambda p: p.prompt_text is not None) == pytest.approx(stress.TEXT_SHARE, abs=0.03)
    assert share(lambda p: p.greedy) == pytest.approx(stress.GREEDY_SHARE, abs=0.03)
    assert share(lambda p: p.cancel_after is not None) == pytest.approx(stress.CANCEL_SHARE, abs=0.03)
    assert share(lambda p: p.params.get("num_draft_tokens") == 0) == pytest.approx(
        stress.NO_DRAFT_SHARE, abs=0.02
    )
    sampled = [p for p in plans if not p.greedy]
    assert all(p.params["temperature"] == 0.8 and "seed" in p.params for p in sampled)
    lengths = [len(p.prompt_ids) for p in plans if p.prompt_ids is not None]
    assert min(lengths) == 1 and max(lengths) == 512
    assert all(0 <= i < 49152 for p in plans if p.prompt_ids for i in p.prompt_ids)
    assert {p.params["max_tokens"] for p in plans} >= {1, 512}
    assert all(1 <= p.cancel_after < p.params["max_tokens"] for p in plans if p.cancel_after is not None)
    assert stress.parse_key(plans[-1].key) == (5, 399, 0)


def test_load_publishes_the_engine_s_gpu_memory_gauges():
    FakeFamily.created = {}
    metrics = TritonMetrics(FakeFamily, {"model": "dspark", "version": "1"}, max_model_len=512)
    metrics.load(
        EngineLoad(0, 0, 0, 8, gpu_memory_allocated_bytes=3 << 30, gpu_memory_reserved_bytes=5 << 30)
    )
    metrics.flush()
    assert metric("dspark_gpu_memory_allocated_bytes").value == 3 << 30
    assert metric("dspark_gpu_memory_reserved_bytes").value == 5 << 30
    assert EngineLoad(0, 0, 0, 8).gpu_memory_allocated_bytes == 0  # what other callers leave unset


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engine_load_reports_its_device_s_allocator(tiny_target_dir, tiny_drafter_dir):
    from tiny_models import tiny_engine_config

    from dspark.engine.llm_engine import LLMEngine

    engine = LLMEngine(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, device="cuda"))
    try:
        load = engine.load()
        assert load.gpu_memory_allocated_bytes == torch.cuda.memory_allocated() > 0
        assert (
            load.gpu_memory_reserved_bytes == torch.cuda.memory_reserved() >= load.gpu_memory_allocated_bytes
        )
    finally:
        engine.close()


def test_the_log_scan_flags_device_faults_and_tracebacks_and_counts_restarts():
    log = "\n".join(
        [
            "I1201 server started",
            "RuntimeError: CUDA error: an illegal memory access was encountered",
            "Traceback (most recent call last):",
            "dspark serve: the backend stub exited; restarting tritonserver",
            "a request was restarting nothing",
        ]
    )
    flagged, restarts = stress.scan_log(log)
    assert flagged == [log.splitlines()[1], log.splitlines()[2]] and restarts == 1
    assert stress.scan_log("I1201 fine\nall good") == ([], 0)


def test_first_divergence_is_the_first_differing_position_or_the_shorter_length():
    assert stress.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert stress.first_divergence([1, 2], [1, 2, 3]) == 2
    assert stress.top2_margin(_entry(-1.0, -1.5, -4.0)) == pytest.approx(0.5)
    assert stress.top2_margin(_entry(-1.0)) is None


def test_sanitizer_summaries_of_memcheck_and_racecheck_are_read():
    assert stress.parse_sanitizer_summary("x\n========= ERROR SUMMARY: 0 errors\n") == (0, None)
    assert stress.parse_sanitizer_summary("========= ERROR SUMMARY: 3 errors") == (3, None)
    race = "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)"
    assert stress.parse_sanitizer_summary(race) == (1, 1)
    assert stress.parse_sanitizer_summary("killed before the end") == (None, None)
    # Only the Triton kernels (unmangled `_<name>_kernel`) match racecheck's filter, not torch's.
    assert re.match(stress.TRITON_KERNELS, "_rms_norm_kernel")
    assert not re.match(stress.TRITON_KERNELS, "_ZN2at6native29vectorized_elementwise_kernelILi4EEEv")
