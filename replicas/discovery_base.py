"""What every discovery source shares: the target it drives, ``notify``, replica URLs.

Its own module so that ``replicas.discovery`` (static, DNS, the factory) and
``replicas.discovery_k8s`` (EndpointSlices) both import it and not each other.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from prefix_index.base import ReplicaId

log = logging.getLogger("replicas.discovery")


class DiscoveryTarget(Protocol):
    """What discovery drives; the Registry's methods of the same names.

    ``drain`` and ``remove`` may raise ``KeyError`` for a replica the target no longer
    knows (the Registry removes a drained replica by itself): :func:`notify` ignores it.
    """

    async def add(self, url: ReplicaId) -> object: ...

    async def drain(self, url: ReplicaId) -> object: ...

    async def remove(self, url: ReplicaId) -> object: ...


async def notify(target: DiscoveryTarget, op: str, url: ReplicaId) -> None:
    """``target.<op>(url)``; an unknown replica (KeyError) is not an error here."""
    method: Callable[[ReplicaId], Awaitable[object]] = getattr(target, op)
    try:
        await method(url)
    except KeyError:
        log.debug("discovery: %s(%s): replica already gone", op, url)


class Discovery(Protocol):
    async def run(self) -> None:
        """Feed the target; returns (static) or runs until cancelled."""
        ...


def replica_url(address: str, port: int, scheme: str = "http") -> ReplicaId:
    """``http://10.0.0.5:30000``; IPv6 addresses in brackets."""
    host = f"[{address}]" if ":" in address else address
    return ReplicaId(f"{scheme}://{host}:{port}")


