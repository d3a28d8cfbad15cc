"""Builders for hand-made routing inputs, and a tiny fleet model that applies decisions."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import xxhash

from policies.base import Decision, RequestContext, RoutingInputs, SessionKeys
from policies.framework import Pipeline
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from replicas.model import ReplicaState, ReplicaView

BLOCK_TOKENS = 64


def rid(i: int) -> ReplicaId:
    return ReplicaId(f"http://127.0.0.1:{31001 + i}")


def view(i: int, **kw: object) -> ReplicaView:
    base: dict[str, object] = {
        "id": rid(i),
        "state": ReplicaState.ACTIVE,
        "device_tokens": 500_000,
        "host_tokens": 0,
        "max_running_requests": 64,
    }
    base.update(kw)
    return ReplicaView(**base)  # type: ignore[arg-type]


def ctx(
    prompt_tokens: int,
    *,
    session: str | None = None,
    parent: str | None = None,
    prefix: str = "p",
    request_id: str = "r",
    max_tokens: int | None = 256,
    routing_text: str = "",
) -> RequestContext:
    """A request whose block chain is named by ``prefix``: equal prefixes share blocks."""
    blocks = prompt_tokens // BLOCK_TOKENS
    return RequestContext(
        request_id=request_id,
        endpoint="chat",
        model="m",
        session=SessionKeys(session, parent),
        block_hashes=tuple(
            xxhash.xxh3_64_intdigest(f"{prefix}/{k}".encode()) for k in range(blocks)
        ),
        prompt_chars=prompt_tokens * 4,
        est_prompt_tokens=prompt_tokens,
        block_tokens=BLOCK_TOKENS,
        max_tokens=max_tokens,
        routing_key=session or prefix,
        routing_text=routing_text,
    )


def inputs(
    replicas: list[ReplicaView],
    *,
    matches: dict[ReplicaId, PrefixMatch] | None = None,
    session: SessionEntry | None = None,
    parent: SessionEntry | None = None,
    resident: dict[ReplicaId, int] | None = None,
    now_s: float = 10_000.0,
) -> RoutingInputs:
    return RoutingInputs(
        replicas=tuple(replicas),
        matches={r.id: (matches or {}).get(r.id, PrefixMatch()) for r in replicas},
        session=session,
        parent_session=parent,
        resident_tokens=resident or {},
        now_s=now_s,
    )


@dataclass
class Fleet:
    """Views updated the way the gateway's load accounting would after each decision."""

    views: dict[ReplicaId, ReplicaView]
    resident: dict[ReplicaId, int] = field(default_factory=dict)
    sessions: dict[str, SessionEntry] = field(default_factory=dict)

    @classmethod
    def of(cls, n: int, **kw: object) -> Fleet:
        return cls({rid(i): view(i, **kw) for i in range(n)})

    def apply(self, c: RequestContext, d: Decision, now_s: float = 10_000.0) -> None:
        v = self.views[d.replica]
        self.views[d.replica] = dataclasses.replace(
            v,
            in_flight=v.in_flight + 1,
            pending_prefill_tokens=v.pending_prefill_tokens + d.predicted_uncached_tokens,
        )
        if c.session.session is not None:
            old = self.sessions.get(c.session.session)
            if old is not None:
                self.resident[old.replica] = self.resident.get(old.replica, 0) - old.tokens
            entry = SessionEntry(d.replica, c.est_prompt_tokens + (c.max_tokens or 0), now_s)
            self.sessions[c.session.session] = entry
            self.resident[d.replica] = self.resident.get(d.replica, 0) + entry.tokens

    def route(
        self,
        policy: Pipeline,
        c: RequestContext,
        rng: random.Random,
        matches: dict[ReplicaId, PrefixMatch] | None = None,
    ) -> Decision:
        key = c.session.session
        snap = inputs(
            list(self.views.values()),
            matches=matches,
            session=self.sessions.get(key) if key else None,
            parent=self.sessions.get(c.session.parent) if c.session.parent else None,
            resident=dict(self.resident),
        )
        d = policy.decide(c, snap, rng)
        self.apply(c, d)
        return d

    def counts(self, decisions: list[Decision]) -> dict[ReplicaId, int]:
        out = {r: 0 for r in self.views}
        for d in decisions:
            out[d.replica] += 1
        return out
