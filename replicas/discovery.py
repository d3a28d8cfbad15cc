"""Replica discovery: a static list, DNS of a headless Service, or Kubernetes EndpointSlices.

Every source feeds one callback interface, :class:`DiscoveryTarget` (the gateway's
``Registry`` implements it): ``add(url)`` when a replica appears or becomes ready again,
``drain(url)`` when it stops taking new work (terminating, not ready, or gone from DNS),
``remove(url)`` when it is gone for good. :func:`make_discovery` picks the source from
``RegistryConfig.discovery``; the caller runs ``await discovery.run()`` as a background
task owned by the app's lifespan (static returns at once; the others loop until
cancelled).

DNS (``discovery = "dns"``): the A/AAAA records of a headless Service list its *ready*
pods. Polled every ``dns_interval_s`` with the event loop's ``getaddrinfo`` (no thread of
ours, no blocking call). An address that appears is added; one that vanishes is drained
(a terminating pod leaves DNS while it still finishes its requests) and removed once it
has stayed absent for ``drain_timeout_s``. A lookup error keeps the current set: a DNS
hiccup must not drain the fleet (note that a headless Service with no ready pod answers
NXDOMAIN, which is also kept; the registry's health probes mark such replicas anyway).
An address becomes its canonical replica id (``replicas.urls``), so a replica also added
by hand in another spelling is one entry; a link-local or metadata address is skipped
with a warning unless ``allow_link_local_replicas``.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from prefix_index.base import ReplicaId
from replicas.config import RegistryConfig
from replicas.discovery_base import Discovery, DiscoveryTarget, notify, replica_url
from replicas.discovery_k8s import EndpointSliceDiscovery
from replicas.urls import ReplicaUrlError, address_replica_url

__all__ = ["Discovery", "DiscoveryTarget", "DnsDiscovery", "StaticDiscovery", "make_discovery", "notify",
           "replica_url", "resolve_addresses"]

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[set[str]]]
"""(host, port) -> the set of IP addresses it resolves to."""


class StaticDiscovery:
    """The configured list, added once."""

    def __init__(self, urls: list[str], target: DiscoveryTarget) -> None:
        self._urls = [ReplicaId(u.rstrip("/")) for u in urls]
        self._target = target

    async def run(self) -> None:
        for url in self._urls:
            await notify(self._target, "add", url)


async def resolve_addresses(host: str, port: int) -> set[str]:
    """All addresses of ``host`` via the loop's getaddrinfo."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


class DnsDiscovery:
    """Polls the A/AAAA records of a (headless Service) name; see the module doc."""

    def __init__(
        self,
        name: str,
        port: int,
        target: DiscoveryTarget,
        *,
        interval_s: float = 10.0,
        remove_after_s: float = 600.0,
        resolver: Resolver = resolve_addresses,
        clock: Callable[[], float] = time.monotonic,
        allow_link_local: bool = False,
    ) -> None:
        self._name, self._port, self._target = name, port, target
        self._allow_link_local = allow_link_local
        self._interval_s, self._remove_after_s = interval_s, remove_after_s
        self._resolver, self._clock = resolver, clock
        self._present: set[ReplicaId] = set()
        self._absent_since: dict[ReplicaId, float] = {}  # drained, waiting to be removed

    async def poll_once(self) -> None:
        """One lookup and the add/drain/remove calls it implies."""
        try:
            addresses = await self._resolver(self._name, self._port)
        except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError
            log.warning("dns discovery: lookup of %s failed (%s); keeping %d replicas",
                        self._name, e, len(self._present))
            return
        now = self._clock()
        seen = {url for a in addresses if (url := self._url(a)) is not None}
        for url in sorted(seen - self._present):
            self._absent_since.pop(url, None)
            await notify(self._target, "add", url)
        for url in sorted(self._present - seen):
            self._absent_since[url] = now
            await notify(self._target, "drain", url)
        self._present = seen
        for url, since in sorted(self._absent_since.items()):
            if now - since >= self._remove_after_s:
                del self._absent_since[url]
                await notify(self._target, "remove", url)

    def _url(self, address: str) -> ReplicaId | None:
        """The canonical id of the replica at ``address`` (``replicas.urls``, the same form
        the admin API and the config use), None when refused (link-local or metadata)."""
        try:
            return address_replica_url(address, self._port, allow_link_local=self._allow_link_local)
        except ReplicaUrlError as e:
            log.warning("dns discovery: %s answered %s, not a usable replica: %s", self._name, address, e)
            return None

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self._interval_s)


def make_discovery(config: RegistryConfig, target: DiscoveryTarget) -> Discovery:
    """The discovery ``config.discovery`` names."""
    if config.discovery == "static":
        return StaticDiscovery(config.replicas, target)
    if config.discovery == "dns":
        if not config.dns_name:
            raise ValueError("registry.discovery = 'dns' needs registry.dns_name")
        return DnsDiscovery(config.dns_name, config.dns_port, target,
                            interval_s=config.dns_interval_s, remove_after_s=config.drain_timeout_s,
                            allow_link_local=config.allow_link_local_replicas)
    return EndpointSliceDiscovery.from_config(config, target)
