"""`dspark serve` set-up: which tritonserver, its Python backend stub, and the stub's environment."""

from __future__ import annotations

import filecmp
import os
import sys
from pathlib import Path

from dspark.serving import triton_launcher
from dspark.serving.triton_launcher import Server, find_server, parse_args, server_command, server_environment


def wheel_server(monkeypatch) -> Server:
    monkeypatch.setattr(triton_launcher.shutil, "which", lambda name: None)
    return find_server()


def test_wheel_server_gets_a_backend_directory_with_the_stub_for_this_python(monkeypatch):
    import pytriton

    server = wheel_server(monkeypatch)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheel = Path(pytriton.__file__).parent / "tritonserver"
    stub = server.backend_dir / "python" / "triton_python_backend_stub"
    assert filecmp.cmp(
        stub, wheel / "python_backend_stubs" / version / "triton_python_backend_stub", shallow=False
    )
    assert os.access(stub, os.X_OK)
    assert (server.backend_dir / "python" / "libtriton_python.so").is_file()
    assert server.binary.is_file()


def test_stub_runs_with_this_interpreter_on_path_and_its_libpython(monkeypatch):
    server = wheel_server(monkeypatch)
    env = server_environment(server)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    library_dirs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert str(server.library_dirs[0]) in library_dirs
    assert str(Path(sys.base_prefix) / "lib") == library_dirs[0]


def test_a_tritonserver_on_path_is_preferred_and_keeps_its_own_backends(monkeypatch):
    monkeypatch.setattr(triton_launcher.shutil, "which", lambda name: "/opt/tritonserver/bin/tritonserver")
    server = find_server()
    assert server == Server(Path("/opt/tritonserver/bin/tritonserver"), None, [])
    assert not any(flag.startswith("--backend-directory") for flag in server_command(server, parse_args([])))


def test_command_line_carries_ports_repository_and_extra_flags(tmp_path):
    args = parse_args(
        [
            "--model-repository",
            str(tmp_path),
            "--http-port",
            "9000",
            "--grpc-port",
            "9001",
            "--metrics-port",
            "9002",
        ]
        + ["--", "--log-verbose=1"]
    )
    command = server_command(Server(Path("tritonserver"), tmp_path / "backends", []), args)
    for flag in ("--http-port=9000", "--grpc-port=9001", "--metrics-port=9002", "--log-verbose=1"):
        assert flag in command
    assert f"--model-repository={tmp_path.resolve()}" in command
    assert f"--backend-directory={tmp_path / 'backends'}" in command


def test_defaults_are_the_standard_triton_ports_and_the_repository_model_repository():
    args = parse_args([])
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8000, 8001, 8002)
    assert Path(args.model_repository) == triton_launcher.DEFAULT_MODEL_REPOSITORY


def test_a_missing_model_repository_is_an_error(tmp_path, capsys):
    assert triton_launcher.main_serve(["--model-repository", str(tmp_path / "nowhere")]) == 2
    assert "no model repository" in capsys.readouterr().err


def test_the_wheel_stub_refuses_a_numpy_2_interpreter_with_what_to_do():
    problem = triton_launcher.wheel_stub_problem("2.1.3")
    assert "numpy < 2" in problem and "pip install 'numpy<2'" in problem
    assert triton_launcher.wheel_stub_problem("1.26.4") is None
