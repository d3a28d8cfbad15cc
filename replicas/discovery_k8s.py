"""Kubernetes discovery: list + watch the EndpointSlices of the replicas' Service(s).

Which slices: those of one Service (``k8s_service``: label ``kubernetes.io/service-name``)
or every slice matching a label selector (``k8s_selector``): one replica pool per model
is one Service, and Kubernetes copies a Service's labels onto its EndpointSlices, so
``kvgate.io/replicas=true`` on each pool's Service finds every pool with one watch
(deploy/README.md, "Several models"). Which model a replica serves is not taken from
labels: its ``/v1/models`` says (``replicas.probe``), whatever the pool is called.

The API calls are ``replicas.kube``'s (kubernetes-asyncio): list the matching slices,
then watch from the list's ``resourceVersion`` with bookmarks (a ``BOOKMARK`` only
advances the version); a watch the server ends (``timeout_s``) is resumed from the last
version seen; ``410 Gone`` (HTTP status or ERROR event) means "relist"; any other failure
is logged and the discovery relists after ``retry_s``. In a pod the API server, CA and
(rotated) service-account token come from the standard in-cluster locations, elsewhere
from the kubeconfig (``replicas.kube``); the Role needs get/list/watch on
``endpointslices`` only. Tested end to end against a local API server over TLS
(tests/replicas_k8s/test_discovery_k8s.py).

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
import logging
from collections.abc import Mapping
from typing import Any

from prefix_index.base import ReplicaId
from replicas.config import RegistryConfig
from replicas.discovery_base import DiscoveryTarget, notify
from replicas.kube import ApiServer, Gone, KubeClient, list_endpoint_slices, watch_endpoint_slices
from replicas.urls import ReplicaUrlError, address_replica_url

log = logging.getLogger(__name__)

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


def slice_selector(config: RegistryConfig) -> str:
    """The label selector of the replicas' EndpointSlices: ``k8s_selector`` as it is, else
    the slices of Service ``k8s_service``."""
    if config.k8s_selector:
        return config.k8s_selector
    if config.k8s_service:
        return f"kubernetes.io/service-name={config.k8s_service}"
    raise ValueError("registry.discovery = 'kubernetes' needs registry.k8s_selector or registry.k8s_service")


class EndpointSliceDiscovery:
    """List + watch the EndpointSlices ``selector`` matches and drive the target (module doc)."""

    def __init__(
        self,
        api: ApiServer,
        selector: str,
        target: DiscoveryTarget,
        *,
        port_name: str | None = None,
        watch_timeout_s: int = 300,
        retry_s: float = 2.0,
        allow_link_local: bool = False,
    ) -> None:
        self._api, self._target, self._port_name = api, target, port_name
        self._allow_link_local = allow_link_local
        self._selector = selector  # a label selector of EndpointSlices (slice_selector)
        self._watch_timeout_s, self._retry_s = watch_timeout_s, retry_s
        self._slices: dict[str, dict[ReplicaId, EndpointState]] = {}
        self._known: dict[ReplicaId, EndpointState] = {}  # what the target was told
        self.relists = 0

    @classmethod
    def from_config(cls, config: RegistryConfig, target: DiscoveryTarget) -> EndpointSliceDiscovery:
        selector = slice_selector(config)  # a config error first, before any environment lookup
        return cls(ApiServer.from_environment(config.k8s_namespace), selector, target,
                   port_name=config.k8s_port_name, allow_link_local=config.allow_link_local_replicas)

    def _endpoints(self, obj: Mapping[str, Any]) -> dict[ReplicaId, EndpointState]:
        return slice_endpoints(obj, self._port_name, allow_link_local=self._allow_link_local)

    async def run(self) -> None:
        kube = await self._connect()
        try:
            while True:
                try:
                    version = await self._list(kube)
                    while True:
                        version = await self._watch(kube, version)
                except Gone:
                    log.info("endpointslice watch: 410 Gone, relisting")
                except Exception as e:  # noqa: BLE001 - the loop outlives any API trouble; logged, retried
                    log.warning("endpointslice watch failed (%s: %s); relisting in %.1fs",
                                type(e).__name__, e, self._retry_s)
                    await asyncio.sleep(self._retry_s)
        finally:
            await kube.aclose()

    async def _connect(self) -> KubeClient:
        while True:
            try:
                return await self._api.connect()
            except Exception as e:  # noqa: BLE001 - e.g. a token not mounted yet: logged, retried
                log.warning("kubernetes client: cannot connect (%s: %s); retrying in %.1fs",
                            type(e).__name__, e, self._retry_s)
                await asyncio.sleep(self._retry_s)

    async def _list(self, kube: KubeClient) -> str:
        version, items = await list_endpoint_slices(kube, self._selector)
        self.relists += 1
        self._slices = {item["metadata"]["name"]: self._endpoints(item) for item in items}
        await self._sync()
        return version

    async def _watch(self, kube: KubeClient, version: str) -> str:
        """One watch request; returns the last resourceVersion seen when it ends."""
        async for event in watch_endpoint_slices(kube, self._selector, version, self._watch_timeout_s):
            await self._apply(event.type, event.object)
            version = event.resource_version
        return version

    async def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ERROR events are the client's: they raise)."""
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._slices[meta["name"]] = self._endpoints(obj)
        elif kind == "DELETED":
            self._slices.pop(meta["name"], None)
        else:
            return  # BOOKMARK: only the version moves
        await self._sync()

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
