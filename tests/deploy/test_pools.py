"""Several replica pools (one model each) from one kustomization and one Helm release.

deploy/overlays/two-models (simulated replicas) and the chart with
deploy/helm/two-models-sim.yaml build the same objects; the chart with
deploy/helm/two-models.yaml deploys two SGLang pools on GPU nodes. In every case each pool
has its own Deployment, Service and PDB selecting its pods only, serves the model its
Service's ``kvgate.io/model`` label names, is scaled by a KEDA ScaledObject of its own on
its own model's ``kvgate_desired_replicas``, and the shared objects (network policies,
PodMonitor, the gateway's discovery and scale-in selectors, RBAC) cover every pool.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from gateway.settings import load_settings
from replicas.discovery_k8s import slice_selector
from tests.deploy.k8s import DEPLOY, Doc, build, find, tool, validate
from tests.deploy.test_helm import assert_same, helm_template, render
from tests.replicas_k8s.fake_api import selects

SIM_POOLS = {"sglang": "kimi-k2.6", "sglang-next": "kimi-next"}


@pytest.fixture(scope="module")
def helm() -> str:
    return tool("helm")


def _match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def _served_model(dep: Doc) -> str:
    """The model a replica Deployment serves: SGLang's --served-model-name or the sim's --model."""
    args = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "sglang")["args"]
    flag = "--served-model-name" if "--served-model-name" in args else "--model"
    return str(args[args.index(flag) + 1])


def check_pools(docs: list[Doc], pools: dict[str, str]) -> None:
    """``pools``: pool name -> served model; the promises of the module doc."""
    for doc in docs:
        validate(doc)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "kvgate"}
    assert set(deployments) == set(pools)
    pod_labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    settings = load_settings(DEPLOY / "base" / "kvgate.yaml")
    discovered = {d["metadata"]["name"] for d in docs
                  if d["kind"] == "Service" and selects(slice_selector(settings.registry), d)}
    assert discovered == set(pools)  # the gateway's one EndpointSlice selector finds every pool
    for name, model in pools.items():
        assert _served_model(deployments[name]) == model
        assert find(docs, "Service", name)["metadata"]["labels"]["kvgate.io/model"] == model
        for kind, selector in (("Deployment", deployments[name]["spec"]["selector"]["matchLabels"]),
                               ("Service", find(docs, "Service", name)["spec"]["selector"]),
                               ("PodDisruptionBudget",
                                find(docs, "PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"])):
            assert [p for p, labels in pod_labels.items() if _match(selector, labels)] == [name], (kind, name)
    shared = [find(docs, "NetworkPolicy", "sglang")["spec"]["podSelector"]["matchLabels"],
              find(docs, "PodMonitor", "sglang")["spec"]["selector"]["matchLabels"],
              dict([settings.scale.pod_selector.split("=")])]
    shared += [f["podSelector"]["matchLabels"] for f in find(docs, "NetworkPolicy", "kvgate")["spec"]["ingress"][1]["from"]
               if "podSelector" in f]  # the admin port: every pool's preStop drain
    for selector in shared:
        assert all(_match(selector, labels) for labels in pod_labels.values()), selector
    role = find(docs, "Role", "kvgate")  # namespace-wide: every pool's slices and pods
    assert all("resourceNames" not in rule for rule in role["rules"])
    check_scaled_objects(docs, pools)


def check_scaled_objects(docs: list[Doc], pools: dict[str, str]) -> None:
    """Each ScaledObject scales one pool's Deployment on that pool's own model's signal."""
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        name = so["metadata"]["name"]
        assert name in pools and so["spec"]["scaleTargetRef"]["name"] == name, name
        query = so["spec"]["triggers"][0]["metadata"]["query"]
        found = re.fullmatch(r'max\(kvgate_desired_replicas\{namespace="[a-z0-9-]+",model="([^"]+)"\}\)', query)
        assert found and found.group(1) == pools[name], (name, query)


def test_two_models_overlay() -> None:
    docs = build("overlays/two-models")
    check_pools(docs, SIM_POOLS)
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject") == ["sglang", "sglang-next"]


def test_two_models_sim_values_render_the_overlay(helm: str) -> None:
    rendered = render(helm, "kvgate", "createNamespace=true", files=("two-models-sim.yaml",))
    check_pools(rendered, SIM_POOLS)
    assert_same(rendered, build("overlays/two-models"))


def test_two_models_gpu_values(helm: str) -> None:
    docs = render(helm, "kvgate", files=("two-models.yaml",))
    check_pools(docs, {"sglang": "kimi-k2.6", "sglang-next": "kimi-next"})
    base, nxt = find(docs, "Deployment", "sglang"), find(docs, "Deployment", "sglang-next")
    args = {name: next(c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "sglang")["args"]
            for name, d in (("sglang", base), ("sglang-next", nxt))}
    for name, path, draft in (("sglang", "/models/Kimi-K2.6", "/models/Kimi-K2.6-DFlash"),
                              ("sglang-next", "/models/Kimi-Next", "/models/Kimi-Next-DFlash")):
        assert args[name][args[name].index("--model-path") + 1] == path
        assert args[name][args[name].index("--speculative-draft-model-path") + 1] == draft
    assert (base["spec"]["replicas"], nxt["spec"]["replicas"]) == (2, 2)
    # everything else of the replica is the same launch: the pools differ only in their values
    strip = {"--model-path", "--served-model-name", "--speculative-draft-model-path"}
    same = [[a for i, a in enumerate(v) if a not in strip and (i == 0 or v[i - 1] not in strip)] for v in args.values()]
    assert same[0] == same[1]
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject") == ["sglang", "sglang-next"]
    assert len([d for d in docs if d["kind"] == "PersistentVolumeClaim"]) == 1  # one model cache


def test_pool_values_override_and_defaults(helm: str) -> None:
    resources = {"requests": {"cpu": "1500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    docs = render(helm, "kvgate", "fleet=sim-cpu", "pools[0].name=sglang", "pools[0].model=a",
                  "pools[0].replicas=0", "pools[0].resources.requests.cpu=1500m", "pools[0].resources.requests.memory=1Gi",
                  "pools[0].resources.limits.memory=2Gi", "pools[1].name=pool-b", "pools[1].model=b",
                  "pools[1].autoscale=true")
    check_pools(docs, {"sglang": "a", "pool-b": "b"})
    dep = find(docs, "Deployment", "sglang")
    assert dep["spec"]["replicas"] == 0  # set, even to 0
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"] == resources
    assert find(docs, "Deployment", "pool-b")["spec"]["replicas"] == 4  # the overlay's
    scaled = {d["metadata"]["name"]: d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "ScaledObject"}
    assert scaled == {"sglang": "sglang", "pool-b": "pool-b"}


def test_autoscale_false_drops_the_pools_scaled_object(helm: str) -> None:
    docs = render(helm, "kvgate", "pools[1].autoscale=false", files=("two-models.yaml",))
    check_pools(docs, {"sglang": "kimi-k2.6", "sglang-next": "kimi-next"})
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject"] == ["sglang"]


def test_pool_needs_name_and_model(helm: str) -> None:
    out = helm_template(helm, "kvgate", "pools[0].name=sglang")
    assert out.returncode != 0 and "every entry of pools needs name and model" in out.stderr


def test_helm_lint_two_pools(helm: str) -> None:
    for values in ("two-models.yaml", "two-models-sim.yaml"):
        out = subprocess.run([helm, "lint", str(DEPLOY / "helm" / "kvgate"), "-f", str(DEPLOY / "helm" / values)],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
