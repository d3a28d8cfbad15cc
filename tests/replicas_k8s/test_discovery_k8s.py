"""EndpointSlice discovery against a local server speaking the Kubernetes list+watch protocol.

The fake API server (tests/replicas_k8s/fake_api.py: starlette under uvicorn on 127.0.0.1,
HTTPS with a test CA) serves recorded lists and watch streams: ADDED ready, MODIFIED
terminating, a BOOKMARK, DELETED, an ERROR 410 event forcing a relist, a watch refused with
HTTP 410 forcing another, an ERROR 500 event (a relist after the retry pause). The client
reaches it as in a pod (service-account token, CA and namespace files) or through a
kubeconfig.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from prefix_index.base import ReplicaId
from replicas.config import RegistryConfig
from replicas.discovery import make_discovery
from replicas.discovery_k8s import (
    EndpointSliceDiscovery,
    EndpointState,
    slice_endpoints,
    slice_selector,
)
from replicas.kube import ApiServer, KubeError, list_endpoint_slices
from tests.replicas_k8s.fake_api import (
    Doc,
    FakeApi,
    Served,
    Tls,
    kubeconfig,
    make_tls,
    service_account,
)
from tests.replicas_k8s.fake_api import endpoint_slice as eps
from tests.support.procs import free_port

SGLANG = "kubernetes.io/service-name=sglang"  # the slices of Service sglang
READY = {"ready": True, "serving": True, "terminating": False}
TERMINATING = {"ready": False, "serving": True, "terminating": True}
A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"
LISTS = [
    (10, [eps("s1", 10, (A, READY))]),
    (20, [eps("s2", 20, (B, READY)), eps("s3", 20, (C, READY))]),
    (30, [eps("s2", 30, (B, READY)), eps("s3", 30, (C, READY))]),
    (40, [eps("s2", 40, (B, READY)), eps("s3", 40, (C, READY))]),
]
WATCHES: dict[str, list[dict[str, Any]] | int | None] = {
    "10": [
        {"type": "ADDED", "object": eps("s2", 11, (B, READY))},
        {"type": "MODIFIED", "object": eps("s1", 12, (A, TERMINATING))},
        {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                        "metadata": {"resourceVersion": "13"}}},
    ],  # the stream then ends (a watch timeout): re-watch from the bookmark's version
    "13": [
        {"type": "DELETED", "object": eps("s1", 14, (A, TERMINATING))},
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}},
    ],
    "20": 410,  # the watch itself is refused: relist
    "30": [  # another error: logged, relist after retry_s
        {"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError",
                                     "message": "etcd timeout"}},
    ],
    "40": None,  # hold the stream open until the test ends
}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("tls"))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def add(self, url: ReplicaId) -> None:
        self._record("add", url)

    async def drain(self, url: ReplicaId) -> None:
        self._record("drain", url)

    async def remove(self, url: ReplicaId) -> None:
        self._record("remove", url)

    def _record(self, op: str, url: str) -> None:
        self.calls.append((op, url))


async def run_until(disc: EndpointSliceDiscovery, done: Any) -> None:
    """Run the discovery until ``done()`` (bounded: 20 s), then cancel it."""
    task = asyncio.create_task(disc.run())
    try:
        async with asyncio.timeout(20):
            while not done():
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_list_watch_bookmark_gone_relist_in_cluster(tmp_path: Path, tls: Tls,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(lists=LISTS, watches=WATCHES)
    port = free_port()
    service_account(tmp_path, tls, port, monkeypatch, token="sa-token", namespace="llm")
    target = Recorder()
    expected = [("add", f"http://{A}:30000"), ("add", f"http://{B}:30000"), ("drain", f"http://{A}:30000"),
                ("remove", f"http://{A}:30000"), ("add", f"http://{C}:30000")]
    disc = EndpointSliceDiscovery(ApiServer.in_cluster(), SGLANG, target, port_name="http", retry_s=0.05)
    async with Served(api, tls, port):
        await run_until(disc, lambda: api.watched[-1:] == ["40"] and len(target.calls) >= len(expected))
    assert target.calls == expected
    assert api.listed == 4 and api.watched == ["10", "13", "20", "30", "40"]
    assert disc.relists == 4
    assert api.slice_selectors == {SGLANG}
    assert api.auth == {"Bearer sa-token"}


async def test_kubeconfig_context_token_and_namespace(tmp_path: Path, tls: Tls,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(lists=[(7, [eps("s1", 7, (A, READY))])], watches={"7": None}, namespace="team-a")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    target = Recorder()
    async with Served(api, tls) as port:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path, tls, port, "kc-token", "team-a")))
        server = ApiServer.from_environment()
        assert server.kubeconfig == tmp_path / "kubeconfig"
        disc = EndpointSliceDiscovery(server, SGLANG, target, port_name="http", retry_s=0.05)
        await run_until(disc, lambda: api.watched == ["7"] and target.calls)
        other = await ApiServer(kubeconfig=server.kubeconfig, context="other").connect()
        await other.aclose()
    assert other.namespace == "elsewhere"  # the named context's, not the current one's
    assert target.calls == [("add", f"http://{A}:30000")]
    assert api.auth == {"Bearer kc-token"}


async def test_server_certificate_is_verified(tmp_path: Path, tls: Tls, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose certificate the service account's CA did not sign is refused."""
    other = make_tls(tmp_path, "other")
    api = FakeApi(lists=[(1, [])])
    port = free_port()
    service_account(tmp_path, tls, port, monkeypatch)
    async with Served(api, other, port):
        kube = await ApiServer.in_cluster().connect()
        try:
            with pytest.raises(KubeError, match="[Cc]ertificate"):
                await list_endpoint_slices(kube, "kubernetes.io/service-name=sglang")
        finally:
            await kube.aclose()
    assert api.listed == 0


POOLS = "kvgate.io/replicas=true"  # deploy/base/kvgate.yaml: every pool's Service carries it


def pool_slice(name: str, rv: int, service: str, model: str, *endpoints: tuple[str, dict[str, bool]]) -> Doc:
    """A slice of one replica pool's Service: its labels, as the controller copies them."""
    return eps(name, rv, *endpoints, service=service, labels={"kvgate.io/replicas": "true", "kvgate.io/model": model})


async def test_two_pools_one_selector(tmp_path: Path, tls: Tls, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replica pools (Services sglang and sglang-next, one model each) are found by one
    selector through the config; a slice of another Service in the namespace is not a replica."""
    d = "10.0.0.4"
    other = eps("redis-x", 10, (d, READY), service="kvgate-redis")
    api = FakeApi(
        lists=[(10, [pool_slice("sglang-a", 10, "sglang", "kimi-k2.6", (A, READY)),
                     pool_slice("sglang-next-a", 10, "sglang-next", "kimi-k2.7", (B, READY)), other])],
        watches={"10": [
            {"type": "MODIFIED", "object": pool_slice("sglang-next-a", 11, "sglang-next", "kimi-k2.7",
                                                      (B, READY), (C, READY))},
            {"type": "ADDED", "object": eps("redis-y", 12, (d, READY), service="kvgate-redis")},
            {"type": "MODIFIED", "object": pool_slice("sglang-a", 13, "sglang", "kimi-k2.6", (A, TERMINATING))},
        ], "13": None},
    )
    port = free_port()
    service_account(tmp_path, tls, port, monkeypatch, token="sa-token", namespace="llm")
    target = Recorder()
    config = RegistryConfig(discovery="kubernetes", k8s_selector=POOLS, k8s_service="ignored", k8s_port_name="http")
    disc = make_discovery(config, target)
    assert isinstance(disc, EndpointSliceDiscovery)
    async with Served(api, tls, port):
        await run_until(disc, lambda: api.watched == ["10", "13"] and len(target.calls) >= 4)
    assert target.calls == [("add", f"http://{A}:30000"), ("add", f"http://{B}:30000"),
                            ("add", f"http://{C}:30000"), ("drain", f"http://{A}:30000")]
    assert api.slice_selectors == {POOLS}


def test_slice_selector_from_config() -> None:
    assert slice_selector(RegistryConfig(k8s_service="sglang")) == SGLANG
    assert slice_selector(RegistryConfig(k8s_service="sglang", k8s_selector=POOLS)) == POOLS
    with pytest.raises(ValueError, match="k8s_selector or registry.k8s_service"):
        slice_selector(RegistryConfig(discovery="kubernetes"))


def test_slice_states_and_port_choice() -> None:
    obj = eps("s", 1, ("10.0.0.9", {"ready": False, "serving": False, "terminating": False}),
              ("10.0.0.8", {}), ("fd00::1", {"ready": False, "serving": True}))
    got = slice_endpoints(obj, "http")
    assert got == {ReplicaId("http://10.0.0.9:30000"): EndpointState.NOT_READY,
                   ReplicaId("http://10.0.0.8:30000"): EndpointState.READY,
                   ReplicaId("http://[fd00::1]:30000"): EndpointState.DRAINING}
    assert slice_endpoints(obj, "nope") == {}
    assert ReplicaId("http://10.0.0.8:9999") in slice_endpoints(obj, None)


class Forgetful(Recorder):
    """Like the Registry: drain/remove of a replica it no longer knows raise KeyError."""

    async def remove(self, url: ReplicaId) -> None:
        raise KeyError(url)


async def test_readiness_blip_is_left_to_probes_and_unknown_remove_is_fine() -> None:
    target = Forgetful()
    disc = EndpointSliceDiscovery(ApiServer(), SGLANG, target, port_name="http")
    unready = {"ready": False, "serving": False, "terminating": False}
    for version, cond in ((1, READY), (2, unready), (3, READY), (4, TERMINATING)):
        await disc._apply("MODIFIED", eps("s1", version, (A, cond)))
    await disc._apply("BOOKMARK", {"metadata": {"resourceVersion": "5"}})
    await disc._apply("DELETED", eps("s1", 6, (A, TERMINATING)))
    url = f"http://{A}:30000"
    assert target.calls == [("add", url), ("drain", url)]


async def test_in_cluster_config(tmp_path: Path, tls: Tls, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError):
        ApiServer.in_cluster()
    with pytest.raises(RuntimeError, match="no kubeconfig"):
        ApiServer.from_environment()
    service_account(tmp_path, tls, 6443, monkeypatch)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert ApiServer.from_environment() == ApiServer.in_cluster() == ApiServer()
    kube = await ApiServer.in_cluster().connect()
    await kube.aclose()
    assert (kube.api.configuration.host, kube.namespace) == ("https://[fd00::1]:6443", "llm")
    other = await ApiServer.in_cluster("other").connect()
    await other.aclose()
    assert other.namespace == "other"
