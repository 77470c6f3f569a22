"""The Makefile's set-up matches dspark.config, and `make test` fails when pytest collects nothing."""

from __future__ import annotations

import re
import subprocess

from dspark.config import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, REPO_ROOT

MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def variable(name: str) -> str:
    return re.search(rf"^{name} :?= (.+)$", MAKEFILE, re.M).group(1).strip()


def test_makefile_model_paths_are_the_engine_defaults():
    assert REPO_ROOT / variable("TARGET_DIR") == DEFAULT_TARGET_DIR
    assert REPO_ROOT / variable("DRAFT_DIR") == DEFAULT_DRAFT_DIR


def test_torch_is_installed_pinned_before_the_project():
    dry_run = subprocess.run(
        ["make", "-n", "-B", "-C", str(REPO_ROOT), "setup"], capture_output=True, text=True, check=True
    ).stdout
    torch = dry_run.index("pip install torch==")
    assert torch < dry_run.index("pip install -e '.[serve,test]'") < dry_run.index("dspark import-gguf")


def test_make_test_fails_when_pytest_collects_no_tests(tmp_path):
    result = subprocess.run(
        ["make", "-C", str(REPO_ROOT), "test", f"PYTEST_ARGS={tmp_path}"], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "collected no tests" in result.stderr


def test_ports_and_repository_can_be_overridden():
    dry_run = subprocess.run(
        [
            "make",
            "-n",
            "-C",
            str(REPO_ROOT),
            "serve",
            "HTTP_PORT=9100",
            "GRPC_PORT=9101",
            "METRICS_PORT=9102",
            "MODEL_REPOSITORY=/srv/repo",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--http-port 9100",
        "--grpc-port 9101",
        "--metrics-port 9102",
        "--model-repository /srv/repo",
    ):
        assert flag in dry_run.replace("\\\n\t", "").replace("  ", " ")
