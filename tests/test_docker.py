"""docker/: the image and compose file, checked statically (no Docker engine runs the tests)."""

from __future__ import annotations

import re

import yaml

from dspark.config import REPO_ROOT

DOCKER = REPO_ROOT / "docker"


def dockerfile_copies() -> list[str]:
    sources = []
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        match = re.match(r"^COPY\s+(?:--\S+\s+)*(.+)$", line.strip())
        if match:
            sources.extend(match.group(1).split()[:-1])
    return sources


def test_dockerfile_builds_on_an_official_tritonserver_image():
    text = (DOCKER / "Dockerfile").read_text()
    version = re.search(r"^ARG TRITON_VERSION=(\d\d\.\d\d)$", text, re.M)
    assert version, "a pinned yy.mm release"
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3" in text


def test_every_path_the_dockerfile_copies_exists_in_the_repository():
    sources = dockerfile_copies()
    assert "model_repository/" in sources and "pyproject.toml" in sources
    for source in sources:
        assert (REPO_ROOT / source).exists(), source


def test_compose_reserves_a_gpu_and_sets_shm_ulimits_ports_volumes_and_a_readiness_healthcheck():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["dspark"]
    device = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert service["shm_size"]
    assert service["ulimits"]["memlock"] == -1 and service["ulimits"]["stack"] > 0
    assert {p.split(":")[0] for p in service["ports"]} == {"8000", "8001", "8002", "9000"}  # 9000: OpenAI
    mounts = {v.split(":")[1] for v in service["volumes"]}
    assert {"/opt/dspark/model_repository", "/opt/dspark/models"} <= mounts
    assert "model-cache" in compose["volumes"]
    assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"])
    build = service["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()


def test_bind_mounted_paths_exist_and_the_entrypoint_is_executable():
    service = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["dspark"]
    for volume in service["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("."):
            assert (DOCKER / source).resolve().is_dir(), source
    entrypoint = DOCKER / "entrypoint.sh"
    assert entrypoint.stat().st_mode & 0o111
    assert "exec dspark serve" in entrypoint.read_text()


def test_the_container_serves_every_interface_restarts_and_takes_the_admin_key_from_the_environment():
    from dspark.serving.triton_launcher import parse_args

    cmd = re.search(r"^CMD (\[.*\])$", (DOCKER / "Dockerfile").read_text(), re.M)
    args = parse_args(yaml.safe_load(cmd.group(1)))
    assert args.address == "0.0.0.0", "inside a container, loopback is unreachable from the host"
    assert args.model_repository == "/opt/dspark/model_repository"
    service = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["dspark"]
    assert service["restart"] == "unless-stopped"
    assert "DSPARK_ADMIN_KEY" in service["environment"]
