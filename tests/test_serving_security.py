"""Who may call what: inference and health are open; Triton's admin APIs need the launcher's admin key;
every endpoint binds to the launcher's address (127.0.0.1 unless told otherwise)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from server_fixtures import ADMIN_KEY

from dspark.serving.triton_launcher import ADMIN_HEADER, GRPC_ADMIN_HEADER, Server, parse_args, server_command

pytestmark = pytest.mark.server

# (method, path, body) of each restricted HTTP API: shared memory, model control, logging, trace.
ADMIN_CALLS = {
    "register_shared_memory": (
        "POST",
        "/v2/systemsharedmemory/region/stolen/register",
        b'{"key": "triton_python_backend_shm_region_x", "offset": 0, "byte_size": 64}',
    ),
    "shared_memory_status": ("GET", "/v2/systemsharedmemory/status", None),
    "repository_index": ("POST", "/v2/repository/index", b"{}"),
    "unload_model": ("POST", "/v2/repository/models/dspark/unload", b"{}"),
    "log_settings": ("POST", "/v2/logging", b'{"log_verbose_level": 1}'),
    "trace_settings": ("GET", "/v2/trace/setting", None),
}


def http_call(server, method: str, path: str, body: bytes | None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers[ADMIN_HEADER] = key
    request = urllib.request.Request(f"http://{server.http_url}{path}", body, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("call", list(ADMIN_CALLS))
def test_admin_http_api_is_refused_without_the_key(triton_server, call):
    method, path, body = ADMIN_CALLS[call]
    assert http_call(triton_server, method, path, body) == 403
    assert http_call(triton_server, method, path, body, key="guessed") == 403
    assert triton_server.ready()


def test_admin_http_api_answers_the_operator_with_the_key(triton_server):
    assert http_call(triton_server, "GET", "/v2/logging", None, key=ADMIN_KEY) == 200
    assert http_call(triton_server, "POST", "/v2/repository/index", b"{}", key=ADMIN_KEY) == 200


def test_admin_grpc_api_is_refused_without_the_key(triton_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        for call in (
            client.get_system_shared_memory_status,
            client.get_log_settings,
            client.get_model_repository_index,
        ):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
        assert client.get_log_settings(headers={GRPC_ADMIN_HEADER: ADMIN_KEY}) is not None
        assert client.is_server_ready() and client.is_model_ready("dspark")
        assert client.get_model_config("dspark").config.name == "dspark"
    finally:
        client.close()


def test_inference_health_and_metadata_stay_open(triton_server):
    assert http_call(triton_server, "GET", "/v2/health/ready", None) == 200
    assert http_call(triton_server, "GET", "/v2/models/dspark", None) == 200
    assert http_call(triton_server, "GET", "/v2/models/dspark/config", None) == 200
    status, _ = triton_server.post("/v2/models/dspark/generate", {"text_input": "Hi", "max_tokens": 2})
    assert status == 200


def test_every_endpoint_listens_on_the_loopback_address_only(triton_server):
    for port in (triton_server.http_port, triton_server.grpc_port, triton_server.metrics_port):
        assert listening_addresses(port) == {"127.0.0.1"}, port
    with socket.socket() as s:
        s.settimeout(5)
        s.connect(("127.0.0.1", triton_server.http_port))


def test_bind_addresses_and_restrictions_reach_the_command_line(tmp_path):
    args = parse_args(
        ["--address", "0.0.0.0", "--grpc-address", "10.1.2.3", "--model-repository", str(tmp_path)]
    )
    command = server_command(Server(Path("tritonserver"), None, []), args, admin_key="k", shm_prefix="p_")
    assert "--http-address=0.0.0.0" in command and "--metrics-address=0.0.0.0" in command
    assert "--grpc-address=10.1.2.3" in command
    restricted = f"shared-memory,model-repository,logging,trace:{ADMIN_HEADER}=k"
    assert f"--http-restricted-api={restricted}" in command
    assert f"--grpc-restricted-protocol={restricted}" in command
    assert "--backend-config=python,shm-region-prefix-name=p_" in command
    assert parse_args([]).address == "127.0.0.1"


def listening_addresses(port: int) -> set[str]:
    """Addresses with a listening TCP socket on this port (IPv4-mapped IPv6 ones as IPv4), from /proc."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            if len(address) == 32 and address.startswith("0000000000000000FFFF0000"):
                address = address[24:]
            if len(address) == 8:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
            else:
                words = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, 32, 8))
                found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found
