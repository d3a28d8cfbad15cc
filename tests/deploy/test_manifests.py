"""The kustomize overlays build, and every object validates offline.

Built-in kinds are validated with ``kubernetes-validate`` (strict: unknown fields fail)
for Kubernetes ``K8S_VERSION``. The two CRD kinds (ServiceMonitor, ScaledObject) have no
schema there: they are validated against the minimal JSON schemas below, written from
the CRDs' documented required fields. Any other kind fails the test.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped,unused-ignore]
import kubernetes_validate  # type: ignore[import-untyped,unused-ignore]
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBECTL = "/usr/bin/kubectl"
K8S_VERSION = "1.34.0"
TARGETS = ["base", "overlays/gpu-fleet", "overlays/sim-cpu"]
_NAME = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["metadata", "spec"],
        "properties": {"metadata": _NAME, "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object"},
                "namespaceSelector": {"type": "object"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"],
                    "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
            }}}},
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["metadata", "spec"],
        "properties": {"metadata": _NAME, "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"]},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
                "advanced": {"type": "object"},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"],
                    "properties": {"type": {"type": "string"}, "metadata": {
                        "type": "object", "additionalProperties": {"type": "string"}}}}},
            }}}},
}


def build(target: str) -> list[dict[str, Any]]:
    out = subprocess.run([KUBECTL, "kustomize", str(DEPLOY / target)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    return {t: build(t) for t in TARGETS}


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            pod = d["spec"]["template"]["spec"]
            for c in pod["containers"]:
                yield f"{d['metadata']['name']}/{c['name']}", c, pod


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates(built: dict[str, list[dict[str, Any]]], target: str) -> None:
    for doc in built[target]:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_SCHEMAS:
            print(f"{target}: {doc['kind']}/{doc['metadata']['name']}: CRD, validated against the minimal schema")
            jsonschema.validate(doc, CRD_SCHEMAS[key])
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "kvgate") == "kvgate" or doc["kind"] == "Namespace"


def test_security_probes_resources(built: dict[str, list[dict[str, Any]]]) -> None:
    for target in ("overlays/gpu-fleet", "overlays/sim-cpu"):
        for name, c, pod in containers(built[target]):
            sc = c.get("securityContext", {})
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], name
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert "requests" in c.get("resources", {}), name
            # exemption: the SGLang GPU container keeps the image's user (root) for the
            # GPU devices and writes under its root filesystem (Triton/compile caches)
            if not (target == "overlays/gpu-fleet" and name == "sglang/sglang"):
                assert sc.get("readOnlyRootFilesystem") is True, name
                assert sc.get("runAsNonRoot") or pod.get("securityContext", {}).get("runAsNonRoot"), name
            if name.endswith("/kvgate-drain"):
                continue
            assert "readinessProbe" in c and "livenessProbe" in c, name


def test_validation_has_teeth() -> None:
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    so = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"}, "spec": {"triggers": []}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(so, CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")])


def test_gateway_rbac_is_minimal(built: dict[str, list[dict[str, Any]]]) -> None:
    role = find(built["base"], "Role", "kvgate")
    rules = {(r["apiGroups"][0], r["resources"][0]): sorted(r["verbs"]) for r in role["rules"]}
    assert rules == {("discovery.k8s.io", "endpointslices"): ["get", "list", "watch"],
                     ("", "pods"): ["get", "list", "patch"]}
    gw = find(built["base"], "Deployment", "kvgate")
    assert gw["spec"]["replicas"] >= 2 and gw["spec"]["template"]["spec"]["serviceAccountName"] == "kvgate"
    spread = gw["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert any(s["topologyKey"] == "kubernetes.io/hostname" for s in spread)
    c = gw["spec"]["template"]["spec"]["containers"][0]
    assert (c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/health")
    assert find(built["base"], "PodDisruptionBudget", "kvgate")["spec"]["minAvailable"] == 1


def test_gateway_config_matches_replica_service(built: dict[str, list[dict[str, Any]]]) -> None:
    from gateway.settings import load_settings

    settings = load_settings(DEPLOY / "base" / "kvgate.yaml")
    reg = settings.registry
    assert (reg.discovery, settings.port, settings.index.backend) == ("kubernetes", 8000, "redis")
    svc = find(built["base"], "Service", str(reg.k8s_service))
    assert svc["spec"]["clusterIP"] == "None"
    assert reg.k8s_port_name in [p["name"] for p in svc["spec"]["ports"]]
    for target in ("overlays/gpu-fleet", "overlays/sim-cpu"):
        dep = find(built[target], "Deployment", "sglang")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), target
        ports = [p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        assert "http" in ports


def test_gpu_fleet_replica(built: dict[str, list[dict[str, Any]]]) -> None:
    dep = find(built["overlays/gpu-fleet"], "Deployment", "sglang")
    pod = dep["spec"]["template"]["spec"]
    sglang = next(c for c in pod["containers"] if c["name"] == "sglang")
    args = sglang["args"]
    assert sglang["command"] == ["sglang", "serve"]
    for flag in ("--enable-metrics", "--enable-cache-report", "--enable-hierarchical-cache"):
        assert flag in args
    assert args[args.index("--tp-size") + 1] == "8" and "--page-size" in args
    assert args[args.index("--speculative-algorithm") + 1] == "DFLASH" and "--speculative-draft-model-path" in args
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == "8"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "model-cache"
    startup = sglang["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    assert sglang["readinessProbe"]["httpGet"]["path"] == "/ready" and "tcpSocket" in sglang["livenessProbe"]
    env = {e["name"]: e.get("value") for e in sglang["env"]}
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    drain = next(c for c in pod["containers"] if c["name"] == "kvgate-drain")
    hook = " ".join(drain["lifecycle"]["preStop"]["exec"]["command"])
    assert "kvgate drain" in hook and "--wait" in hook and "--timeout-s 840" in hook
    wait_hook = " ".join(sglang["lifecycle"]["preStop"]["exec"]["command"])
    assert "seq 1 870" in wait_hook and "/var/run/kvgate/drained" in wait_hook
    assert pod["terminationGracePeriodSeconds"] >= 900  # > 870 s hook wait > 840 s drain
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_monitoring_and_autoscaling(built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built["overlays/gpu-fleet"]
    so = find(docs, "ScaledObject", "sglang")
    assert so["spec"]["scaleTargetRef"]["name"] == "sglang"
    assert "kvgate_desired_replicas" in so["spec"]["triggers"][0]["metadata"]["query"]
    sm = find(docs, "ServiceMonitor", "kvgate")
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvgate"}
    dash_cm = find(docs, "ConfigMap", "kvgate-grafana-dashboard")
    assert dash_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dash_cm["data"]["kvgate-dashboard.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("kvgate_requests_total", "kvgate_route_decisions_total", "kvgate_cache_hit_ratio",
                   "kvgate_request_ttft_seconds", "kvgate_replica_in_flight", "kvgate_replica_state",
                   "kvgate_desired_replicas"):
        assert metric in exprs, metric
    redis = find(docs, "StatefulSet", "kvgate-redis")
    assert "volumeClaimTemplates" not in redis["spec"]  # a cache: no persistence


def test_generated_sglang_args_are_current() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "sglang-args", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
