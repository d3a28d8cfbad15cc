"""The kustomize overlays build, every object validates offline, and the manifests keep
their promises: secure admin API, network policies, graceful shutdown, site parameters.

Validation (built-in kinds with ``kubernetes-validate``, CRDs against structural schemas)
is in ``tests/deploy/k8s.py``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema  # type: ignore[import-untyped,unused-ignore]
import kubernetes_validate  # type: ignore[import-untyped,unused-ignore]
import pytest

from tests.deploy.k8s import (
    CRD_SCHEMAS,
    DEPLOY,
    K8S_VERSION,
    ROOT,
    TARGETS,
    Doc,
    build,
    build_site,
    containers,
    env_of,
    find,
    validate,
)
from tests.replicas_k8s.fake_api import selects


@pytest.fixture(scope="module")
def built() -> dict[str, list[Doc]]:
    return {t: build(t) for t in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates(built: dict[str, list[Doc]], target: str) -> None:
    kinds = set()
    for doc in built[target]:
        validate(doc)
        kinds.add(doc["kind"])
        assert doc["metadata"].get("namespace") == "kvgate" or doc["kind"] == "Namespace", doc["metadata"]
    assert {"NetworkPolicy", "PodMonitor", "PrometheusRule", "ServiceMonitor", "ScaledObject"} <= kinds
    assert "kvgate-params" not in {d["metadata"]["name"] for d in built[target]}  # local-config: never applied


def test_security_probes_resources(built: dict[str, list[Doc]]) -> None:
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
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "x"},
            "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": "ten minutes"}]}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)
    pm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "x"},
          "spec": {"selector": {}, "endpoints": [{"port": "http"}]}}  # ServiceMonitor's field name
    with pytest.raises(jsonschema.ValidationError):
        validate(pm)


def test_gateway_rbac_is_minimal(built: dict[str, list[Doc]]) -> None:
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


def test_gateway_config_matches_replica_services(built: dict[str, list[Doc]]) -> None:
    """The gateway's EndpointSlice selector (matched against the Services' labels, which
    Kubernetes copies onto their slices) picks exactly the replica pools' headless Services,
    and each Service selects its own Deployment's pods and no other pool's."""
    from gateway.settings import load_settings
    from replicas.discovery_k8s import slice_selector

    settings = load_settings(DEPLOY / "base" / "kvgate.yaml")
    reg = settings.registry
    assert (reg.discovery, settings.port, settings.index.backend) == ("kubernetes", 8000, "redis")
    selector = slice_selector(reg)
    for target, pools in (("overlays/gpu-fleet", {"sglang"}), ("overlays/sim-cpu", {"sglang"}),
                          ("overlays/two-models", {"sglang", "sglang-next"})):
        services = [d for d in built[target] if d["kind"] == "Service" and selects(selector, d)]
        assert {d["metadata"]["name"] for d in services} == pools, target
        deployments = {d["metadata"]["name"]: d for d in built[target] if d["kind"] == "Deployment"}
        for svc in services:
            assert svc["spec"]["clusterIP"] == "None"
            assert reg.k8s_port_name in [p["name"] for p in svc["spec"]["ports"]]
            chosen = [name for name, dep in deployments.items() if selects(
                ",".join(f"{k}={v}" for k, v in svc["spec"]["selector"].items()), dep["spec"]["template"])]
            assert chosen == [svc["metadata"]["name"]], (target, chosen)
            pod = deployments[chosen[0]]["spec"]["template"]["spec"]
            assert "http" in [p["name"] for c in pod["containers"] for p in c.get("ports", [])]


def test_gpu_fleet_replica(built: dict[str, list[Doc]]) -> None:
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


def test_monitoring_and_autoscaling(built: dict[str, list[Doc]]) -> None:
    docs = built["overlays/gpu-fleet"]
    so = find(docs, "ScaledObject", "sglang")
    assert so["spec"]["scaleTargetRef"]["name"] == "sglang"
    model = find(docs, "Service", "sglang")["metadata"]["labels"]["kvgate.io/model"]
    assert so["spec"]["triggers"][0]["metadata"]["query"] == \
        f'max(kvgate_desired_replicas{{namespace="kvgate",model="{model}"}})'  # the pool's own model
    sm = find(docs, "ServiceMonitor", "kvgate")
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvgate"}
    public = find(docs, "Service", "kvgate")  # the ServiceMonitor scrapes the public Service's pods
    assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in public["spec"]["ports"]]
    for target in ("overlays/gpu-fleet", "overlays/sim-cpu"):  # SGLang's own /metrics, per pod
        pm = find(built[target], "PodMonitor", "sglang")
        pod = find(built[target], "Deployment", "sglang")["spec"]["template"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        sglang = next(c for c in pod["spec"]["containers"] if c["name"] == "sglang")
        assert pm["spec"]["podMetricsEndpoints"][0]["port"] in [p["name"] for p in sglang["ports"]]
    dash_cm = find(docs, "ConfigMap", "kvgate-grafana-dashboard")
    assert dash_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dash_cm["data"]["kvgate-dashboard.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
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


ADMIN_TOKEN_FILE = "/var/run/secrets/kvgate-admin/token"


def _mount_of(pod: Doc, container: Doc, secret: str) -> str:
    """The directory where ``container`` mounts Secret ``secret`` (required, not optional)."""
    vols = {v["name"]: v for v in pod["volumes"]}
    for m in container.get("volumeMounts", []):
        src = vols[m["name"]].get("secret")
        if src and src["secretName"] == secret:
            assert not src.get("optional"), "the admin token Secret is required"
            return str(m["mountPath"])
    raise AssertionError(f"{container['name']} does not mount Secret {secret}")


@pytest.mark.parametrize("target", TARGETS)
def test_no_optional_secret_and_no_token_in_env(built: dict[str, list[Doc]], target: str) -> None:
    assert '"optional": true' not in json.dumps(built[target])
    for name, c, _pod in containers(built[target]):
        assert not {"KVGATE_ADMIN_TOKEN", "KVGATE_ADMIN__TOKEN"} & set(env_of(c)), name


def test_gateway_admin_listener_and_token_file(built: dict[str, list[Doc]]) -> None:
    gw = find(built["base"], "Deployment", "kvgate")["spec"]["template"]["spec"]
    c = gw["containers"][0]
    env = env_of(c)
    assert env["KVGATE_ADMIN__PORT"] == "8001"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "admin": 8001}
    assert env["KVGATE_ADMIN__TOKEN_FILE"] == _mount_of(gw, c, "kvgate-admin") + "/token" == ADMIN_TOKEN_FILE
    public = find(built["base"], "Service", "kvgate")
    assert [p["targetPort"] for p in public["spec"]["ports"]] == ["http"]  # admin never public
    admin = find(built["base"], "Service", "kvgate-admin")
    assert admin["spec"]["clusterIP"] == "None" and admin["spec"]["publishNotReadyAddresses"] is True
    assert [(p["port"], p["targetPort"]) for p in admin["spec"]["ports"]] == [(8001, "admin")]


def test_gateway_shutdown_grace_fits_the_pod(built: dict[str, list[Doc]]) -> None:
    gw = find(built["base"], "Deployment", "kvgate")["spec"]["template"]["spec"]
    c = gw["containers"][0]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace_s = float(env_of(c)["KVGATE_SERVER__SHUTDOWN_GRACE_S"])
    margin_s = gw["terminationGracePeriodSeconds"] - float(pre_stop[1]) - grace_s
    assert 5 <= margin_s <= 30, margin_s  # streams get the grace; the kubelet's SIGKILL comes after
    assert grace_s >= 300  # a long agent stream finishes


@pytest.mark.parametrize("target", ["overlays/gpu-fleet", "overlays/sim-cpu"])
def test_drain_uses_admin_port_and_token_file(built: dict[str, list[Doc]], target: str) -> None:
    dep = find(built[target], "Deployment", "sglang")
    pod = dep["spec"]["template"]["spec"]
    drainer = next(c for c in pod["containers"] if "kvgate drain" in json.dumps(c.get("lifecycle", {})))
    hook = " ".join(drainer["lifecycle"]["preStop"]["exec"]["command"])
    assert "--gateway http://kvgate-admin:8001 --all-addresses" in hook
    token_file = _mount_of(pod, drainer, "kvgate-admin") + "/token"
    assert f'export KVGATE_ADMIN_TOKEN="$(cat {token_file})";' in hook  # the environment, not argv
    assert "--admin-token" not in hook
    labels = dep["spec"]["template"]["metadata"]["labels"]
    admin_rule = find(built[target], "NetworkPolicy", "kvgate")["spec"]["ingress"][1]
    assert any(f.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
               and "namespaceSelector" not in f for f in admin_rule["from"])


def _rules_by_port(policy: Doc) -> dict[str, list[Doc]]:
    out: dict[str, list[Doc]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            out.setdefault(str(port["port"]), []).extend(rule["from"])
    return out


def _namespace_of(peer: Doc) -> str | None:
    name = peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
    return None if name is None else str(name)


def test_network_policies(built: dict[str, list[Doc]]) -> None:
    docs = built["overlays/sim-cpu"]
    pods = {name: find(docs, kind, name)["spec"]["template"] for kind, name in (
        ("Deployment", "kvgate"), ("StatefulSet", "kvgate-redis"), ("Deployment", "sglang"))}
    by_port = _rules_by_port(find(docs, "NetworkPolicy", "kvgate"))
    assert set(by_port) == {"http", "admin"}
    assert "monitoring" in [_namespace_of(f) for f in by_port["http"]]  # /metrics
    admin_from = by_port["admin"]  # only the replica pods (drain) and the operators' namespace
    assert [f["podSelector"]["matchLabels"] for f in admin_from if "podSelector" in f] == [
        {"kvgate.io/replicas": "true"}]  # the replica pods of every pool
    assert [_namespace_of(f) for f in admin_from if "namespaceSelector" in f] == ["kvgate-operators"]
    assert _rules_by_port(find(docs, "NetworkPolicy", "kvgate-redis")) == {
        "redis": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvgate"}}}]}
    for policy, pod_name in (("kvgate", "kvgate"), ("kvgate-redis", "kvgate-redis"), ("sglang", "sglang")):
        spec = find(docs, "NetworkPolicy", policy)["spec"]
        pod = pods[pod_name]
        assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), policy
        names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert set(_rules_by_port({"spec": spec})) <= names, policy  # every named port exists


SITE_IMAGES = {"ghcr.io/kvgate/kvgate": ("registry.example/kvgate", "1.2.3"),
               "ghcr.io/kvgate/kvgate-sim": ("registry.example/kvgate-sim", "1.2.3")}
SITE_PARAMS = {"prometheusUrl": "http://prom.obs.svc:9090", "monitoringNamespace": "obs", "operatorNamespace": "ops"}


@pytest.mark.parametrize("overlay", ["overlays/gpu-fleet", "overlays/sim-cpu"])
def test_site_parameters_reach_every_object(overlay: str) -> None:
    docs = build_site(overlay, "team-a", SITE_IMAGES, SITE_PARAMS)
    for doc in docs:
        validate(doc)
        assert doc["metadata"].get("namespace") == "team-a" or doc["kind"] == "Namespace", doc["metadata"]
    assert find(docs, "Namespace", "team-a")
    text = json.dumps(docs)
    for stale in ('namespace=\\"kvgate\\"', "prometheus-operated", '"kvgate-operators"', "ghcr.io/kvgate"):
        assert stale not in text, stale
    trigger = find(docs, "ScaledObject", "sglang")["spec"]["triggers"][0]["metadata"]
    assert trigger["query"] == 'max(kvgate_desired_replicas{namespace="team-a",model="kimi-k2.6"})'
    assert trigger["serverAddress"] == "http://prom.obs.svc:9090"
    assert sorted(re.findall(r'"kubernetes.io/metadata.name": "([^"]+)"', text)) == ["obs", "obs", "ops"]
    images = {c["image"] for _n, c, _p in containers(docs)}
    assert "registry.example/kvgate:1.2.3" in images
    assert ("registry.example/kvgate-sim:1.2.3" in images) == (overlay == "overlays/sim-cpu")
    assert find(docs, "RoleBinding", "kvgate")["subjects"][0]["namespace"] == "team-a"


def test_gateway_env_and_config_load_as_settings(built: dict[str, list[Doc]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The Deployment's KVGATE_* variables are real settings, with the values meant."""
    from gateway.settings import load_settings

    c = find(built["base"], "Deployment", "kvgate")["spec"]["template"]["spec"]["containers"][0]
    env = {k: v for k, v in env_of(c).items() if k.startswith("KVGATE_")}
    assert env and all(isinstance(v, str) for v in env.values())  # literal values, no secret refs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(DEPLOY / "base" / "kvgate.yaml")
    assert (settings.port, settings.admin.port) == (8000, 8001)
    assert str(settings.admin.token_file) == ADMIN_TOKEN_FILE and settings.admin.token is None
    assert settings.server.shutdown_grace_s == float(env["KVGATE_SERVER__SHUTDOWN_GRACE_S"])
