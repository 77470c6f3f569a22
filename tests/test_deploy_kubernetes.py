"""deploy/: the Kubernetes manifests, checked statically (no cluster or kubectl runs the tests).

Every built-in resource is validated with kubernetes-validate in strict mode (unknown fields are
errors) against a pinned Kubernetes release; the checks below it tie the manifests to what the
server really does: the launcher's ports and flags, the compose file, the metrics the model exports.
"""

from __future__ import annotations

import copy
import http.server
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dspark.config import REPO_ROOT
from dspark.outputs import EngineLoad
from dspark.serving.metrics import TritonMetrics
from dspark.serving.triton_launcher import parse_args

DEPLOY = REPO_ROOT / "deploy"
# The Kubernetes release the manifests are validated against (kubernetes-validate ships its schemas).
KUBERNETES_VERSION = "1.33.0"
# Kinds defined by CustomResourceDefinitions, which kubernetes-validate has no schema for.
CRD_KINDS = {"ServiceMonitor"}
HPA_METRICS = {"dspark_num_requests_running", "dspark_num_requests_waiting"}


def load_all(path: Path) -> list[dict[str, Any]]:
    """Every document of a YAML file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resources() -> list[tuple[Path, dict[str, Any]]]:
    """(file, resource) for every Kubernetes object under deploy/ (kustomizations and Helm values aside)."""
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in load_all(path):
            if "apiVersion" in doc and doc.get("kind") != "Kustomization":
                found.append((path, doc))
    return found


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    """The single resource of this kind (and name)."""
    matches = [r for _, r in resources() if r["kind"] == kind and name in (None, r["metadata"]["name"])]
    assert len(matches) == 1, (kind, name, len(matches))
    return matches[0]


def container() -> dict[str, Any]:
    """The dspark container of the Deployment."""
    (spec,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return spec


def container_port(name_or_number: str | int) -> int:
    """A container port by its name (as probes and Services refer to it) or number."""
    for port in container()["ports"]:
        if name_or_number in (port["name"], port["containerPort"]):
            return port["containerPort"]
    raise AssertionError(f"no container port {name_or_number!r}")


def launcher_args() -> Any:
    """The container's arguments as `dspark serve` parses them."""
    return parse_args([str(arg) for arg in container()["args"]])


def byte_size(text: str) -> int:
    """Bytes in a Kubernetes quantity (2Gi) or a Docker size (2gb; Docker's units are binary)."""
    match = re.fullmatch(r"(\d+)\s*([KMGT]i|[kmgt]b?)?", str(text).strip())
    assert match, text
    number, unit = int(match.group(1)), (match.group(2) or "").lower().rstrip("b").rstrip("i")
    return number * 1024 ** ("kmgt".index(unit) + 1 if unit else 0)


def probe_budget_s(probe: dict[str, Any]) -> int:
    """Seconds of consecutive failures before a probe acts."""
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_every_builtin_resource_validates_strictly_against_the_pinned_kubernetes_release():
    checked = set()
    for _, resource in resources():
        if resource["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        checked.add(resource["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "NetworkPolicy"} <= checked


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(
            paht="/v2/health/ready"
        ),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="8000"),
        lambda d: d["spec"]["template"]["spec"].update(volumes={"name": "dshm"}),
        lambda d: d["spec"].pop("selector"),
    ],
    ids=["misspelled-field", "port-as-string", "volumes-not-a-list", "no-selector"],
)
def test_the_schema_check_rejects_a_broken_deployment(breakage):
    broken = copy.deepcopy(one("Deployment"))
    breakage(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_manifest_is_in_a_kustomization_and_every_listed_file_exists():
    listed = set()
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        for name in yaml.safe_load(kustomization.read_text())["resources"]:
            path = (kustomization.parent / name).resolve()
            assert path.is_file(), path
            listed.add(path)
    assert {path.resolve() for path, _ in resources()} == listed


def test_readiness_and_startup_ask_triton_if_the_model_is_ready_and_liveness_if_the_server_lives():
    spec = container()
    http = launcher_args().http_port
    for name in ("startupProbe", "readinessProbe"):
        probe = spec[name]["httpGet"]
        assert probe["path"] == "/v2/health/ready" and container_port(probe["port"]) == http, name
    live = spec["livenessProbe"]["httpGet"]
    assert live["path"] == "/v2/health/live" and container_port(live["port"]) == http


def test_probe_timing_leaves_restarts_to_dspark_serve_and_drops_a_dead_engine_quickly():
    spec = container()
    args = launcher_args()
    # The first start may take as long as dspark serve itself waits for readiness.
    assert probe_budget_s(spec["startupProbe"]) >= args.startup_timeout
    # Liveness must outlast a restart by dspark serve (minutes on a GPU: load and CUDA graphs) ...
    assert probe_budget_s(spec["livenessProbe"]) >= 180
    # ... while a pod whose engine or stub died leaves the Service within seconds.
    assert probe_budget_s(spec["readinessProbe"]) <= 15
    assert args.max_restarts >= 1, "dspark serve restarts the server before the kubelet restarts the pod"
    assert one("Deployment")["spec"]["template"]["spec"].get("restartPolicy", "Always") == "Always"
    grace = one("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pre_stop_limit_s() + args.exit_timeout + 10, "preStop, then dspark serve's own stop"


def pre_stop_script() -> str:
    """The Python program the container's preStop hook runs."""
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    return command[2]


def pre_stop_limit_s() -> int:
    """The most seconds the preStop hook waits."""
    return int(re.search(r"time\.monotonic\(\) - start < (\d+)", pre_stop_script()).group(1))


class FakeMetrics(http.server.BaseHTTPRequestHandler):
    """A metrics port whose engine holds requests until `busy_until` (a monotonic time)."""

    busy_until = 0.0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        busy = int(time.monotonic() < self.busy_until)
        lines = [
            f'dspark_num_requests_{name}{{model="dspark",version="1"}} {busy}'
            for name in ("running", "waiting")
        ]
        body = ("# TYPE dspark_num_requests_running gauge\n" + "\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet."""


def test_the_pre_stop_hook_waits_until_the_engine_has_no_request():
    script = pre_stop_script()
    assert ":8002/metrics" in script and launcher_args().metrics_port == 8002
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        script = script.replace(":8002/", f":{server.server_address[1]}/")
        started = time.monotonic()
        FakeMetrics.busy_until = started + 7.0
        subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
        elapsed = time.monotonic() - started
        assert 7.0 <= elapsed < 12.0, elapsed
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
        assert 5.0 <= time.monotonic() - started < 9.0, "idle: the 5 s for endpoint removal, then stop"
    finally:
        server.shutdown()
        server.server_close()


def test_the_container_binds_every_interface_on_the_launcher_default_ports():
    args = launcher_args()
    defaults = parse_args([])
    assert args.address == "0.0.0.0", "loopback inside a pod is unreachable from the Service"
    assert args.model_repository == "/opt/dspark/model_repository"
    for name in ("http", "grpc", "metrics"):
        port = getattr(args, f"{name}_port")
        assert port == getattr(defaults, f"{name}_port") == container_port(name), name
    # The OpenAI endpoint (dspark serve --openai-port) and the address it binds.
    assert args.openai_port == defaults.openai_port == container_port("openai")
    assert args.openai_address in (None, "0.0.0.0")


def test_the_container_declares_exactly_the_ports_compose_publishes_and_the_image_exposes():
    service = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())["services"]["dspark"]
    published = {int(str(port).split(":")[-1].split("/")[0]) for port in service["ports"]}
    exposed = re.search(r"^EXPOSE (.+)$", (REPO_ROOT / "docker" / "Dockerfile").read_text(), re.M)
    declared = {port["containerPort"] for port in container()["ports"]}
    assert declared == published == {int(port) for port in exposed.group(1).split()}


def test_the_deployment_takes_a_gpu_memory_backed_shm_and_an_optional_admin_key_secret():
    spec = container()
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    (shm,) = [m for m in spec["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [
        v for v in one("Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == shm["name"]
    ]
    assert volume["emptyDir"]["medium"] == "Memory"
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())["services"]["dspark"]
    assert byte_size(volume["emptyDir"]["sizeLimit"]) >= byte_size(compose["shm_size"])
    (key,) = [e for e in spec.get("env", []) if e["name"] == "DSPARK_ADMIN_KEY"]
    assert "value" not in key, "the admin key comes from a Secret, never from the manifest"
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True, "no Secret: admin APIs closed, pod starts"
    assert "--admin-key" not in [str(arg) for arg in spec["args"]]
    assert launcher_args().admin_key == parse_args([]).admin_key, "the key is only ever the environment's"


def test_the_service_selects_the_pods_and_routes_every_container_port():
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = one("Service", "dspark")
    assert service["spec"]["selector"].items() <= labels.items()
    routed = {port["port"]: container_port(port["targetPort"]) for port in service["spec"]["ports"]}
    assert routed == {8000: 8000, 8001: 8001, 8002: 8002, 9000: 9000}
    headless = one("Service", "dspark-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= labels.items()
    assert {container_port(p["targetPort"]) for p in headless["spec"]["ports"]} >= {8001}


def test_the_hpa_scales_the_deployment_on_per_pod_dspark_load():
    hpa = one("HorizontalPodAutoscaler")
    deployment = one("Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        deployment["kind"],
        deployment["metadata"]["name"],
    )
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert set(metrics) == HPA_METRICS and all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
    assert all(target["type"] == "AverageValue" for target in metrics.values())
    max_num_seqs = int(config_parameter("max_num_seqs"))
    assert 0 < float(metrics["dspark_num_requests_running"]["averageValue"]) < max_num_seqs
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def config_parameter(key: str) -> str:
    """A parameter's string_value in model_repository/dspark/config.pbtxt."""
    text = (REPO_ROOT / "model_repository" / "dspark" / "config.pbtxt").read_text()
    match = re.search(r'key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    assert match, key
    return match.group(1)


class RecordingFamily:
    """Stands in for Triton's MetricFamily: records each family's kind, labels and last value."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, RecordingFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.kind, self.labels, self.value = kind, {}, None
        RecordingFamily.created[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> RecordingFamily:  # noqa: N802
        self.labels = dict(labels)
        return self

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, amount: float) -> None:
        self.value = (self.value or 0) + amount


def go_expand(template: str, match: re.Match[str]) -> str:
    """A Go regexp replacement template (${1}) expanded with a Python match."""
    return re.sub(r"\$\{(\d+)\}", lambda group: match.group(int(group.group(1))), template)


def test_the_hpa_metrics_are_gauges_the_model_exports_and_the_adapter_rule_serves():
    RecordingFamily.created = {}
    model = "dspark"
    assert re.search(
        rf'^name:\s*"{model}"', (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text(), re.M
    )
    metrics = TritonMetrics(RecordingFamily, {"model": model, "version": "1"})
    metrics.load(EngineLoad(num_running=3, num_waiting=5, kv_pages_used=1, kv_pages_total=2))
    metrics.flush()
    running = RecordingFamily.created["dspark_num_requests_running"]
    waiting = RecordingFamily.created["dspark_num_requests_waiting"]
    assert (running.kind, running.value, waiting.kind, waiting.value) == ("gauge", 3, "gauge", 5)
    assert running.labels["model"] == waiting.labels["model"] == model

    values = yaml.safe_load((DEPLOY / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    served = set()
    for rule in values["rules"]["custom"]:
        series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
        assert f'model="{model}"' in rule["seriesQuery"] and f'model="{model}"' in rule["metricsQuery"]
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        go_template = rule["name"]["as"]
        for name in RecordingFamily.created:
            if re.fullmatch(series, name):
                match = re.fullmatch(rule["name"]["matches"], name)
                assert match, name
                served.add(go_expand(go_template, match))
    hpa = one("HorizontalPodAutoscaler")
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served


def test_prometheus_scrapes_the_metrics_port_by_annotation_or_service_monitor():
    template = one("Deployment")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    metrics_port = launcher_args().metrics_port
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    monitor = one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        r
        for _, r in resources()
        if r["kind"] == "Service" and selector.items() <= r["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["dspark"], "one Service: each pod scraped once"
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in selected[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert container_port(port["targetPort"]) == metrics_port and endpoint["path"] == "/metrics"


def test_the_network_policy_opens_inference_and_keeps_metrics_to_the_monitoring_namespace():
    policy = one("NetworkPolicy")
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    open_ports, restricted = set(), set()
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        (open_ports if "from" not in rule else restricted).update(ports)
    args = launcher_args()
    assert open_ports == {args.http_port, args.grpc_port, container_port("openai")}
    assert restricted == {args.metrics_port}
