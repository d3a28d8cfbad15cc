"""Kubernetes discovery: watch the EndpointSlices of the replicas' Service with plain httpx.

Why httpx and not a Kubernetes client library: the watch protocol is small (list, then
watch from the list's ``resourceVersion``; ``BOOKMARK`` events advance it; ``410 Gone``
means "relist"), httpx is already a dependency, and a local HTTP server speaking the
protocol tests it end to end (tests/replicas_k8s/test_discovery_k8s.py). Inside a pod
the API server, CA and the (rotated) service-account token come from the standard
in-cluster locations; the Role needs get/list/watch on ``endpointslices`` only.

Endpoint states (merged over all slices of the Service, the best state wins):

- ``ready`` (or ``ready`` unset and not terminating) -> a replica: ``add(url)``
- ``terminating`` (or not ready but ``serving``) -> ``drain(url)`` when it was a replica
- not ready, not terminating (a readiness blip, a paused SGLang): no call. The
  registry's own ``/ready`` probes take it out of rotation and back, keeping its cache
  entries; draining here could not be undone by ``add``
- gone from every slice -> ``remove(url)``

A terminating endpoint never seen ready is ignored. The URL is
``http://<address>:<port>`` with the slice's port named ``k8s_port_name`` (or its first
port), in its canonical form (``replicas.urls``); a link-local or metadata address is
skipped with a warning unless ``allow_link_local_replicas``.
"""
from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from prefix_index.base import ReplicaId
from replicas.config import RegistryConfig
from replicas.discovery_base import DiscoveryTarget, notify
from replicas.urls import ReplicaUrlError, address_replica_url

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410 or an ERROR event with code 410)."""


@dataclass(frozen=True)
class ApiServer:
    """Where the API server is and how to authenticate (token re-read on every request)."""

    url: str
    token_path: Path | None = None
    ca_path: Path | None = None
    namespace: str = "default"

    @classmethod
    def in_cluster(cls, namespace: str | None = None) -> ApiServer:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset)")
        host = f"[{host}]" if ":" in host else host
        ns_file = SA_DIR / "namespace"
        ns = namespace or (ns_file.read_text().strip() if ns_file.is_file() else "default")
        return cls(f"https://{host}:{port}", SA_DIR / "token", SA_DIR / "ca.crt", ns)

    def auth(self) -> httpx.Auth:
        return _TokenAuth(self.token_path)

    def client(self, timeout: httpx.Timeout | None = None) -> httpx.AsyncClient:
        verify: Any = str(self.ca_path) if self.ca_path and self.ca_path.is_file() else True
        return httpx.AsyncClient(base_url=self.url, verify=verify, auth=self.auth(),
                                 timeout=timeout or httpx.Timeout(10.0))


class _TokenAuth(httpx.Auth):
    """Bearer token from the projected service-account file (the kubelet rotates it)."""

    def __init__(self, path: Path | None) -> None:
        self._path = path

    def auth_flow(self, request: httpx.Request) -> Any:
        if self._path is not None and self._path.is_file():
            request.headers["Authorization"] = f"Bearer {self._path.read_text().strip()}"
        yield request


class EndpointState(enum.IntEnum):
    """Ordered: a URL in several slices takes its best state."""

    NOT_READY = 0
    DRAINING = 1
    READY = 2


def _endpoint_url(address: str, port: int, allow_link_local: bool) -> ReplicaId | None:
    """The canonical replica id of one endpoint address (``replicas.urls``: the admin API's
    form too), None when refused (a link-local or metadata address, not allowed)."""
    try:
        return address_replica_url(address, port, allow_link_local=allow_link_local)
    except ReplicaUrlError as e:
        log.warning("endpointslice: address %r is not a usable replica: %s", address, e)
        return None


def slice_endpoints(obj: Mapping[str, Any], port_name: str | None, *,
                    allow_link_local: bool = False) -> dict[ReplicaId, EndpointState]:
    """URL -> state of every endpoint of one EndpointSlice object."""
    ports = obj.get("ports") or []
    chosen = next((p for p in ports if port_name is None or p.get("name") == port_name), None)
    if chosen is None or chosen.get("port") is None:
        return {}
    out: dict[ReplicaId, EndpointState] = {}
    for ep in obj.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        terminating = bool(cond.get("terminating", False))
        ready = cond.get("ready")
        if terminating or (ready is False and cond.get("serving")):
            state = EndpointState.DRAINING
        elif ready is None or ready:
            state = EndpointState.READY
        else:
            state = EndpointState.NOT_READY
        for address in ep.get("addresses") or []:
            url = _endpoint_url(str(address), int(chosen["port"]), allow_link_local)
            if url is not None:
                out[url] = max(state, out.get(url, EndpointState.NOT_READY))
    return out


class EndpointSliceDiscovery:
    """List + watch the Service's EndpointSlices and drive the target (module doc)."""

    def __init__(
        self,
        api: ApiServer,
        service: str,
        target: DiscoveryTarget,
        *,
        port_name: str | None = None,
        watch_timeout_s: int = 300,
        retry_s: float = 2.0,
        client: httpx.AsyncClient | None = None,
        allow_link_local: bool = False,
    ) -> None:
        self._api, self._target, self._port_name = api, target, port_name
        self._allow_link_local = allow_link_local
        self._path = SLICES_PATH.format(ns=api.namespace)
        self._selector = f"kubernetes.io/service-name={service}"
        self._watch_timeout_s, self._retry_s = watch_timeout_s, retry_s
        self._client = client
        self._slices: dict[str, dict[ReplicaId, EndpointState]] = {}
        self._known: dict[ReplicaId, EndpointState] = {}  # what the target was told
        self.relists = 0

    @classmethod
    def from_config(cls, config: RegistryConfig, target: DiscoveryTarget) -> EndpointSliceDiscovery:
        if not config.k8s_service:
            raise ValueError("registry.discovery = 'kubernetes' needs registry.k8s_service")
        return cls(ApiServer.in_cluster(config.k8s_namespace), config.k8s_service, target,
                   port_name=config.k8s_port_name, allow_link_local=config.allow_link_local_replicas)

    def _endpoints(self, obj: Mapping[str, Any]) -> dict[ReplicaId, EndpointState]:
        return slice_endpoints(obj, self._port_name, allow_link_local=self._allow_link_local)

    async def run(self) -> None:
        client = self._client or self._api.client(httpx.Timeout(10.0, read=self._watch_timeout_s + 30.0))
        try:
            while True:
                try:
                    version = await self._list(client)
                    while True:
                        version = await self._watch(client, version)
                except Gone:
                    log.info("endpointslice watch: 410 Gone, relisting")
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    log.warning("endpointslice watch failed (%s); relisting in %.1fs", e, self._retry_s)
                    await asyncio.sleep(self._retry_s)
        finally:
            if self._client is None:
                await client.aclose()

    async def _list(self, client: httpx.AsyncClient) -> str:
        resp = await client.get(self._path, params={"labelSelector": self._selector})
        resp.raise_for_status()
        body = resp.json()
        self.relists += 1
        self._slices = {item["metadata"]["name"]: self._endpoints(item) for item in body.get("items") or []}
        await self._sync()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, client: httpx.AsyncClient, version: str) -> str:
        """One watch request; returns the last resourceVersion seen when it ends."""
        params = {"labelSelector": self._selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(self._watch_timeout_s)}
        async with client.stream("GET", self._path, params=params) as resp:
            if resp.status_code == 410:
                raise Gone()
            resp.raise_for_status()
            async for event in _json_lines(resp):
                version = await self._apply(event, version)
        return version

    async def _apply(self, event: Mapping[str, Any], version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise ValueError(f"watch error: {obj.get('message')}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._slices[meta["name"]] = self._endpoints(obj)
        elif kind == "DELETED":
            self._slices.pop(meta["name"], None)
        if kind != "BOOKMARK":
            await self._sync()
        return str(meta.get("resourceVersion") or version)

    async def _sync(self) -> None:
        """Tell the target what changed between what it knows and the merged slices."""
        merged: dict[ReplicaId, EndpointState] = {}
        for endpoints in self._slices.values():
            for url, state in endpoints.items():
                merged[url] = max(state, merged.get(url, EndpointState.NOT_READY))
        for url, state in sorted(merged.items()):
            before = self._known.get(url)
            if state is EndpointState.READY and before is not EndpointState.READY:
                self._known[url] = state
                await notify(self._target, "add", url)
            elif state is EndpointState.DRAINING and before is EndpointState.READY:
                self._known[url] = state
                await notify(self._target, "drain", url)
        for url in sorted(set(self._known) - set(merged)):
            del self._known[url]
            await notify(self._target, "remove", url)


async def _json_lines(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in resp.aiter_lines():
        if line.strip():
            event: dict[str, Any] = json.loads(line)
            yield event
