"""`session-hash`: consistent hashing with bounded loads (CHWBL), as KubeAI routes.

The key is ``ctx.routing_key`` (the session key, else a prefix of the prompt; the
request id when the gateway has neither). Each replica owns ``virtual_nodes`` points
on a 64-bit ring (``xxh3_64("<replica>#<i>")``); the key's hash is looked up on the
ring and walked clockwise to the first candidate whose load stays within the bound:

    in_flight + 1 <= ceil(load_factor * (total_in_flight + 1) / len(candidates))

(Mirrokni et al., "Consistent Hashing with Bounded Loads"; KubeAI uses load factor
1.25). Load is the gateway's own in-flight count. The ring hash is unseeded on
purpose: every gateway replica must build the same ring. Ring membership follows the
``on_replica_added/removed`` hooks; candidates the hooks have not announced are added
on the fly, so a decision never depends on hook order.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from policies.base import RequestContext, RoutingInputs
from policies.baselines import single_scorer_policy
from policies.config import parse_params
from policies.framework import Pipeline
from policies.hooks import NoopHook
from prefix_index.base import ReplicaId
from replicas.model import ReplicaView

NAME = "session-hash"


@dataclass(frozen=True, slots=True)
class SessionHashParams:
    load_factor: float = 1.25  # a replica takes at most this times the mean load (+1)
    virtual_nodes: int = 100  # points per replica on the ring


class HashRing:
    """Ring points per replica; the merged ring is memoised per candidate set."""

    def __init__(self, virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        self._points: dict[ReplicaId, list[int]] = {}
        self._merged: tuple[frozenset[ReplicaId], list[int], list[ReplicaId]] | None = None

    def add(self, replica: ReplicaId) -> None:
        if replica not in self._points:
            self._points[replica] = [
                xxhash.xxh3_64_intdigest(f"{replica}#{i}".encode())
                for i in range(self.virtual_nodes)
            ]

    def remove(self, replica: ReplicaId) -> None:
        self._points.pop(replica, None)
        self._merged = None

    def walk(self, key: str, members: Sequence[ReplicaId]) -> list[ReplicaId]:
        """``members`` in ring order starting at the key's position (each once)."""
        for m in members:
            self.add(m)
        wanted = frozenset(members)
        if self._merged is None or self._merged[0] != wanted:
            pairs = sorted((p, r) for r in wanted for p in self._points[r])
            self._merged = (wanted, [p for p, _ in pairs], [r for _, r in pairs])
        _, points, owners = self._merged
        start = bisect.bisect_left(points, xxhash.xxh3_64_intdigest(key.encode()))
        order: list[ReplicaId] = []
        seen: set[ReplicaId] = set()
        for i in range(len(points)):
            owner = owners[(start + i) % len(points)]
            if owner not in seen:
                seen.add(owner)
                order.append(owner)
                if len(order) == len(wanted):
                    break
        return order


class ChwblScorer(NoopHook):
    """Scorer (one-hot on the CHWBL choice) and hook (ring membership)."""

    name = "chwbl"

    def __init__(self, params: SessionHashParams) -> None:
        self.params = params
        self.ring = HashRing(params.virtual_nodes)

    def choose(self, ctx: RequestContext, candidates: Sequence[ReplicaView]) -> ReplicaId:
        load = {c.id: c.in_flight for c in candidates}
        bound = math.ceil(self.params.load_factor * (sum(load.values()) + 1) / len(candidates))
        order = self.ring.walk(ctx.routing_key or ctx.request_id, [c.id for c in candidates])
        for rid in order:
            if load[rid] + 1 <= bound:
                return rid
        return min(order, key=lambda r: load[r])

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        if not candidates:
            return {}
        chosen = self.choose(ctx, candidates)
        return {c.id: 1.0 if c.id == chosen else 0.0 for c in candidates}

    def on_replica_added(self, replica: ReplicaId) -> None:
        self.ring.add(replica)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        self.ring.remove(replica)


def build(params: Mapping[str, Any] | None, seed: int | None) -> Pipeline:
    p = parse_params(SessionHashParams, params, NAME)
    if p.load_factor < 1.0 or p.virtual_nodes < 1:
        raise ValueError(f"policy {NAME!r}: load_factor must be >= 1 and virtual_nodes >= 1")
    chwbl = ChwblScorer(p)
    return single_scorer_policy(NAME, chwbl, params, seed, random_ties=False, state=chwbl)
