"""The container and Kubernetes recipes (``Dockerfile``, ``deploy/``): the manifests are valid for the API
server (``kubernetes-validate``'s schemas for the core kinds; fields that tie objects together for the CRD
kinds), every flag they pass is one the real ``tideserve`` parser takes, and the image's command line starts a
server from a plain shell. Docker and a cluster are not available here: the image is not built."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml  # comes with kubernetes-validate
from support import REPO

from tideserve.cli import build_parser, options_from_args

KUBERNETES = REPO / "deploy" / "kubernetes"
KSERVE = REPO / "deploy" / "kserve"
DOCKERFILE = REPO / "Dockerfile"
# The oldest and the newest Kubernetes minor version the core manifests are checked against.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor"),
             ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
             ("serving.kserve.io/v1beta1", "InferenceService")}


def _documents(folder: Path) -> dict[str, dict]:
    """``kind`` -> object of every manifest under ``folder`` (one object of each kind here)."""
    found = {}
    for path in sorted(folder.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert doc["kind"] not in found, f"two {doc['kind']} objects"
                found[doc["kind"]] = doc
    return found


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    return _documents(KUBERNETES)


@pytest.fixture(scope="module")
def kserve() -> dict[str, dict]:
    return _documents(KSERVE)


def _container(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def _parse(command: list[str]):
    """``tideserve`` flags through the server's own parser and option checks; the namespace."""
    assert command[0] == "tideserve", command
    namespace, unknown = build_parser().parse_known_args(command[1:])
    assert not unknown, f"flags the tideserve command does not take: {unknown}"
    options_from_args(namespace)
    return namespace


# -- core kinds -----------------------------------------------------------------------------------
def test_kustomization_lists_the_core_manifests(k8s):
    listed = k8s["Kustomization"]["resources"]
    assert sorted(listed) == sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_manifests_validate_against_the_api_schemas(k8s, version):
    core = [doc for kind, doc in k8s.items() if kind != "Kustomization"
            and (doc["apiVersion"], kind) not in CRD_KINDS]
    assert {doc["kind"] for doc in core} == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in core:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_misspelt_field(k8s):
    broken = copy.deepcopy(k8s["Deployment"])
    container = _container(broken["spec"]["template"]["spec"])
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_deployment_flags_probes_and_drain(k8s):
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    container = _container(pod)
    args = _parse(container["command"] + container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    assert args.host == "0.0.0.0" and args.metrics_address == "0.0.0.0"  # reachable from the pod's network
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # engine start-up on CPUs
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + args.exit_timeout_secs
    annotations = k8s["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.metrics_port


def test_service_and_autoscaler_point_at_the_deployment(k8s):
    deployment = k8s["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = k8s["Service"]["spec"]
    assert service["selector"].items() <= labels.items()
    container_ports = {p["name"] for p in _container(deployment["spec"]["template"]["spec"])["ports"]}
    assert {p["targetPort"] for p in service["ports"]} == container_ports
    assert sorted(p["port"] for p in service["ports"]) == [8000, 8001, 8002]
    hpa = k8s["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    names = [m["pods"]["metric"]["name"] for m in hpa["metrics"]]
    assert names == ["vllm_num_requests_waiting", "nv_inference_queue_duration_ms_per_request"]


# -- CRD kinds (KEDA, Prometheus Operator, KServe): no schemas offline; what ties them together ----
def test_optional_scaling_and_scraping_objects(k8s):
    for kind in ("ScaledObject", "PodMonitor"):
        assert (k8s[kind]["apiVersion"], kind) in CRD_KINDS
    deployment = k8s["Deployment"]
    scaled = k8s["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    queries = [t["metadata"]["query"] for t in scaled["triggers"]]
    assert "vllm:num_requests_waiting" in queries[0] and "nv_inference_queue_duration_us" in queries[1]
    monitor = k8s["PodMonitor"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["podMetricsEndpoints"][0]["port"] == "metrics"


def test_kserve_runtime_takes_kserve_triton_flags(kserve):
    runtime = kserve["ClusterServingRuntime"]
    assert (runtime["apiVersion"], "ClusterServingRuntime") in CRD_KINDS
    spec = runtime["spec"]
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert {"name": "triton", "version": "2"}.items() <= spec["supportedModelFormats"][0].items()
    container = _container(spec)
    args = _parse(container["command"] + container["args"])
    # What KServe's storage initializer and router expect of a Triton runtime.
    assert [str(p) for p in args.model_repository] == ["/mnt/models"]
    assert (args.http_port, args.grpc_port, args.host) == (8080, 9000, "0.0.0.0")
    assert int(spec["annotations"]["prometheus.kserve.io/port"]) == args.metrics_port
    service = kserve["InferenceService"]
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] == "triton" and model["protocolVersion"] == "v2"


def test_model_store_is_triton_s_alias_of_model_repository():
    args = build_parser().parse_args(["--model-store=/mnt/models", "--model-repository", "/more"])
    assert [str(p) for p in args.model_repository] == ["/mnt/models", "/more"]


# -- the image ------------------------------------------------------------------------------------
def _dockerfile_exec(instruction: str) -> list[str]:
    (line,) = re.findall(rf"^{instruction}\s+(\[.*\])\s*$", DOCKERFILE.read_text(), re.MULTILINE)
    return json.loads(line)  # exec form: the server is PID 1 and gets SIGTERM itself


def test_the_image_installs_every_package_folder():
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY\s+(\S+)\s+\1\s*$", DOCKERFILE.read_text(), re.MULTILINE))
    assert set(package_dirs.values()) <= copied
