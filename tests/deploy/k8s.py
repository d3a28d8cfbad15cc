"""Shared by the deploy tests: build the kustomizations, validate every object offline.

Built-in kinds are validated with ``kubernetes-validate`` (strict: unknown fields fail)
for Kubernetes ``K8S_VERSION``. The CRD kinds (ServiceMonitor, PodMonitor,
PrometheusRule, ScaledObject) have no schema there: they are validated against the
structural JSON schemas below, written from the CRDs' documented fields (the fields these
manifests use; anything else in ``spec`` fails). Any other kind fails.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema  # type: ignore[import-untyped,unused-ignore]
import kubernetes_validate  # type: ignore[import-untyped,unused-ignore]
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBECTL = "/usr/bin/kubectl"
K8S_VERSION = "1.34.0"
TARGETS = ["base", "overlays/gpu-fleet", "overlays/sim-cpu", "overlays/two-models"]
Doc = dict[str, Any]

_NAME = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
_DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": _STRINGS, "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"],
        "properties": {"key": {"type": "string"}, "values": {"type": "array", "items": {"type": "string"}},
                       "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]}}}}}}
_ENDPOINT = {"type": "object", "required": ["port"], "additionalProperties": False, "properties": {
    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
    "interval": _DURATION, "scrapeTimeout": _DURATION}}
_RULE = {"type": "object", "required": ["expr"], "additionalProperties": False,
         "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
         "properties": {"record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
                        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                        "expr": {"type": "string", "minLength": 1}, "for": _DURATION,
                        "labels": _STRINGS, "annotations": _STRINGS}}


def _crd(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["metadata", "spec"], "properties": {"metadata": _NAME, "spec": spec}}


CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _crd({
        "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
        "properties": {"selector": _SELECTOR, "namespaceSelector": {"type": "object"},
                       "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}),
    ("monitoring.coreos.com/v1", "PodMonitor"): _crd({
        "type": "object", "required": ["selector", "podMetricsEndpoints"], "additionalProperties": False,
        "properties": {"selector": _SELECTOR, "namespaceSelector": {"type": "object"},
                       "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _crd({
        "type": "object", "required": ["groups"], "additionalProperties": False,
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "interval": _DURATION,
                           "rules": {"type": "array", "minItems": 1, "items": _RULE}}}}}}),
    ("keda.sh/v1alpha1", "ScaledObject"): _crd({
        "type": "object", "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {"type": "object", "required": ["name"]},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
            "advanced": {"type": "object"},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "metadata"],
                "properties": {"type": {"type": "string"}, "metadata": _STRINGS}}}}}),
}


def kustomize(path: Path) -> str:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def parse(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def build(target: str) -> list[Doc]:
    return parse(kustomize(DEPLOY / target))


def _generator() -> ModuleType:
    """deploy/helm/generate.py (not a package): it owns how a site overlay is built."""
    spec = importlib.util.spec_from_file_location("kvgate_helm_generate", DEPLOY / "helm" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()


def build_site(overlay: str, namespace: str, images: Mapping[str, tuple[str, str]],
               params: Mapping[str, str]) -> list[Doc]:
    """Build a site overlay of ``overlay``: another namespace, images (name -> (new name,
    tag)) and kvgate-params values, the way an operator's own kustomization would."""
    site = GENERATOR.site_kustomization(overlay, namespace, dict(images), dict(params))
    return parse(GENERATOR.build_site(site))


def validate(doc: Doc) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.validate(doc, CRD_SCHEMAS[key])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def containers(docs: list[Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            pod = d["spec"]["template"]["spec"]
            for c in pod["containers"]:
                yield f"{d['metadata']['name']}/{c['name']}", c, pod


def env_of(container: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def tool(name: str) -> str:
    """The path of ``name`` (promtool, helm: tools/ops/install.sh installs them). Missing:
    a failure under CI (``CI`` set, CI installs them), a skip with that hint elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found: run tools/ops/install.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path
